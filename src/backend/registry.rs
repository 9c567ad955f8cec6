//! Backends by name: the one place a backend is built from a name (`--backend` of the CLI's
//! commands, `smallseq worker`, `smallseq mutants`, the property suites).

use super::cpu::CpuBackend;
use super::lanes::Lanes;
use super::Backend;
use crate::error::{Error, Result};
use crate::mutants::{Defects, Mutant};

/// Backend names the CLI accepts.
pub const NAMES: [&str; 4] = ["cpu", "cuda", "hip", "te625-model"];

/// What to open.
#[derive(Clone, Copy, Debug, Default)]
pub struct Spec<'a> {
    /// One of [`NAMES`].
    pub name: &'a str,
    /// The device's ordinal, as the runtime numbers them after `CUDA_VISIBLE_DEVICES` /
    /// `HIP_VISIBLE_DEVICES` (GPU backends; the CPU backends have one).
    pub device: usize,
    /// Bugs to plant: in the CPU backend any of the catalogue, in the CUDA kernels those they
    /// carry as defines ([`Mutant::kernel_define`]).
    pub mutants: &'a [Mutant],
    /// Compile and load the kernels now instead of at the first launch (a worker, before its
    /// handshake, so that the first case does not spend its timeout compiling).
    pub warm: bool,
}

/// Opens the backend `spec` names.
///
/// # Errors
/// [`Error::NoDevice`] when the device is missing, [`Error::NotCompiledWith`] when the
/// feature is off, [`Error::Config`] for an unknown name or a mutant the backend cannot carry.
pub fn open_with(spec: &Spec) -> Result<Box<dyn Backend>> {
    let name = spec.name;
    if !spec.mutants.is_empty() {
        return match name {
            "cpu" => Ok(Box::new(CpuBackend::mutant(Defects::of(spec.mutants)))),
            "cuda" => open_cuda(spec.device, &kernel_defines(spec.mutants)?, spec.warm),
            other => Err(Error::config(format!(
                "backend {other}: bugs can be planted in cpu and cuda only"
            ))),
        };
    }
    match name {
        "cpu" => Ok(Box::new(CpuBackend::default())),
        "te625-model" => Ok(Box::new(CpuBackend::te625_model())),
        "cuda" => open_cuda(spec.device, &[], spec.warm),
        "hip" => open_hip(spec.device),
        other => Err(Error::config(format!(
            "unknown backend '{other}' (expected one of {}, or exec with --worker 'COMMAND')",
            NAMES.join(", ")
        ))),
    }
}

