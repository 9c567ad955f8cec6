//! The CUDA runtime of the GPU backend ([`super::GpuBackend`]): the portable kernels of
//! `kernels/` compiled with NVRTC at first use for the device's architecture
//! ([`super::nvrtc`]), launched through cudarc's driver API on the context's default stream.
//!
//! A failed driver call (allocation, copy, kernel lookup, launch, synchronisation) is
//! [`CudaError::Driver`], an [`Error::Device`]; a kernel file NVRTC or the driver would not
//! build or load is [`CudaError::Build`], an [`Error::Backend`].

use super::nvrtc::{
    defines_from_env, kernel_fingerprint, kernel_ptx_from, kernel_ptxs, nvrtc_version, KERNEL_FILES,
};
pub use super::nvrtc::{fill_kernel_cache, kernel_ptx, Ptx};
use super::{DeviceApi, GpuBackend, Grid};
use crate::backend::kernel_args::Arg;
use crate::backend::kernel_cache::KernelCache;
use crate::backend::launch::Gpu;
pub use crate::backend::launch::{
    dims_of, mask_code, scratch_addr, Family, LaunchDims, Ptrs, FALLBACK_MAX_HEAD_DIM,
    SMALL_SEQ_HEAD_DIMS,
};
use crate::dispatch::Arch;
use crate::error::{panic_text, Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

/// The CUDA backend: [`GpuBackend`] over [`Cuda`].
pub type CudaBackend = GpuBackend<Cuda>;

/// What can go wrong in the CUDA runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A driver call failed (`what`: the call or the buffer it was for).
    #[error("{what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    /// A kernel file did not build or load: NVRTC's log, or the driver's refusal of its PTX.
    #[error("{0}")]
    Build(String),
}

impl From<CudaError> for Error {
    fn from(e: CudaError) -> Self {
        let backend = "cuda".to_string();
        match e {
            CudaError::Build(detail) => Error::Backend { backend, detail },
            driver => Error::Device {
                backend,
                detail: driver.to_string(),
            },
        }
    }
}

fn drv<T>(what: &str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|source| {
        CudaError::Driver {
            what: what.into(),
            source,
        }
        .into()
    })
}

fn backend_err(detail: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda".into(),
        detail: detail.into(),
    }
}

fn no_device(detail: impl Into<String>) -> Error {
    Error::NoDevice {
        backend: "cuda".into(),
        detail: detail.into(),
    }
}

struct Modules {
    small: Arc<CudaModule>,
    fallback: Arc<CudaModule>,
}

/// The CUDA runtime on one device: its primary context and default stream, and the modules
/// built for it (at the first launch, or [`GpuBackend::warm_up`]).
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    arch_name: String,
    cc: (i32, i32),
    modules: OnceLock<std::result::Result<Modules, String>>,
    /// Preprocessor defines the kernels are compiled with (planted bugs for mutation runs).
    defines: Vec<String>,
    cache: KernelCache,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("arch", &self.arch_name)
            .finish()
    }
}

impl CudaBackend {
    /// Opens device 0. [`Error::NoDevice`] (one line) when the driver or a GPU is missing.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when there is no driver or device.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }

    /// The number of CUDA devices this process sees (0 without a driver).
    pub fn device_count() -> usize {
        let present = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() });
        if !present.unwrap_or(false) {
            return 0;
        }
        catch_unwind(CudaContext::device_count)
            .ok()
            .and_then(|r| r.ok())
            .map_or(0, |n| n.max(0) as usize)
    }

    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn on_device(ordinal: usize) -> Result<Self> {
        Self::on_device_with(ordinal, &[])
    }

    /// Opens device 0 with kernels compiled under `defines` (e.g. a
    /// [`crate::mutants::Mutant::kernel_define`] for a mutation run).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn with_defines(defines: &[&str]) -> Result<Self> {
        Self::on_device_with(0, defines)
    }

    /// Opens device `ordinal` with kernels compiled under `SMALLSEQ_KERNEL_DEFINES` and then
    /// `defines`.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn on_device_with(ordinal: usize, defines: &[&str]) -> Result<Self> {
        let mut rt = Cuda::open(ordinal, false)?;
        rt.defines.extend(defines.iter().map(|d| d.to_string()));
        GpuBackend::from_runtime(rt)
    }

    /// As [`CudaBackend::on_device_with`], on a stream of its own instead of the context's
    /// default one: a lane of [`crate::backend::lanes::Lanes`], whose synchronise waits for
    /// its own launches only (several lanes share the process's primary context).
    ///
    /// # Errors
    /// As [`CudaBackend::new`], and a stream the driver does not create.
    pub fn lane(ordinal: usize, defines: &[&str]) -> Result<Self> {
        let mut rt = Cuda::open(ordinal, true)?;
        rt.defines.extend(defines.iter().map(|d| d.to_string()));
        GpuBackend::from_runtime(rt)
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.runtime().stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.runtime().ctx
    }
}

