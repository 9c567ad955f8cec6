//! The CUDA device of a GPU test, or a visible SKIP line without one (a failure when
//! `SMALLSEQ_REQUIRE_GPU=1`), shared by the GPU test files.

use smallseq::backend::gpu::cuda::CudaBackend;

/// Device 0 with kernels built under `SMALLSEQ_KERNEL_DEFINES` and then `defines`.
pub fn cuda_or_skip(test: &str, defines: &[&str]) -> Option<CudaBackend> {
    match CudaBackend::with_defines(defines) {
        Ok(b) => Some(b),
        Err(e) if std::env::var("SMALLSEQ_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("{test}: SMALLSEQ_REQUIRE_GPU=1 but no device: {e}")
        }
        Err(e) => {
            smallseq::print_skip(format_args!("{test}: {e}"));
            None
        }
    }
}
