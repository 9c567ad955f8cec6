//! The CUDA backend: the portable kernels of `kernels/` compiled with NVRTC at first use for
//! the device's architecture, launched through cudarc's driver API.
//!
//! Trait entry points upload the inputs in their dtype and the guarded output buffers whole
//! (guards and poison included), launch on the body (base offset), and download the buffers
//! whole, so an out-of-bounds write shows up as a corrupted guard. The `launch_*` methods take
//! raw device pointers and are what the benchmark times.

use super::kernel_cache::{fingerprint, KernelCache};
use super::launch::{args_of, check_aligned, Arg, Gpu, Kernel, WARPS_PER_BLOCK};
pub use super::launch::{
    dims_of, mask_code, scratch_addr, Family, LaunchDims, Ptrs, FALLBACK_MAX_HEAD_DIM,
    SMALL_SEQ_HEAD_DIMS,
};
use super::{Backend, BwdArgs, BwdBufs, DevBuf, FwdArgs, FwdBufs};
use crate::config::AttnConfig;
use crate::dispatch::Arch;
use crate::error::{panic_text, Error, Result};
use crate::workspace::names;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use ndarray::ArrayView3;
use smallseq_reference::{Dtype, Layout};
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

const PORTABLE_H: &str = include_str!("../../kernels/portable.h");
const SMALL_SEQ_CU: &str = include_str!("../../kernels/small_seq.cu");
const FALLBACK_CU: &str = include_str!("../../kernels/fallback.cu");
/// The kernel files a module is built from, by name, in module order (small-seq, fallback).
const KERNEL_FILES: [(&str, &str); 2] =
    [("small_seq.cu", SMALL_SEQ_CU), ("fallback.cu", FALLBACK_CU)];

fn backend_err(detail: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda".into(),
        detail: detail.into(),
    }
}

fn drv<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| backend_err(format!("{what}: {e}")))
}

struct Modules {
    small: Arc<CudaModule>,
    fallback: Arc<CudaModule>,
}

/// The CUDA backend (device 0).
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    arch_name: String,
    cc: (i32, i32),
    modules: OnceLock<std::result::Result<Modules, String>>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
    /// Preprocessor defines the kernels are compiled with (planted bugs for mutation runs).
    defines: Vec<String>,
    cache: KernelCache,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("arch", &self.arch_name)
            .finish()
    }
}