impl Cuda {
    fn open(ordinal: usize, own_stream: bool) -> Result<Self> {
        // cudarc panics when libcuda cannot be loaded: look first, and catch anything else.
        let present = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() });
        if !present.unwrap_or(false) {
            return Err(no_device(
                "libcuda (the NVIDIA driver library) was not found",
            ));
        }
        set_sync_mode(ordinal)?;
        let ctx = match catch_unwind(|| CudaContext::new(ordinal)) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(no_device(format!("no usable CUDA device {ordinal}: {e}"))),
            Err(p) => return Err(no_device(panic_text(p))),
        };
        let cc = ctx
            .compute_capability()
            .map_err(|e| no_device(format!("compute capability: {e}")))?;
        let arch_name = format!("sm_{}{}", cc.0, cc.1);
        let arch = arch_name
            .parse()
            .map_err(|e: String| backend_err(format!("arch: {e}")))?;
        // SAFETY: every allocation, copy and launch of this backend goes to its one stream
        // (`stream` below; `smallseq bench` borrows the same one), so stream order alone
        // orders each buffer's uses and its free. cudarc's per-buffer events (two created per
        // allocation, one recorded per pointer taken) only order several streams; they cost
        // a worker four driver calls per buffer, about twenty buffers per case run.
        unsafe { ctx.disable_event_tracking() };
        let stream = if own_stream {
            drv("creating a stream", ctx.new_stream())?
        } else {
            ctx.default_stream()
        };
        Ok(Cuda {
            ctx,
            stream,
            arch,
            arch_name,
            cc,
            modules: OnceLock::new(),
            defines: defines_from_env(),
            cache: KernelCache::from_env(),
        })
    }

    fn modules(&self) -> Result<&Modules> {
        self.modules
            .get_or_init(|| {
                // The modules load on this thread, the context's.
                let files = KERNEL_FILES;
                let [small, fallback] = kernel_ptxs(&self.arch_name, &self.defines, &self.cache);
                let load = |(name, body): (&str, &str), ptx: Ptx| {
                    let module = |text: String| {
                        self.ctx
                            .load_module(cudarc::nvrtc::Ptx::from_src(text))
                            .map_err(|e| format!("loading {name}: {e}"))
                    };
                    match module(ptx.text) {
                        // A cached entry the driver refuses (damaged on disk): compiled again,
                        // and the entry replaced.
                        Err(_) if ptx.cached => {
                            let fresh = kernel_ptx_from(
                                name,
                                body,
                                &self.arch_name,
                                &self.defines,
                                &self.cache,
                                false,
                            )?;
                            module(fresh.text)
                        }
                        loaded => loaded,
                    }
                };
                Ok(Modules {
                    small: load(files[0], small?)?,
                    fallback: load(files[1], fallback?)?,
                })
            })
            .as_ref()
            .map_err(|e| CudaError::Build(e.clone()).into())
    }
}

impl DeviceApi for Cuda {
    const NAME: &'static str = "cuda";
    const GPU: Gpu = Gpu::Cuda;
    /// One warp.
    const THREADS_PER_ITEM: u32 = 32;
    type Mem = CudaSlice<u8>;
    type Func = CudaFunction;

    fn arch(&self) -> Arch {
        self.arch.clone()
    }

    fn has_small_seq(&self) -> bool {
        self.cc.0 >= 8
    }