/// Opens backend `spec` for `lanes` cases at once in this process: a CPU backend as it is
/// (it checks cases concurrently already), a GPU backend as [`Lanes`] of that many copies,
/// each on its own stream, all warmed before the first case.
///
/// # Errors
/// As [`open_with`].
pub fn open_lanes(spec: &Spec, lanes: usize) -> Result<Box<dyn Backend>> {
    if !matches!(spec.name, "cuda" | "hip") || (spec.name == "hip" && !spec.mutants.is_empty()) {
        // The CPU backends, and HIP with bugs to plant (refused there, in one place).
        return open_with(spec);
    }
    let defines = kernel_defines(spec.mutants)?;
    let members = (0..lanes.max(1))
        .map(|_| match spec.name {
            "cuda" => open_cuda_lane(spec.device, &defines),
            _ => open_hip(spec.device),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Box::new(Lanes::new(members)?))
}

/// Opens a backend by name, on device 0.
///
/// # Errors
/// As [`open_with`].
pub fn open(name: &str) -> Result<Box<dyn Backend>> {
    open_with(&Spec {
        name,
        ..Spec::default()
    })
}

/// Opens backend `name` with `mutants` planted (no mutant: [`open`]).
///
/// # Errors
/// As [`open_with`].
pub fn open_planted(name: &str, mutants: &[Mutant]) -> Result<Box<dyn Backend>> {
    open_with(&Spec {
        name,
        mutants,
        ..Spec::default()
    })
}

/// The devices backend `name` could serve: the GPUs its runtime sees (0 without one, or
/// without the feature), 1 for the CPU backends.
pub fn device_count(name: &str) -> usize {
    match name {
        "cuda" => cuda_devices(),
        "hip" => hip_devices(),
        _ => 1,
    }
}

fn cuda_devices() -> usize {
    #[cfg(feature = "cuda")]
    return super::gpu::cuda::CudaBackend::device_count();
    #[cfg(not(feature = "cuda"))]
    0
}

fn hip_devices() -> usize {
    #[cfg(feature = "hip")]
    return super::gpu::hip::HipBackend::device_count();
    #[cfg(not(feature = "hip"))]
    0
}

/// The kernel defines of `mutants`.
fn kernel_defines(mutants: &[Mutant]) -> Result<Vec<&'static str>> {
    mutants
        .iter()
        .map(|m| {
            m.kernel_define().ok_or_else(|| {
                Error::config(format!(
                    "mutant {m}: the CUDA kernels do not carry it (those they carry: {})",
                    Mutant::ALL
                        .iter()
                        .filter(|m| m.kernel_define().is_some())
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
        })
        .collect()
}

#[cfg(feature = "cuda")]
fn open_cuda(device: usize, defines: &[&str], warm: bool) -> Result<Box<dyn Backend>> {
    let be = super::gpu::cuda::CudaBackend::on_device_with(device, defines)?;
    if warm {
        be.warm_up()?;
    }
    Ok(Box::new(be))
}

#[cfg(feature = "cuda")]
fn open_cuda_lane(device: usize, defines: &[&str]) -> Result<Box<dyn Backend>> {
    let be = super::gpu::cuda::CudaBackend::lane(device, defines)?;
    be.warm_up()?;
    Ok(Box::new(be))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda_lane(_device: usize, _defines: &[&str]) -> Result<Box<dyn Backend>> {
    Err(Error::NotCompiledWith { feature: "cuda" })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_device: usize, _defines: &[&str], _warm: bool) -> Result<Box<dyn Backend>> {
    Err(Error::NotCompiledWith { feature: "cuda" })
}

/// HIP loads its code objects when it opens: nothing is left to warm.
#[cfg(feature = "hip")]
fn open_hip(device: usize) -> Result<Box<dyn Backend>> {
    Ok(Box::new(super::gpu::hip::HipBackend::on_device(device)?))
}

#[cfg(not(feature = "hip"))]
fn open_hip(_device: usize) -> Result<Box<dyn Backend>> {
    Err(Error::NotCompiledWith { feature: "hip" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_open_their_backends_or_say_why_not() {
        assert_eq!(open("cpu").unwrap().name(), "cpu");
        let te = open("te625-model").unwrap();
        assert_eq!(te.name(), "te625-model");
        // A live CPU backend and a capsule it wrote are judged with the same budget.
        let by_name = crate::backend::rounding_budget_of(te.name(), "o");
        assert_eq!(te.rounding_budget("o"), by_name);
        let e = open("tpu").err().expect("an unknown name");
        assert!(
            e.to_string().contains("expected one of cpu, cuda, hip"),
            "{e}"
        );
        for gpu in ["cuda", "hip"] {
            match open(gpu) {
                Ok(b) => assert_eq!(b.name(), gpu),
                Err(e) => assert!(e.is_no_device(), "{gpu}: {e}"),
            }
        }
        assert_eq!(device_count("cpu"), 1);
    }

    #[test]
    fn mutants_are_planted_where_the_backend_carries_them() {
        let m = [Mutant::ScaleTwice];
        let be = open_planted("cpu", &m).unwrap();
        assert!(be.provenance()["defects"].contains(Mutant::ScaleTwice.name()));
        let e = open_planted("hip", &m)
            .err()
            .expect("hip carries no mutants");
        assert!(e.to_string().contains("cpu and cuda only"), "{e}");
        if let Some(m) = Mutant::ALL.iter().find(|m| m.kernel_define().is_none()) {
            let e = open_planted("cuda", &[*m])
                .err()
                .expect("not a kernel define");
            assert!(e.to_string().contains("do not carry it"), "{e}");
        }
        assert!(!open_planted("cpu", &[])
            .unwrap()
            .provenance()
            .contains_key("defects"));
    }
}
