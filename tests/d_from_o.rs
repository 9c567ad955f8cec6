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