fn no_device(detail: impl Into<String>) -> Error {
    Error::NoDevice {
        backend: "cuda".into(),
        detail: detail.into(),
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
        // SAFETY: every allocation, copy and launch of this backend goes to the one default
        // stream (`stream` below; `smallseq bench` borrows the same one), so stream order alone
        // orders each buffer's uses and its free. cudarc's per-buffer events (two created per
        // allocation, one recorded per pointer taken) only order several streams; they cost
        // a worker four driver calls per buffer, about twenty buffers per case run.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(CudaBackend {
            ctx,
            stream,
            arch,
            arch_name,
            cc,
            modules: OnceLock::new(),
            funcs: Mutex::new(HashMap::new()),
            defines: defines_from_env(),
            cache: KernelCache::from_env(),
        })
    }

    /// Opens device 0 with kernels compiled under `defines` (e.g. a
    /// [`crate::mutants::Mutant::kernel_define`] for a mutation run).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn with_defines(defines: &[&str]) -> Result<Self> {
        let mut be = Self::new()?;
        be.defines.extend(defines.iter().map(|d| d.to_string()));
        Ok(be)
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// One fingerprint of both kernel files' cache keys (sources, options, defines, NVRTC).
    fn kernel_fingerprint(&self, nvrtc: (i32, i32)) -> String {
        let keys: Vec<String> = KERNEL_FILES
            .iter()
            .map(|(name, body)| kernel_key(name, body, &self.arch_name, &self.defines, nvrtc).2)
            .collect();
        fingerprint(keys.concat().as_bytes())
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
            .map_err(|e| backend_err(e.clone()))
    }

    fn func(&self, family: Family, name: &str) -> Result<CudaFunction> {
        let mut funcs = self.funcs.lock().expect("function cache poisoned");
        if let Some(f) = funcs.get(name) {
            return Ok(f.clone());
        }
        let m = self.modules()?;
        let module = match family {
            Family::SmallSeq => &m.small,
            Family::Fallback => &m.fallback,
        };
        let f = drv(&format!("kernel {name}"), module.load_function(name))?;
        funcs.insert(name.into(), f.clone());
        Ok(f)
    }

    /// Compiles (if needed) and loads every kernel, so timing excludes compilation.
    ///
    /// # Errors
    /// NVRTC or driver errors.
    pub fn warm_up(&self) -> Result<()> {
        self.modules().map(|_| ())
    }

    fn dtype_suffix(d: &LaunchDims, allow_f32: bool) -> Result<&'static str> {
        d.dtype_suffix(allow_f32)
            .map_err(|m| Error::Unsupported(format!("cuda {m}")))
    }

    fn check_small(d: &LaunchDims) -> Result<()> {
        d.small_seq_unsupported()
            .map_or(Ok(()), |m| Err(Error::Unsupported(format!("cuda {m}"))))
    }

    fn blocks(items: i64) -> Result<u32> {
        let blocks = (items.max(0) as u64).div_ceil(WARPS_PER_BLOCK as u64);
        u32::try_from(blocks)
            .ok()
            .filter(|&b| b < i32::MAX as u32)
            .ok_or_else(|| backend_err(format!("{items} work items exceed the 1-D grid")))
    }

    fn cfg(blocks: u32, smem: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (WARPS_PER_BLOCK * 32, 1, 1),
            shared_mem_bytes: smem,
        }
    }

    /// Launches `name` with the argument list [`args_of`] builds for `kernel` (the list the HIP
    /// compile check compares with the kernels' declared arguments).
    fn launch(
        &self,
        family: Family,
        name: &str,
        kernel: Kernel,
        (d, p): (&LaunchDims, &Ptrs),
        cfg: LaunchConfig,
    ) -> Result<()> {
        check_aligned(kernel, p)?;
        let f = self.func(family, name)?;
        let args = args_of(kernel, d, p);
        let mut lb = self.stream.launch_builder(&f);
        for a in &args {
            match a {
                Arg::Ptr(x) => lb.arg(x),
                Arg::I32(x) => lb.arg(x),
                Arg::I64(x) => lb.arg(x),
                Arg::F32(x) => lb.arg(x),
            };
        }
        // SAFETY: the argument list matches the kernel's parameters (args_of, checked against
        // the compiled kernels' metadata by ci/hip-compile-check.sh) and every pointer is a live
        // device allocation of the call.
        drv(name, unsafe { lb.launch(cfg) }).map(|_| ())
    }

    /// Small-seq forward on raw pointers (`q, k, v, o, lse`, offsets).
    ///
    /// # Errors
    /// Unsupported shapes, driver errors.
    pub fn launch_small_seq_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_small(d)?;
        let name = fix_o32(format!(
            "small_seq_fwd_{}_d{}",
            Self::dtype_suffix(d, false)?,
            d.dqk
        ));
        let blocks = Self::blocks(d.b as i64 * d.heads as i64)?;
        if blocks == 0 {
            return Ok(());
        }
        let cfg = Self::cfg(blocks, 0);
        self.launch(Family::SmallSeq, &name, Kernel::SmallSeqFwd, (d, p), cfg)
    }

    /// Small-seq backward on raw pointers (`q, k, v, d_o, lse, dq, dk, dv`, offsets).
    ///
    /// # Errors
    /// Unsupported shapes, driver errors.
    pub fn launch_small_seq_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_small(d)?;
        let name = fix_o32(format!(
            "small_seq_bwd_{}_d{}",
            Self::dtype_suffix(d, false)?,
            d.dqk
        ));
        let blocks = Self::blocks(d.b as i64 * d.heads as i64)?;
        if blocks == 0 {
            return Ok(());
        }
        let cfg = Self::cfg(blocks, 0);
        self.launch(Family::SmallSeq, &name, Kernel::SmallSeqBwd, (d, p), cfg)
    }

    fn check_fallback(d: &LaunchDims) -> Result<()> {
        d.fallback_unsupported()
            .map_or(Ok(()), |m| Err(Error::Unsupported(format!("cuda {m}"))))
    }

    /// Fallback forward on raw pointers: the tiled kernel where it applies
    /// ([`LaunchDims::tiled_fwd`]), else the scalar one.
    ///
    /// # Errors
    /// Unsupported shapes, driver errors.
    pub fn launch_fallback_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_fallback(d)?;
        if let Some((name, tiles)) = d.tiled_fwd(Gpu::Cuda) {
            // One block per (head, slot, query tile): `blocks` counts warps.
            let items = d.heads as i64 * d.b as i64 * tiles as i64;
            let blocks = Self::blocks(items * WARPS_PER_BLOCK as i64)?;
            if blocks == 0 {
                return Ok(());
            }
            let cfg = Self::cfg(blocks, d.tiled_fwd_smem());
            return self.launch(Family::Fallback, &name, Kernel::TiledFwd, (d, p), cfg);
        }
        let name = format!("fallback_fwd_{}", Self::dtype_suffix(d, true)?);
        let blocks = Self::blocks(d.tq * d.heads as i64)?;
        if blocks == 0 || d.b == 0 {
            return Ok(());
        }
        let cfg = Self::cfg(blocks, WARPS_PER_BLOCK * 4 * d.dqk as u32);
        self.launch(Family::Fallback, &name, Kernel::FallbackFwd, (d, p), cfg)
    }

    /// Fallback backward on raw pointers (two kernels: query side with `delta`, key side).
    ///
    /// # Errors
    /// Unsupported shapes, driver errors.
    pub fn launch_fallback_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_fallback(d)?;
        let suf = Self::dtype_suffix(d, true)?;
        if d.b == 0 {
            return Ok(());
        }
        if let Some(([name_q, name_kv], key_tiles)) = d.tiled_bwd(Gpu::Cuda) {
            // One block per (head, slot, query tile), then per (kv head, slot, key tile).
            let smem = d.tiled_bwd_smem();
            let items = d.heads as i64 * d.b as i64 * d.tiled_tiles() as i64;
            let blocks = Self::blocks(items * WARPS_PER_BLOCK as i64)?;
            if blocks > 0 {
                let cfg = Self::cfg(blocks, smem);
                self.launch(Family::Fallback, &name_q, Kernel::TiledBwdQ, (d, p), cfg)?;
            }
            let items = d.kv_heads as i64 * d.b as i64 * key_tiles as i64 * d.tiled_bwd_kv_parts();
            let blocks = Self::blocks(items * WARPS_PER_BLOCK as i64)?;
            if blocks > 0 {
                let cfg = Self::cfg(blocks, smem);
                self.launch(Family::Fallback, &name_kv, Kernel::TiledBwdKv, (d, p), cfg)?;
            }
            return Ok(());
        }
        let smem = WARPS_PER_BLOCK * 4 * (d.dqk + d.dv) as u32;
        let blocks = Self::blocks(d.tq * d.heads as i64)?;
        if blocks > 0 {
            let name = format!("fallback_bwd_q_{suf}");
            let cfg = Self::cfg(blocks, smem);
            self.launch(Family::Fallback, &name, Kernel::FallbackBwdQ, (d, p), cfg)?;
        }
        let blocks = Self::blocks(d.tk * d.kv_heads as i64)?;
        if blocks > 0 {
            let name = format!("fallback_bwd_kv_{suf}");
            let cfg = Self::cfg(blocks, smem);
            self.launch(Family::Fallback, &name, Kernel::FallbackBwdKv, (d, p), cfg)?;
        }
        Ok(())
    }

    /// Waits for the stream and reports any asynchronous error.
    ///
    /// # Errors
    /// The first asynchronous error of the stream.
    pub fn sync(&self) -> Result<()> {
        drv("synchronize", self.stream.synchronize())
    }

    fn upload<T: DeviceRepr>(&self, what: &str, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            // cudarc refuses zero-sized allocations; a one-element buffer is never read.
            return drv(what, unsafe { self.stream.alloc::<T>(1) });
        }
        drv(what, self.stream.memcpy_stod(host))
    }

    fn download_into(&self, what: &str, dev: &CudaSlice<f32>, buf: &mut DevBuf) -> Result<()> {
        drv(what, self.stream.memcpy_dtoh(dev, &mut buf.data[..]))
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn ptr_body(&self, s: &CudaSlice<f32>, buf: &DevBuf) -> u64 {
        self.ptr(s) + (buf.base * 4) as u64
    }
}

