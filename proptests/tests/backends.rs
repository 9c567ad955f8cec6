//! Each backend against the f64 reference (every harness property), per dtype.

use smallseq_proptests::backend_suite;
use smallseq_reference::Dtype;

backend_suite! {
    cpu_bf16: "cpu", Dtype::Bf16;
    cpu_f16: "cpu", Dtype::F16;
    cpu_f32: "cpu", Dtype::F32;
}

#[cfg(feature = "cuda")]
backend_suite! {
    cuda_bf16: "cuda", Dtype::Bf16;
    cuda_f16: "cuda", Dtype::F16;
    cuda_f32: "cuda", Dtype::F32;
}

#[cfg(feature = "hip")]
backend_suite! {
    hip_bf16: "hip", Dtype::Bf16;
    hip_f16: "hip", Dtype::F16;
    hip_f32: "hip", Dtype::F32;
}
