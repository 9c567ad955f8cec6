//! The CPU backend's fallback backward with D = rowsum(dO∘O) from the stored O
//! (`CpuBackend::with_d_from_o`, `docs/semantics.md` §1.7), judged under the design it declares:
//! the same cases as the CUDA kernels built with `FTB_D_FROM_O=1` (tests/cuda_d_from_o.rs), so
//! a judge that cannot hold that design fails here, without a device.

#[path = "support/d_from_o_cases.rs"]
mod d_from_o_cases;

use smallseq::backend::cpu::CpuBackend;
use smallseq::backend::BackendInfo;
use smallseq::design::Design;

#[test]
fn d_from_o_fallback_cases_pass_every_property_on_the_cpu() {
    let be = CpuBackend::default().with_d_from_o();
    assert_eq!(be.design(), Design::ProjectDFromO);
    let failed = d_from_o_cases::failures_on(&be, 200);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The cases of seed 3371 that failed on the H100 under D from the stored O after the
/// gradients' yardstick followed it (bench/NOTES.md v21): three dBias (the judge took dBias's D
/// as Σ P·dP) and one dQ, case 8600 (bf16, five slots of two tokens), whose error is O's
/// rounding carried into D, which way each element of O rounds being the implementation's,
/// not the emulation's (its error was 3.6e-6, the CPU's 9.0e-4).
#[test]
fn the_h100s_d_from_o_failures_pass_on_the_cpu() {
    use smallseq::dispatch::Profile;
    use smallseq::harness::campaign::case_seed;
    use smallseq::harness::gen::{build, draw_geometry_for};
    use smallseq::harness::props::{Checker, Outcome};
    use smallseq::harness::rng::Rng;
    let be = CpuBackend::default().with_d_from_o();
    let checker = Checker::isolated(&be);
    let mut failed = Vec::new();
    for i in [873u64, 2657, 3631, 8600] {
        let cs = case_seed(3371, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
        let case = build(&g, cs ^ 0xda7a).unwrap();
        for (p, o) in checker.check(&case, i).unwrap().outcomes {
            if let Outcome::Fail(f) = o {
                failed.push(format!("case {i}: {p}: {}", f.detail));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