/// NVRTC's version, or why NVRTC cannot be used.
fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
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
fn kernel_ptx_from(
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
fn kernel_ptxs(
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

/// Extra kernel defines from `SMALLSEQ_KERNEL_DEFINES` (whitespace-separated `NAME` or
/// `NAME=VALUE`): kernel variants for A/B timing (`SS_FWD_BLOCKS=5`, `FT_MIN_BLOCKS=3`, …)
/// without a rebuild.
fn defines_from_env() -> Vec<String> {
    std::env::var("SMALLSEQ_KERNEL_DEFINES")
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

fn fix_o32(name: String) -> String {
    // `small_seq_fwd_bf16_o32_d128` -> `small_seq_fwd_bf16_d128_o32` (the kernels' spelling).
    match name.find("_o32_d") {
        Some(i) => format!("{}{}_o32", &name[..i], &name[i + 4..]),
        None => name,
    }
}

/// Elements of a tensor in row-major order, in the storage type of `dtype`.
enum HostTensor {
    U16(Vec<u16>),
    F32(Vec<f32>),
}

/// The tensor in the storage type of `dtype`. A whole slice at a time: `half` converts a
/// slice with the same instruction (F16C) or function as one value, without a call per element.
fn to_host(dtype: Dtype, a: &ArrayView3<f32>) -> HostTensor {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let owned: Vec<f32>;
    let src = match a.as_slice() {
        Some(s) => s,
        None => {
            owned = a.iter().copied().collect();
            &owned
        }
    };
    let mut bits = vec![0u16; src.len()];
    match dtype {
        Dtype::Bf16 => bits
            .reinterpret_cast_mut::<half::bf16>()
            .convert_from_f32_slice(src),
        Dtype::F16 => bits
            .reinterpret_cast_mut::<half::f16>()
            .convert_from_f32_slice(src),
        Dtype::F32 => return HostTensor::F32(src.to_vec()),
    }
    HostTensor::U16(bits)
}

enum DevTensor {
    U16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// Device copies of the inputs and offsets of one call.
struct Inputs {
    tensors: Vec<DevTensor>,
    offsets: Vec<CudaSlice<i32>>,
}

impl CudaBackend {
    fn upload_tensor(&self, what: &str, dtype: Dtype, a: &ArrayView3<f32>) -> Result<DevTensor> {
        if let (Dtype::F32, Some(host)) = (dtype, a.as_slice()) {
            return Ok(DevTensor::F32(self.upload(what, host)?));
        }
        Ok(match to_host(dtype, a) {
            HostTensor::U16(v) => DevTensor::U16(self.upload(what, &v)?),
            HostTensor::F32(v) => DevTensor::F32(self.upload(what, &v)?),
        })
    }

    fn tensor_ptr(&self, t: &DevTensor) -> u64 {
        match t {
            DevTensor::U16(s) => self.ptr(s),
            DevTensor::F32(s) => self.ptr(s),
        }
    }

    fn upload_inputs(&self, args: &FwdArgs, extra: &[&ArrayView3<f32>]) -> Result<Inputs> {
        let dt = args.config.dtype;
        let mut tensors = vec![
            self.upload_tensor("q", dt, &args.q)?,
            self.upload_tensor("k", dt, &args.k)?,
            self.upload_tensor("v", dt, &args.v)?,
        ];
        for (i, a) in extra.iter().enumerate() {
            tensors.push(self.upload_tensor(&format!("extra {i}"), dt, a)?);
        }
        let l = args.layout;
        let offsets = vec![
            self.upload("cu_seqlens_q", &l.q.cu)?,
            self.upload("cu_seqlens_kv", &l.kv.cu)?,
            self.upload("offsets_q", l.q.offsets())?,
            self.upload("offsets_kv", l.kv.offsets())?,
        ];
        Ok(Inputs { tensors, offsets })
    }

    fn base_ptrs(&self, inp: &Inputs) -> Ptrs {
        Ptrs {
            q: self.tensor_ptr(&inp.tensors[0]),
            k: self.tensor_ptr(&inp.tensors[1]),
            v: self.tensor_ptr(&inp.tensors[2]),
            cu_q: self.ptr(&inp.offsets[0]),
            cu_kv: self.ptr(&inp.offsets[1]),
            off_q: self.ptr(&inp.offsets[2]),
            off_kv: self.ptr(&inp.offsets[3]),
            ..Ptrs::default()
        }
    }

    fn fwd(&self, family: Family, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        let d = dims_of(args.config, args.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        let inp = self.upload_inputs(args, &[])?;
        let o = self.upload("o", &out.o.data)?;
        let lse = self.upload("lse", &out.lse.data)?;
        let p = Ptrs {
            o: self.ptr_body(&o, &out.o),
            lse: self.ptr_body(&lse, &out.lse),
            ..self.base_ptrs(&inp)
        };
        match family {
            Family::SmallSeq => self.launch_small_seq_fwd(&d, &p)?,
            Family::Fallback => self.launch_fallback_fwd(&d, &p)?,
        }
        self.sync()?;
        self.download_into("o", &o, &mut out.o)?;
        self.download_into("lse", &lse, &mut out.lse)?;
        self.sync()
    }

    fn bwd(&self, family: Family, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        let f = &args.fwd;
        let d = dims_of(f.config, f.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        let inp = self.upload_inputs(f, &[&args.d_o])?;
        let lse = match args.lse.as_slice() {
            Some(host) => self.upload("lse", host)?,
            None => self.upload("lse", &args.lse.iter().copied().collect::<Vec<f32>>())?,
        };
        let dq = self.upload("dq", &out.dq.data)?;
        let dk = self.upload("dk", &out.dk.data)?;
        let dv = self.upload("dv", &out.dv.data)?;
        let ws = self.upload("workspace", &out.workspace.data)?;
        let mut p = Ptrs {
            d_o: self.tensor_ptr(&inp.tensors[3]),
            lse: self.ptr(&lse),
            dq: self.ptr_body(&dq, &out.dq),
            dk: self.ptr_body(&dk, &out.dk),
            dv: self.ptr_body(&dv, &out.dv),
            ..self.base_ptrs(&inp)
        };
        if family == Family::Fallback {
            let base = self.ptr_body(&ws, &out.workspace);
            let at =
                |name| scratch_addr(f.plan, name, &d, base, out.workspace.len).map_err(backend_err);
            p.delta = at(names::DELTA)?;
            p.rowsum = at(names::ROWSUM)?;
        }
        match family {
            Family::SmallSeq => self.launch_small_seq_bwd(&d, &p)?,
            Family::Fallback => self.launch_fallback_bwd(&d, &p)?,
        }
        self.sync()?;
        self.download_into("dq", &dq, &mut out.dq)?;
        self.download_into("dk", &dk, &mut out.dk)?;
        self.download_into("dv", &dv, &mut out.dv)?;
        self.download_into("workspace", &ws, &mut out.workspace)?;
        self.sync()
    }
}

impl Backend for CudaBackend {
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
                p.insert("kernels".into(), self.kernel_fingerprint(v));
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

    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        super::rounding_budget_of("cuda", tensor)
    }

    fn name(&self) -> &str {
        "cuda"
    }

    fn arch(&self) -> Arch {
        self.arch.clone()
    }

    fn has_small_seq(&self) -> bool {
        self.cc.0 >= 8
    }

    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        Some(dims_of(config, layout, false).fallback_fwd_kernel(Gpu::Cuda))
    }

    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.fwd(Family::SmallSeq, args, out)
    }

    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.fwd(Family::Fallback, args, out)
    }

    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.bwd(Family::SmallSeq, args, out)
    }

    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.bwd(Family::Fallback, args, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice conversion stores what a conversion per element stores: ties, subnormals,
    /// overflow, signed zeros, NaN payloads; contiguous or not.
    #[test]
    fn host_tensors_convert_like_one_value_at_a_time() {
        let mut vals: Vec<f32> = (0..4099u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9)))
            .collect();
        vals.extend([
            0.0,
            -0.0,
            1.0 + f32::EPSILON,
            65520.0,
            1e-7,
            f32::from_bits(0x7fa0_0001),
            f32::from_bits(0xffc0_1234),
            f32::INFINITY,
        ]);
        let n = vals.len();
        let a = ndarray::Array3::from_shape_vec((n, 1, 1), vals.clone()).unwrap();
        let strided =
            ndarray::Array3::from_shape_vec((n, 2, 1), [vals.clone(), vals].concat()).unwrap();
        for view in [a.view(), strided.slice(ndarray::s![.., 0..1, ..])] {
            let want16: Vec<u16> = view
                .iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect();
            let wantb: Vec<u16> = view
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            match (to_host(Dtype::F16, &view), to_host(Dtype::Bf16, &view)) {
                (HostTensor::U16(f), HostTensor::U16(b)) => {
                    assert_eq!(f, want16);
                    assert_eq!(b, wantb);
                }
                _ => panic!("16-bit dtypes are stored as u16"),
            }
        }
    }

    #[test]
    fn o32_names_match_the_kernels() {
        assert_eq!(
            fix_o32("small_seq_fwd_bf16_o32_d128".into()),
            "small_seq_fwd_bf16_d128_o32"
        );
        assert_eq!(
            fix_o32("small_seq_bwd_f16_d64".into()),
            "small_seq_bwd_f16_d64"
        );
        for d in SMALL_SEQ_HEAD_DIMS {
            assert!(
                SMALL_SEQ_CU.contains("SS_ALL(") && SMALL_SEQ_CU.contains(&format!("SS_ALL({d})"))
            );
        }
    }

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

    #[test]
    fn new_never_panics() {
        // On a machine without a driver this is NoDevice; with one it is Ok.
        match CudaBackend::new() {
            Ok(b) => assert!(b.arch().name().starts_with("sm_")),
            Err(e) => assert!(e.is_no_device(), "{e}"),
        }
    }
}
