//! With the `hip` feature: compiles the portable kernels of `kernels/` into AMD GPU code objects
//! and embeds them (`$OUT_DIR/hip_code_objects.rs`), so the binary carries its gfx942 kernels.
//!
//! The compiler is `SMALLSEQ_HIP_CLANG` when set (a clang with the AMDGPU target, ROCm's
//! `llvm/bin/clang`, or `hipcc`; `none` embeds nothing), else the first of ROCm's clang,
//! `clang-19`, `clang-20`, `clang-18`, `clang` that accepts `--offload-arch=gfx942`. The flags
//! are `kernels/hip.flags` (shared with `ci/hip-compile-check.sh`). Targets are
//! `SMALLSEQ_HIP_ARCHS` (default `gfx942,gfx90a,gfx950`); an arch the compiler does not know is
//! skipped with a warning, but gfx942 must build when a compiler was found.
//! `SMALLSEQ_HIP_PREBUILT=DIR` embeds `DIR/{small_seq,fallback}.<arch>.hsaco` instead of
//! compiling; `SMALLSEQ_HIP_EXPORT=DIR` writes the objects it embeds there, with `DIR/archs`
//! (the archs, space-separated), as `ci/hip-code-objects.sh` does: either way CI compiles once
//! and checks what it embeds (`.ci/run` exports, so the compile overlaps cargo's).
//! Without a compiler nothing is embedded and the backend needs `SMALLSEQ_HIP_CODE_OBJECTS=DIR`
//! at run time; it says so when opened. Objects compiled from the same sources, flags, archs and
//! compiler as last time are reused, so a rerun of this script (a new commit) costs nothing.
//!
//! Always: `SMALLSEQ_GIT_COMMIT`, the commit the build is made from (empty outside a git
//! checkout), which capsules record (`smallseq.commit`); `<commit>+dirty` when what the build
//! compiles differs from that commit (see `BUILD_INPUTS`), so that a campaign run from an
//! uncommitted change does not name a commit whose code it did not run; and
//! `SMALLSEQ_BUILD_INPUTS`, the paths that decide it, space-separated.
use std::path::{Path, PathBuf};
use std::process::Command;