    fn provenance(&self) -> BTreeMap<String, String> {
        let mut p = BTreeMap::new();
        p.insert(
            "device".into(),
            self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})")),
        );
        p.insert("arch".into(), self.arch_name.clone());
        let mut driver = 0;
        // SAFETY: one valid out-pointer; the driver library is loaded (the context exists).
        let rc = catch_unwind(AssertUnwindSafe(|| unsafe {
            cudarc::driver::sys::cuDriverGetVersion(&mut driver)
        }));
        if let Ok(cudarc::driver::sys::CUresult::CUDA_SUCCESS) = rc {
            p.insert(
                "driver".into(),
                format!("{}.{}", driver / 1000, driver % 1000 / 10),
            );
        }
        match nvrtc_version() {
            Ok(v) => {
                p.insert("nvrtc".into(), format!("{}.{}", v.0, v.1));
                p.insert(
                    "kernels".into(),
                    kernel_fingerprint(&self.arch_name, &self.defines, v),
                );
            }
            Err(e) => {
                p.insert("nvrtc".into(), e);
            }
        }
        if !self.defines.is_empty() {
            p.insert("defines".into(), self.defines.join(" "));
        }
        p
    }

    fn defines(&self) -> Vec<String> {
        self.defines.clone()
    }

    /// cudarc binds the context to the calling thread in each call.
    fn make_current(&self) -> Result<()> {
        Ok(())
    }

    fn upload(&self, what: &str, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        if bytes.is_empty() {
            // cudarc refuses zero-sized allocations; a one-byte buffer is never read.
            return drv(what, unsafe { self.stream.alloc::<u8>(1) });
        }
        drv(what, self.stream.memcpy_stod(bytes))
    }

    /// A copy into pageable host memory: the driver returns once it has completed (CUDA's
    /// "API synchronization behavior"), so the bytes are on the host when this returns.
    fn download(&self, what: &str, mem: &CudaSlice<u8>, host: &mut [u8]) -> Result<()> {
        let n = host.len().min(mem.len());
        if n == 0 {
            return Ok(());
        }
        drv(
            what,
            self.stream.memcpy_dtoh(&mem.slice(..n), &mut host[..n]),
        )
    }

    fn addr(&self, mem: &CudaSlice<u8>) -> u64 {
        let (p, _sync) = mem.device_ptr(&self.stream);
        p
    }

    fn load_modules(&self) -> Result<()> {
        self.modules().map(|_| ())
    }

    fn function(&self, family: Family, name: &str) -> Result<CudaFunction> {
        let m = self.modules()?;
        let module = match family {
            Family::SmallSeq => &m.small,
            Family::Fallback => &m.fallback,
        };
        drv(&format!("kernel {name}"), module.load_function(name))
    }

    unsafe fn launch(&self, f: &CudaFunction, name: &str, grid: Grid, args: &[Arg]) -> Result<()> {
        let mut lb = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(x) => lb.arg(x),
                Arg::I32(x) => lb.arg(x),
                Arg::I64(x) => lb.arg(x),
                Arg::F32(x) => lb.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.blocks, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: grid.smem,
        };
        // SAFETY: the caller's (`DeviceApi::launch`): the arguments are the kernel's, and
        // every pointer among them is live until the launch completes.
        drv(name, unsafe { lb.launch(cfg) }).map(|_| ())
    }

    fn synchronize(&self) -> Result<()> {
        drv("synchronize", self.stream.synchronize())
    }
}

/// How a thread waiting for the GPU waits, from `SMALLSEQ_CUDA_SYNC` (`spin`, `yield`,
/// `blocking`; unset: the driver's heuristic, which spins when the process has fewer contexts
/// than the machine has cores). Many worker processes on one host each spinning through
/// every synchronize take the cores their campaign judges on; `smallseq worker` sets
/// `blocking` unless told otherwise (bench/NOTES.md, v8, has the measurement).
pub const SYNC_VAR: &str = "SMALLSEQ_CUDA_SYNC";

fn set_sync_mode(ordinal: usize) -> Result<()> {
    use cudarc::driver::sys::CUctx_flags_enum as F;
    let flag = match std::env::var(SYNC_VAR).ok().as_deref() {
        None | Some("") | Some("auto") => return Ok(()),
        Some("spin") => F::CU_CTX_SCHED_SPIN,
        Some("yield") => F::CU_CTX_SCHED_YIELD,
        Some("blocking") => F::CU_CTX_SCHED_BLOCKING_SYNC,
        Some(other) => {
            return Err(Error::config(format!(
                "{SYNC_VAR}={other}: expected auto, spin, yield or blocking"
            )))
        }
    };
    // SAFETY: plain driver calls with a valid out-pointer; the flags apply to the primary
    // context the CudaContext below retains (set before it is created).
    let rc = catch_unwind(|| unsafe {
        cudarc::driver::result::init().ok()?;
        let dev = cudarc::driver::result::device::get(ordinal as i32).ok()?;
        Some(cudarc::driver::sys::cuDevicePrimaryCtxSetFlags_v2(
            dev,
            flag as u32,
        ))
    });
    match rc {
        Ok(Some(cudarc::driver::sys::CUresult::CUDA_SUCCESS)) | Ok(None) => Ok(()),
        Ok(Some(e)) => Err(backend_err(format!(
            "setting {SYNC_VAR}: driver error {}",
            e as u32
        ))),
        Err(p) => Err(no_device(panic_text(p))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendInfo;

    #[test]
    fn new_never_panics() {
        // On a machine without a driver this is NoDevice; with one it is Ok.
        match CudaBackend::new() {
            Ok(b) => assert!(b.arch().name().starts_with("sm_")),
            Err(e) => assert!(e.is_no_device(), "{e}"),
        }
    }

    #[test]
    fn driver_failures_are_device_errors_and_builds_the_backends() {
        let e: Error = CudaError::Build("NVRTC failed on small_seq.cu".into()).into();
        assert!(matches!(e, Error::Backend { .. }), "{e:?}");
        assert_eq!(e.to_string(), "backend cuda: NVRTC failed on small_seq.cu");
        // A driver error's text comes from libcuda: only where it is loaded.
        let present = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() });
        if !present.unwrap_or(false) {
            return;
        }
        let e = drv::<()>(
            "synchronize",
            Err(DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            )),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::Device { backend, .. } if backend == "cuda"),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with("backend cuda: synchronize: "),
            "{e}"
        );
    }
}
