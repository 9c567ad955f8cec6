//! The CUDA backend's kernel build: the kernel files of `kernels/` (`portable.h` inlined)
//! compiled to PTX by NVRTC for the device's architecture, kept in the on-disk
//! [`KernelCache`] between processes. Needs NVRTC (loaded at run time), not a device.

use crate::backend::kernel_cache::{fingerprint, KernelCache};
use crate::error::panic_text;
use std::panic::{catch_unwind, AssertUnwindSafe};

const PORTABLE_H: &str = include_str!("../../../kernels/portable.h");
const SMALL_SEQ_CU: &str = include_str!("../../../kernels/small_seq.cu");
const FALLBACK_CU: &str = include_str!("../../../kernels/fallback.cu");
/// The kernel files a module is built from, by name, in module order (small-seq, fallback:
/// [`crate::backend::launch::Family::ALL`]).
pub const KERNEL_FILES: [(&str, &str); 2] =
    [("small_seq.cu", SMALL_SEQ_CU), ("fallback.cu", FALLBACK_CU)];

/// One fingerprint of both kernel files' cache keys (sources, options, defines, NVRTC).
pub fn kernel_fingerprint(arch: &str, defines: &[String], nvrtc: (i32, i32)) -> String {
    let keys: Vec<String> = KERNEL_FILES
        .iter()
        .map(|(name, body)| kernel_key(name, body, arch, defines, nvrtc).2)
        .collect();
    fingerprint(keys.concat().as_bytes())
}

/// NVRTC's version, or why NVRTC cannot be used.
pub fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
    let present = catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() });
    if !present.unwrap_or(false) {
        return Err("libnvrtc was not found (set LD_LIBRARY_PATH to the CUDA toolkit)".into());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; the library was found above.
    let rc = catch_unwind(AssertUnwindSafe(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    }));
    match rc {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Ok((major, minor)),
        Ok(e) => Err(format!("nvrtcVersion: {e:?}")),
        Err(p) => Err(format!("NVRTC: {}", panic_text(p))),
    }
}

/// The inlined source, NVRTC options and cache key of one kernel file: the key holds
/// everything NVRTC's output depends on.
fn kernel_key(
    name: &str,
    body: &str,
    arch: &str,
    defines: &[String],
    (major, minor): (i32, i32),
) -> (String, Vec<String>, String) {
    let src = body.replace("#include \"portable.h\"", PORTABLE_H);
    let options: Vec<String> = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
    .into_iter()
    .chain(defines.iter().map(|d| format!("-D{d}")))
    .collect();
    let key = format!(
        "{name}\n{}\nnvrtc {major}.{minor}\n{src}",
        options.join("\n")
    );
    (src, options, key)
}

/// The PTX of one kernel file (`portable.h` inlined) for `arch` (`sm_90`) under `defines`:
/// from `cache` when an entry for exactly this source, these options and this NVRTC exists,
/// else compiled by NVRTC and stored. Needs NVRTC, not a device.
///
/// # Errors
/// NVRTC missing, or its compile error with the log.
pub fn kernel_ptx(
    name: &str,
    body: &str,
    arch: &str,
    defines: &[String],
    cache: &KernelCache,
) -> std::result::Result<Ptx, String> {
    kernel_ptx_from(name, body, arch, defines, cache, true)
}

/// The PTX of one kernel file, and whether it came from `cache`. `reuse = false` compiles
/// regardless and replaces the entry: for one the driver would not load.
pub(super) fn kernel_ptx_from(
    name: &str,
    body: &str,
    arch: &str,
    defines: &[String],
    cache: &KernelCache,
    reuse: bool,
) -> std::result::Result<Ptx, String> {
    let (major, minor) = nvrtc_version()?;
    let (src, options, key) = kernel_key(name, body, arch, defines, (major, minor));
    if let Some(ptx) = reuse
        .then(|| cache.load(name, key.as_bytes()))
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
    {
        return Ok(Ptx {
            text: ptx,
            cached: true,
        });
    }
    eprintln!(
        "smallseq: compiling {name} for {arch} with NVRTC {major}.{minor} ({})",
        cache.dir().map_or("kernel cache off".into(), |d| format!(
            "once: then kept in {}",
            d.display()
        ))
    );
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        name: Some(name.into()),
        ..Default::default()
    };
    let ptx = match catch_unwind(AssertUnwindSafe(|| {
        cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map(|p| p.to_src())
    })) {
        Ok(Ok(p)) => p,
        Ok(Err(cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. })) => {
            return Err(format!(
                "NVRTC failed on {name}: {nvrtc:?}\n{}",
                log.to_string_lossy()
            ))
        }
        Ok(Err(e)) => return Err(format!("NVRTC failed on {name}: {e:?}")),
        Err(p) => return Err(format!("NVRTC: {}", panic_text(p))),
    };
    if let (Some(dir), Err(e)) = (
        cache.dir(),
        cache.store(name, key.as_bytes(), ptx.as_bytes()),
    ) {
        eprintln!(
            "smallseq: could not keep {name} in {} ({e}); the next process compiles it again",
            dir.display()
        );
    }
    Ok(Ptx {
        text: ptx,
        cached: false,
    })
}

