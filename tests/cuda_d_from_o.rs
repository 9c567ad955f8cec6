//! The CUDA fallback backward built with `FTB_D_FROM_O=1` (D = rowsum(dO∘O) from the stored O,
//! `docs/semantics.md` §1.7): the backend declares the design, and fallback-path cases, 512-token
//! slots among them, pass every property against it. Skips without a device
//! (`SMALLSEQ_REQUIRE_GPU=1` makes that a failure). The kernels are built with the define
//! whatever `SMALLSEQ_KERNEL_DEFINES` says (`CudaBackend::with_defines` adds it last).
#![cfg(feature = "cuda")]

#[path = "support/cuda_device.rs"]
mod cuda_device;
#[path = "support/d_from_o_cases.rs"]
mod d_from_o_cases;

use smallseq::backend::gpu::cuda::CudaBackend;
use smallseq::backend::BackendInfo;
use smallseq::design::Design;

fn gpu(test: &str) -> Option<CudaBackend> {
    cuda_device::cuda_or_skip(test, &["FTB_D_FROM_O=1"])
}

/// Every property passes under the declared design on the cases of [`d_from_o_cases`].
#[test]
fn d_from_o_fallback_cases_pass_every_property() {
    let Some(be) = gpu("d_from_o_fallback_cases_pass_every_property") else {
        return;
    };
    assert_eq!(be.design(), Design::ProjectDFromO);
    assert!(be.d_from_o());
    let failed = d_from_o_cases::failures_on(&be, 600);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