const STEMS: [&str; 2] = ["small_seq", "fallback"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    git_commit();
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_HIP");
    if std::env::var_os("CARGO_FEATURE_HIP").is_none() {
        return;
    }
    for v in [
        "SMALLSEQ_HIP_CLANG",
        "SMALLSEQ_HIP_ARCHS",
        "SMALLSEQ_HIP_PREBUILT",
        "SMALLSEQ_HIP_EXPORT",
        "ROCM_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    for f in ["portable.h", "small_seq.cu", "fallback.cu", "hip.flags"] {
        println!("cargo:rerun-if-changed=kernels/{f}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let archs: Vec<String> = std::env::var("SMALLSEQ_HIP_ARCHS")
        .unwrap_or_else(|_| "gfx942,gfx90a,gfx950".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let objects = match std::env::var_os("SMALLSEQ_HIP_PREBUILT") {
        Some(dir) => prebuilt(Path::new(&dir), &archs),
        None => match compiler() {
            Some(cc) => compile(&cc, &archs, &out),
            None => {
                println!(
                    "cargo:warning=smallseq: no HIP compiler found (set SMALLSEQ_HIP_CLANG): no \
                     code objects embedded; the hip backend will need SMALLSEQ_HIP_CODE_OBJECTS"
                );
                Vec::new()
            }
        },
    };
    if let Some(dir) = std::env::var_os("SMALLSEQ_HIP_EXPORT") {
        export(Path::new(&dir), &objects);
    }
    let mut rs = String::from(
        "/// Embedded code objects: (arch, kernel file stem, path of the object at build time).\n\
         pub const EMBEDDED: &[(&str, &str, &[u8])] = &[\n",
    );
    for (arch, stem, path) in &objects {
        rs.push_str(&format!(
            "    ({arch:?}, {stem:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    rs.push_str("];\n");
    std::fs::write(out.join("hip_code_objects.rs"), rs).expect("writing hip_code_objects.rs");
}

/// Copies `objects` into `dir` as `<stem>.<arch>.hsaco` and lists their archs in `dir/archs`.
fn export(dir: &Path, objects: &[(String, String, PathBuf)]) {
    std::fs::create_dir_all(dir).expect("creating SMALLSEQ_HIP_EXPORT");
    let mut archs: Vec<&str> = Vec::new();
    for (arch, stem, path) in objects {
        std::fs::copy(path, dir.join(format!("{stem}.{arch}.hsaco")))
            .expect("copying a code object into SMALLSEQ_HIP_EXPORT");
        if !archs.contains(&arch.as_str()) {
            archs.push(arch);
        }
    }
    std::fs::write(dir.join("archs"), format!("{}\n", archs.join(" ")))
        .expect("writing SMALLSEQ_HIP_EXPORT/archs");
}

/// `git` in this package's directory; `None` when it fails or git is missing.
fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// What the binary is compiled from: a change here, committed or not, changes what it runs.
/// Docs, tests and scripts are left out: editing them leaves the build's code the commit's.
const BUILD_INPUTS: [&str; 6] = [
    "src",
    "kernels",
    "reference",
    "Cargo.toml",
    "Cargo.lock",
    "build.rs",
];

/// Emits `SMALLSEQ_GIT_COMMIT` and reruns this script when HEAD moves: HEAD itself (a checkout),
/// the branch it names (a commit) and the packed refs; and when a build input changes, since
/// that may make the tree dirty or clean again. Paths that do not exist are not named, since
/// cargo would rerun the script on every build for them.
fn git_commit() {
    let mut commit = git(&["rev-parse", "HEAD"]).unwrap_or_default();
    if !commit.is_empty() {
        // No optional locks: status would otherwise refresh the index, and two builds at once
        // (CI lints beside the tests' build) would race for its lock.
        let mut args = vec!["--no-optional-locks", "status", "--porcelain", "--"];
        args.extend(BUILD_INPUTS);
        // A status that fails says nothing about the tree; the commit alone is then the best
        // record there is.
        if git(&args).is_some_and(|s| !s.is_empty()) {
            commit.push_str("+dirty");
        }
    }
    println!("cargo:rustc-env=SMALLSEQ_GIT_COMMIT={commit}");
    // For the test that holds the record to `git status` (src/harness/repro.rs).
    println!(
        "cargo:rustc-env=SMALLSEQ_BUILD_INPUTS={}",
        BUILD_INPUTS.join(" ")
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for input in BUILD_INPUTS {
        if root.join(input).exists() {
            println!("cargo:rerun-if-changed={input}");
        }
    }
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(r);
    }
    for w in watch {
        if let Some(p) = git(&["rev-parse", "--git-path", &w]) {
            let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(p);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
}

fn prebuilt(dir: &Path, archs: &[String]) -> Vec<(String, String, PathBuf)> {
    let mut v = Vec::new();
    for arch in archs {
        let paths: Vec<PathBuf> = STEMS
            .iter()
            .map(|s| dir.join(format!("{s}.{arch}.hsaco")))
            .collect();
        if paths.iter().all(|p| p.is_file()) {
            for (s, p) in STEMS.iter().zip(paths) {
                println!("cargo:rerun-if-changed={}", p.display());
                v.push((arch.clone(), s.to_string(), p));
            }
        } else if arch == "gfx942" {
            panic!(
                "SMALLSEQ_HIP_PREBUILT={} lacks the gfx942 code objects",
                dir.display()
            );
        }
    }
    v
}

fn flags() -> Vec<String> {
    std::fs::read_to_string("kernels/hip.flags")
        .expect("kernels/hip.flags")
        .split_whitespace()
        .map(String::from)
        .collect()
}

fn accepts_gfx942(cc: &Path) -> bool {
    Command::new(cc)
        .args([
            "--offload-arch=gfx942",
            "-x",
            "hip",
            "--cuda-device-only",
            "-nogpulib",
        ])
        .args(["-nogpuinc", "-fsyntax-only", "-"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn compiler() -> Option<PathBuf> {
    if let Ok(cc) = std::env::var("SMALLSEQ_HIP_CLANG") {
        if cc == "none" {
            return None;
        }
        return Some(PathBuf::from(cc));
    }
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(r) = std::env::var("ROCM_PATH") {
        cands.push(Path::new(&r).join("llvm/bin/clang"));
    }
    cands.push("/opt/rocm/llvm/bin/clang".into());
    for c in ["clang-19", "clang-20", "clang-18", "clang"] {
        cands.push(c.into());
    }
    cands.into_iter().find(|c| accepts_gfx942(c))
}

/// What the objects of [`compile`] are made from, compared whole with the last build's.
fn compile_key(cc: &Path, archs: &[String]) -> String {
    let mut key = format!(
        "{}\n{}\n{}\n",
        cc.display(),
        flags().join(" "),
        archs.join(",")
    );
    for f in ["portable.h", "small_seq.cu", "fallback.cu"] {
        key.push_str(&std::fs::read_to_string(format!("kernels/{f}")).unwrap_or_default());
    }
    key
}

fn compile(cc: &Path, archs: &[String], out: &Path) -> Vec<(String, String, PathBuf)> {
    let key = compile_key(cc, archs);
    let key_file = out.join("hip_objects.key");
    let listing = out.join("hip_objects.list");
    if std::fs::read_to_string(&key_file).is_ok_and(|k| k == key) {
        if let Some(v) = std::fs::read_to_string(&listing)
            .ok()
            .and_then(|l| reuse(&l))
        {
            return v;
        }
    }
    let v = compile_all(cc, archs, out);
    let list: String = v
        .iter()
        .map(|(a, s, p)| format!("{a}\t{s}\t{}\n", p.display()))
        .collect();
    // The key last, so an interrupted write leaves no key that vouches for a partial list.
    let _ = std::fs::write(&listing, list).and_then(|()| std::fs::write(&key_file, key));
    v
}

/// The objects of a previous build's listing, if every one is still there.
fn reuse(listing: &str) -> Option<Vec<(String, String, PathBuf)>> {
    listing
        .lines()
        .map(|l| {
            let mut it = l.split('\t');
            let (a, s, p) = (it.next()?, it.next()?, PathBuf::from(it.next()?));
            p.is_file().then(|| (a.to_string(), s.to_string(), p))
        })
        .collect()
}

fn compile_all(cc: &Path, archs: &[String], out: &Path) -> Vec<(String, String, PathBuf)> {
    let jobs: Vec<(String, &str)> = archs
        .iter()
        .flat_map(|a| STEMS.iter().map(move |s| (a.clone(), *s)))
        .collect();
    // Each object is one compiler process; the small-seq file dominates (about a minute per
    // arch), so they run side by side.
    let results: Vec<(String, &str, PathBuf, std::io::Result<std::process::Output>)> =
        std::thread::scope(|sc| {
            let hs: Vec<_> = jobs
                .iter()
                .map(|(arch, stem)| {
                    sc.spawn(move || {
                        let obj = out.join(format!("{stem}.{arch}.hsaco"));
                        let r = Command::new(cc)
                            .args(flags())
                            .arg(format!("--offload-arch={arch}"))
                            .arg("-o")
                            .arg(&obj)
                            .arg(format!("kernels/{stem}.cu"))
                            .output();
                        (arch.clone(), *stem, obj, r)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("compiler thread"))
                .collect()
        });
    let mut ok = Vec::new();
    let mut failed_archs: Vec<String> = Vec::new();
    for (arch, stem, obj, r) in results {
        match r {
            Ok(o) if o.status.success() => ok.push((arch, stem.to_string(), obj)),
            Ok(o) => {
                let log = String::from_utf8_lossy(&o.stderr);
                if arch == "gfx942" {
                    panic!(
                        "{} failed on kernels/{stem}.cu for gfx942:\n{log}",
                        cc.display()
                    );
                }
                if !failed_archs.contains(&arch) {
                    println!(
                        "cargo:warning=smallseq: {} cannot build {arch} ({}): skipped",
                        cc.display(),
                        log.lines().next().unwrap_or("")
                    );
                    failed_archs.push(arch);
                }
            }
            Err(e) => panic!("running {}: {e}", cc.display()),
        }
    }
    // An arch is embedded whole or not at all.
    ok.retain(|(a, _, _)| !failed_archs.contains(a));
    ok
}
