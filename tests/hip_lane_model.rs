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

#[test]
fn gfx942_wavefront_model() {
    let Some(cc) = clang() else {
        assert_ne!(
            std::env::var("SMALLSEQ_REQUIRE_HIP_MODEL").as_deref(),
            Ok("1"),
            "SMALLSEQ_REQUIRE_HIP_MODEL=1 but no clang found"
        );
        eprintln!("SKIP gfx942_wavefront_model: no clang (ci/hip-compile-check.sh installs one)");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hip_wavefront_model");
    // -O0: the model's run time is its thread exchanges; optimising the kernels' host copy
    // only costs compile time (a minute at -O1, seconds at -O0).
    let build = Command::new(&cc)
        .args(["--driver-mode=g++", "-std=c++20", "-O0", "-o"])
        .arg(&exe)
        .arg(root.join("tests/hip_model/model.cpp"))
        .output()
        .expect("running the compiler");
    assert!(
        build.status.success(),
        "{cc} failed on tests/hip_model/model.cpp:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().expect("running the model");
    let stdout = String::from_utf8_lossy(&run.stdout);
    eprintln!("{stdout}");
    assert!(
        run.status.success(),
        "model failed:\n{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