/// Compiles both kernel files for `arch` (`sm_90`) under this process's
/// `SMALLSEQ_KERNEL_DEFINES` into `cache`, with NVRTC and no device: a machine without a GPU
/// fills the cache that a GPU host given the same directory (`SMALLSEQ_KERNEL_CACHE`) and the
/// same NVRTC major.minor then reads instead of compiling. Returns each file's name and whether
/// its entry was there already.
///
/// # Errors
/// NVRTC missing, a compile error, or `cache` disabled (nothing would be kept).
pub fn fill_kernel_cache(
    arch: &str,
    cache: &KernelCache,
) -> std::result::Result<Vec<(&'static str, bool)>, String> {
    if cache.dir().is_none() {
        return Err(format!(
            "the kernel cache is off ({}): nothing to fill",
            crate::backend::kernel_cache::CACHE_ENV
        ));
    }
    let ptxs = kernel_ptxs(arch, &defines_from_env(), cache);
    KERNEL_FILES
        .iter()
        .zip(ptxs)
        .map(|(&(name, _), ptx)| ptx.map(|p| (name, p.cached)))
        .collect()
}

/// The PTX of both kernel files ([`KERNEL_FILES`] order), NVRTC compiling the two in parallel
/// (a cache miss costs tens of seconds each).
pub(super) fn kernel_ptxs(
    arch: &str,
    defines: &[String],
    cache: &KernelCache,
) -> [std::result::Result<Ptx, String>; 2] {
    std::thread::scope(|s| {
        KERNEL_FILES
            .map(|(name, body)| s.spawn(move || kernel_ptx(name, body, arch, defines, cache)))
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| Err(format!("NVRTC: {}", panic_text(p))))
            })
    })
}

/// A kernel file's PTX text, and whether it came from the on-disk cache.
#[derive(Debug)]
pub struct Ptx {
    pub text: String,
    pub cached: bool,
}

/// Extra kernel defines from `SMALLSEQ_KERNEL_DEFINES` (whitespace-separated `NAME` or
/// `NAME=VALUE`): kernel variants for A/B timing (`SS_FWD_BLOCKS=5`, `FT_MIN_BLOCKS=3`, …)
/// without a rebuild.
pub fn defines_from_env() -> Vec<String> {
    std::env::var("SMALLSEQ_KERNEL_DEFINES")
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CACHE_PROBE_CU: &str = "extern \"C\" __global__ void cache_probe(float* x) {\n\
        x[threadIdx.x] = x[threadIdx.x] * 2.0f + 1.0f;\n}\n";

    /// Needs NVRTC only (ci/cuda-compile-check.sh provides PyPI's and sets
    /// SMALLSEQ_REQUIRE_NVRTC=1, so a missing one fails there instead of skipping).
    #[test]
    fn kernel_ptx_compiles_once_per_key_then_reads_the_cache() {
        if let Err(e) = nvrtc_version() {
            assert!(
                std::env::var_os("SMALLSEQ_REQUIRE_NVRTC").is_none(),
                "SMALLSEQ_REQUIRE_NVRTC is set: {e}"
            );
            crate::print_skip(format_args!("kernel_ptx cache: {e}"));
            return;
        }
        let dir = std::env::temp_dir().join(format!("smallseq-ptx-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = KernelCache::at(Some(dir.clone()));
        let entries = || std::fs::read_dir(&dir).map_or(0, |d| d.count());
        // A small kernel, not the shipped files: the cache's behaviour does not depend on the
        // source, and fallback.cu takes 30 s of NVRTC per compile since the tiled kernels (CI
        // compiles the shipped files once, in ci/cuda-ptx.sh).
        let timed = |defines: &[String]| {
            let t = std::time::Instant::now();
            let ptx = kernel_ptx("probe.cu", CACHE_PROBE_CU, "sm_90", defines, &cache)
                .expect("probe.cu compiles");
            (ptx, t.elapsed())
        };
        let (first, compile) = timed(&[]);
        assert!(!first.cached);
        assert!(
            first.text.contains(".entry cache_probe"),
            "not the probe's PTX"
        );
        assert_eq!(entries(), 1);
        let (again, hit) = timed(&[]);
        assert!(again.cached);
        assert_eq!(
            again.text, first.text,
            "the cached PTX differs from the compiled one"
        );
        assert_eq!(entries(), 1, "a hit stored a second entry");
        assert!(
            hit * 4 < compile,
            "hit {hit:?} is not much faster than the compile {compile:?}"
        );
        // Another define is another key: compiled and kept beside the first.
        let (other, _) = timed(&["SMALLSEQ_CACHE_TEST=1".to_string()]);
        assert!(!other.cached);
        assert_eq!(entries(), 2);
        // Refused by the driver: compiled again regardless, the entry replaced.
        let fresh = kernel_ptx_from("probe.cu", CACHE_PROBE_CU, "sm_90", &[], &cache, false)
            .expect("probe.cu compiles");
        assert!(!fresh.cached && fresh.text == first.text);
        assert_eq!(entries(), 2);
        println!(
            "probe.cu: NVRTC {compile:?}, cache hit {hit:?}, {} B of PTX",
            other.text.len()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
