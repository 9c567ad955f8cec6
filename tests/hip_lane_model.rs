//! The gfx942 code path of the kernels, checked on the host (there is no AMD GPU here).
//!
//! `tests/hip_model/model.cpp` includes `kernels/small_seq.cu` and `kernels/fallback.cu`
//! unchanged, with the HIP branch of `portable.h` selected as for gfx942, and runs them on 64
//! fibers in lockstep per wavefront, with models of `ds_bpermute` and of
//! `v_mfma_f32_16x16x16{bf16_1k,f16}` (the ISA's operand layout). It checks the matrix-core
//! fragment moves element by element, that every cross-lane operation is reached by all 64
//! lanes (the matrix cores need uniform control flow), and the small-seq and fallback kernels
//! end to end against a double-precision reference, including empty slots, masks, a grid tail
//! and don't-care tokens left unwritten.
//!
//! Needs a clang (for `ext_vector_type`): `SMALLSEQ_HIP_CLANG`, else `clang++-19`, `clang++-20`,
//! `clang++-18`, `clang++`. Without one it prints SKIP, unless `SMALLSEQ_REQUIRE_HIP_MODEL=1`
//! (`ci/hip-compile-check.sh` sets it after installing clang-19).
use std::path::Path;
use std::process::Command;

fn clang() -> Option<String> {
    let works = |c: &str| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Ok(c) = std::env::var("SMALLSEQ_HIP_CLANG") {
        if c != "none" && works(&c) {
            return Some(c);
        }
    }
    ["clang++-19", "clang++-20", "clang++-18", "clang++"]
        .into_iter()
        .find(|c| works(c))
        .map(String::from)
}

/// Builds the model with `defines` and runs it: (exit success, stdout).
fn build_and_run(cc: &str, name: &str, defines: &[&str]) -> (bool, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    // -O0: the model's run time is its thread exchanges; optimising the kernels' host copy
    // only costs compile time (a minute at -O1, seconds at -O0).
    let build = Command::new(cc)
        .args(["--driver-mode=g++", "-std=c++20", "-O0"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(&exe)
        .arg(root.join("tests/hip_model/model.cpp"))
        .output()
        .expect("running the compiler");
    assert!(
        build.status.success(),
        "{cc} failed on tests/hip_model/model.cpp {defines:?}:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().expect("running the model");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    (run.status.success(), out)
}

fn clang_or_skip(test: &str) -> Option<String> {
    let cc = clang();
    if cc.is_none() {
        assert_ne!(
            std::env::var("SMALLSEQ_REQUIRE_HIP_MODEL").as_deref(),
            Ok("1"),
            "SMALLSEQ_REQUIRE_HIP_MODEL=1 but no clang found"
        );
        eprintln!("SKIP {test}: no clang (ci/hip-compile-check.sh installs one)");
    }
    cc
}

#[test]
fn gfx942_wavefront_model() {
    let Some(cc) = clang_or_skip("gfx942_wavefront_model") else {
        return;
    };
    let (ok, stdout) = build_and_run(&cc, "hip_wavefront_model", &[]);
    eprintln!("{stdout}");
    assert!(ok, "model failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

/// Kernel mutants the model cannot see, with why: its data never overflows f16/bf16. The
/// device campaign sees it (`smallseq mutants --backend cuda`).
const MODEL_BLIND_MUTANTS: &[(&str, &str)] = &[(
    "nan-on-overflow",
    "the model's data never overflows the output type",
)];

/// The kernels' planted bugs (`SMALLSEQ_MUTANT_*`, the catalogue's GPU side) are live: the
/// model's end-to-end check against its double reference fails with each one it can see.
#[test]
fn kernel_mutants_fail_the_model() {
    let Some(cc) = clang_or_skip("kernel_mutants_fail_the_model") else {
        return;
    };
    for m in smallseq::mutants::Mutant::ALL {
        let Some(define) = m.kernel_define() else {
            continue;
        };
        if let Some((_, why)) = MODEL_BLIND_MUTANTS.iter().find(|(n, _)| *n == m.name()) {
            eprintln!("{}: not judged by the model ({why})", m.name());
            continue;
        }
        // The kernel mutants are planted in the small-seq kernels: the tiled fallback's block
        // jobs (most of the model's run time) are left out of these runs.
        let (ok, stdout) = build_and_run(
            &cc,
            &format!("hip_model_{}", m.name()),
            &[define, "HIP_MODEL_SMALL_SEQ_ONLY"],
        );
        let fails = stdout.lines().filter(|l| l.starts_with("FAIL")).count();
        eprintln!("{}: {fails} failing checks", m.name());
        assert!(
            !ok && fails > 0,
            "mutant {} survived the model:\n{stdout}",
            m.name()
        );
    }
}

/// Kernel variants other than the default that are timed on the H200 (bench/NOTES.md v6, v7):
/// the small-seq kernels without the dead-tile skips, with one of them, and the forward with
/// the row tile's alone (the fastest forward measured, not yet fuzzed on the device).
const KERNEL_VARIANTS: &[&str] = &[
    "SS_SKIP_DEAD_TILES=0",
    "SS_SKIP_DEAD_TILES=1",
    "SS_SKIP_DEAD_TILES=2",
    "SS_SKIP_DEAD_FWD=1",
];

/// The kernel variants compute the same outputs: the model's end-to-end checks pass with each
/// one.
#[test]
fn kernel_variants_pass_the_model() {
    let Some(cc) = clang_or_skip("kernel_variants_pass_the_model") else {
        return;
    };
    for define in KERNEL_VARIANTS {
        let (ok, stdout) = build_and_run(
            &cc,
            &format!("hip_model_{}", define.replace('=', "_")),
            &[define, "HIP_MODEL_SMALL_SEQ_ONLY"],
        );
        assert!(
            ok && stdout.contains(" passed, 0 failed"),
            "{define}:\n{stdout}"
        );
    }
}
