//! The HIP backend (feature `hip`): the portable kernels of `kernels/` as AMD GPU code objects
//! (gfx942 first; gfx90a and gfx950 where the compiler could build them), loaded with
//! `hipModuleLoadData` and launched with `hipModuleLaunchKernel`, on the HIP runtime that
//! `hip-sys` links (`libamdhip64`).
//!
//! Code objects come from `SMALLSEQ_HIP_CODE_OBJECTS=DIR` (files `small_seq.<arch>.hsaco` and
//! `fallback.<arch>.hsaco`) when set, else from those the build embedded (`build.rs`). The
//! device's architecture picks the pair.
//!
//! Same structure as the CUDA backend: trait entry points upload the inputs in their dtype and
//! the guarded output buffers whole, launch on the body, download the buffers whole. Launch
//! geometry differs in one way: every kernel gets 64 threads per work item (one wavefront; the
//! small-seq kernels run one item per wavefront, see `kernels/portable.h`), 4 items per block.
//!
//! Every HIP call is checked and fails as [`HipError::Call`] naming the call and the HIP error.
//! The runtime functions are declared here with plain integer status codes rather than taken
//! from `hip-sys`, whose `hipError_t` is a Rust enum: a status code that a newer runtime added
//! would be undefined behaviour there. `hip-sys` provides the link to `libamdhip64` and the
//! `hipDeviceProp_t` layout.

use super::kernel_cache::fingerprint;
use super::launch::{args_of, check_aligned, Arg, Gpu, Kernel, WARPS_PER_BLOCK};
pub use super::launch::{
    dims_of, mask_code, scratch_addr, Family, LaunchDims, Ptrs, FALLBACK_MAX_HEAD_DIM,
    SMALL_SEQ_HEAD_DIMS, SMALL_SEQ_MAX_ROWS, TILED_HEAD_DIMS, TILED_ROWS,
};
use super::{Backend, BwdArgs, BwdBufs, DevBuf, FwdArgs, FwdBufs};
use crate::config::AttnConfig;
use crate::dispatch::Arch;
use crate::error::{Error, Result};
use crate::workspace::names;
use hip_sys::hiprt as sys;
use ndarray::ArrayView3;
use smallseq_reference::{Dtype, Layout};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
}

/// Threads per work item on HIP: one wavefront (`PT_LWARP_THREADS`, `PT_WARP`).
const THREADS_PER_ITEM: u32 = 64;
/// Architectures code objects are built for, in order of preference.
pub const ARCHS: [&str; 3] = ["gfx942", "gfx90a", "gfx950"];
/// The kernel files, each one code object per architecture.
pub const STEMS: [&str; 2] = ["small_seq", "fallback"];
/// Run-time directory of code objects.
pub const CODE_OBJECTS_ENV: &str = "SMALLSEQ_HIP_CODE_OBJECTS";

type HipStatus = u32;
const HIP_SUCCESS: HipStatus = 0;

#[link(name = "amdhip64")]
extern "C" {
    fn hipInit(flags: u32) -> HipStatus;
    fn hipGetDeviceCount(count: *mut i32) -> HipStatus;
    fn hipSetDevice(device: i32) -> HipStatus;
    // The plain symbol is the legacy (`R0000`) layout on every ROCm, which is the layout of
    // `hip_sys::hiprt::hipDeviceProp_t`; ROCm 6 headers map the name to `R0600` but still
    // export this one.
    fn hipGetDeviceProperties(prop: *mut c_void, device: i32) -> HipStatus;
    fn hipRuntimeGetVersion(version: *mut i32) -> HipStatus;
    fn hipModuleLoadData(module: *mut sys::hipModule_t, image: *const c_void) -> HipStatus;
    fn hipModuleUnload(module: sys::hipModule_t) -> HipStatus;
    fn hipModuleGetFunction(
        f: *mut sys::hipFunction_t,
        module: sys::hipModule_t,
        name: *const c_char,
    ) -> HipStatus;
    #[allow(clippy::too_many_arguments)]
    fn hipModuleLaunchKernel(
        f: sys::hipFunction_t,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        by: u32,
        bz: u32,
        shared_bytes: u32,
        stream: sys::hipStream_t,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> HipStatus;
    fn hipMalloc(ptr: *mut *mut c_void, bytes: usize) -> HipStatus;
    fn hipFree(ptr: *mut c_void) -> HipStatus;
    fn hipMemcpyHtoD(dst: *mut c_void, src: *const c_void, bytes: usize) -> HipStatus;
    fn hipMemcpyDtoH(dst: *mut c_void, src: *mut c_void, bytes: usize) -> HipStatus;
    fn hipDeviceSynchronize() -> HipStatus;
    fn hipGetErrorName(status: HipStatus) -> *const c_char;
    fn hipGetErrorString(status: HipStatus) -> *const c_char;
}

/// What can go wrong in the HIP backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HipError {
    /// A HIP runtime call returned an error status (`text`: the runtime's description, with
    /// its leading ": ", empty when it only repeats the name).
    #[error("{call} failed: {name} ({code}){text}")]
    Call {
        call: String,
        code: u32,
        name: String,
        text: String,
    },
    /// No code object for the device's architecture, from either source.
    #[error("no {stem} code object for {arch}: {detail}")]
    NoCodeObject {
        arch: String,
        stem: &'static str,
        detail: String,
    },
    /// A code object file could not be read.
    #[error("reading code object {path}: {source}")]
    CodeObjectIo {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A device this backend has no kernels for.
    #[error(
        "device {device} is {target}: the kernels need 64-lane wavefronts and matrix cores \
         (gfx90a, gfx942, gfx950)"
    )]
    UnsupportedArch { device: i32, target: String },
    /// The device's properties did not name a gfx architecture.
    #[error("device {device} reports no gfx architecture name")]
    NoArchName { device: i32 },
    /// A launch the grid cannot express.
    #[error("{items} work items exceed the 1-D grid")]
    Grid { items: i64 },
    /// An argument the kernels cannot take.
    #[error("{0}")]
    Unsupported(String),
    /// A tensor the kernel accesses 16 bytes at a time does not start on 16 bytes.
    #[error(transparent)]
    Misaligned(#[from] super::launch::Misaligned),
}

impl From<HipError> for Error {
    fn from(e: HipError) -> Self {
        match e {
            // The harness skips unsupported cases by this variant, whatever the backend.
            HipError::Unsupported(s) => Error::Unsupported(s),
            HipError::Misaligned(m) => Error::Misaligned(m),
            other => Error::Hip(other),
        }
    }
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return "?".into();
    }
    // SAFETY: the HIP runtime returns static NUL-terminated strings for any status value.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn status_error(call: &str, code: HipStatus) -> HipError {
    // SAFETY: both functions take any status value and return static strings.
    let (name, text) = unsafe { (hipGetErrorName(code), hipGetErrorString(code)) };
    let (name, text) = (cstr(name), cstr(text));
    HipError::Call {
        call: call.into(),
        code,
        text: if text == name {
            String::new()
        } else {
            format!(": {text}")
        },
        name,
    }
}

fn check(call: &str, code: HipStatus) -> std::result::Result<(), HipError> {
    if code == HIP_SUCCESS {
        Ok(())
    } else {
        Err(status_error(call, code))
    }
}

fn no_device(detail: impl Into<String>) -> Error {
    Error::NoDevice {
        backend: "hip".into(),
        detail: detail.into(),
    }
}

/// `gfx942` from `gfx942:sramecc+:xnack-` (the target ID's processor).
pub fn processor(target_id: &str) -> &str {
    target_id.split(':').next().unwrap_or(target_id)
}

/// The gfx target ID in a `hipDeviceProp_t` image: at `gcnArchName` when that holds one, else
/// the first `gfx…` string in the image (a runtime whose legacy layout drifted from
/// `hip-sys`'s still names the target somewhere in it; `name` is a marketing name).
pub fn arch_from_props(image: &[u8], offset: usize) -> Option<String> {
    let at = |i: usize| -> Option<String> {
        let s = image.get(i..)?;
        let end = s.iter().position(|&b| b == 0)?;
        let t = std::str::from_utf8(&s[..end]).ok()?;
        let p = processor(t);
        let ok =
            p.len() > 3 && p.starts_with("gfx") && p[3..].bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| t.to_string())
    };
    at(offset).or_else(|| {
        image
            .windows(3)
            .enumerate()
            .filter(|(_, w)| *w == b"gfx")
            .find_map(|(i, _)| at(i))
    })
}

/// A code object: where it came from and its bytes.
#[derive(Clone, Debug)]
pub struct CodeObject {
    pub origin: String,
    pub bytes: Vec<u8>,
}

/// The code object of `stem` for processor `arch`: from `dir` when given, else embedded.
///
/// # Errors
/// [`HipError::NoCodeObject`] when neither has it, [`HipError::CodeObjectIo`] when the file
/// exists but cannot be read.
pub fn find_code_object(
    dir: Option<&Path>,
    arch: &str,
    stem: &'static str,
) -> std::result::Result<CodeObject, HipError> {
    if let Some(dir) = dir {
        let path = dir.join(format!("{stem}.{arch}.hsaco"));
        return match std::fs::read(&path) {
            Ok(bytes) => Ok(CodeObject {
                origin: path.display().to_string(),
                bytes,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(HipError::NoCodeObject {
                arch: arch.into(),
                stem,
                detail: format!("{} does not exist ({CODE_OBJECTS_ENV})", path.display()),
            }),
            Err(source) => Err(HipError::CodeObjectIo {
                path: path.display().to_string(),
                source,
            }),
        };
    }
    embedded::EMBEDDED
        .iter()
        .find(|(a, s, _)| *a == arch && *s == stem)
        .map(|(a, s, b)| CodeObject {
            origin: format!("embedded {s}.{a}.hsaco"),
            bytes: b.to_vec(),
        })
        .ok_or_else(|| HipError::NoCodeObject {
            arch: arch.into(),
            stem,
            detail: format!(
                "this binary embeds code objects for [{}]; build with a HIP compiler \
                 (SMALLSEQ_HIP_CLANG) or set {CODE_OBJECTS_ENV}=DIR",
                embedded_archs().join(", ")
            ),
        })
}

/// Architectures whose code objects this binary embeds.
pub fn embedded_archs() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = embedded::EMBEDDED.iter().map(|(a, _, _)| *a).collect();
    v.dedup();
    v
}

struct Module {
    handle: sys::hipModule_t,
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the handle came from hipModuleLoadData and is unloaded once. A failure here
        // has nothing left to clean up.
        unsafe {
            hipModuleUnload(self.handle);
        }
    }
}

/// A device allocation, freed on drop.
struct DevMem {
    ptr: *mut c_void,
    bytes: usize,
}

impl DevMem {
    fn alloc(what: &str, bytes: usize) -> std::result::Result<Self, HipError> {
        let mut ptr = std::ptr::null_mut();
        // A one-byte allocation stands for an empty buffer: a null pointer would be a valid
        // kernel argument that no kernel expects.
        let n = bytes.max(1);
        // SAFETY: ptr is a valid out-pointer.
        check(&format!("hipMalloc({what}, {n} B)"), unsafe {
            hipMalloc(&mut ptr, n)
        })?;
        Ok(DevMem { ptr, bytes })
    }

    fn upload<T: Copy>(what: &str, host: &[T]) -> std::result::Result<Self, HipError> {
        let bytes = std::mem::size_of_val(host);
        let m = Self::alloc(what, bytes)?;
        if bytes > 0 {
            // SAFETY: m holds at least `bytes`; host is `bytes` long.
            check(&format!("hipMemcpyHtoD({what})"), unsafe {
                hipMemcpyHtoD(m.ptr, host.as_ptr().cast(), bytes)
            })?;
        }
        Ok(m)
    }

    fn download(&self, what: &str, host: &mut [f32]) -> std::result::Result<(), HipError> {
        let bytes = std::mem::size_of_val(host).min(self.bytes);
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both sides hold at least `bytes`.
        check(&format!("hipMemcpyDtoH({what})"), unsafe {
            hipMemcpyDtoH(host.as_mut_ptr().cast(), self.ptr, bytes)
        })
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: ptr came from hipMalloc and is freed once.
        unsafe {
            hipFree(self.ptr);
        }
    }
}

/// The HIP backend, on one device.
pub struct HipBackend {
    /// The device's ordinal, made current on the calling thread before each call (HIP's
    /// current device is per host thread).
    device: i32,
    arch: Arch,
    target_id: String,
    origins: Vec<String>,
    // Function handles point into the modules below, which unload when the backend drops.
    funcs: Mutex<HashMap<String, FuncPtr>>,
    small: Module,
    fallback: Module,
}

#[derive(Clone, Copy)]
struct FuncPtr(sys::hipFunction_t);
// SAFETY: a hipFunction_t is a handle into a loaded module, valid from any host thread while
// the module is loaded (HIP's module API is thread-safe); the backend owns the module.
unsafe impl Send for FuncPtr {}
// SAFETY: as above.
unsafe impl Send for Module {}
// SAFETY: a module handle is only read after loading.
unsafe impl Sync for Module {}

impl std::fmt::Debug for HipBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBackend")
            .field("target", &self.target_id)
            .field("code_objects", &self.origins)
            .finish()
    }
}

impl HipBackend {
    /// Opens device 0 and loads the code objects for its architecture.
    ///
    /// # Errors
    /// As [`HipBackend::on_device`].
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }

    /// The number of HIP devices this process sees (0 without a runtime or a GPU).
    pub fn device_count() -> usize {
        let mut count = 0i32;
        // SAFETY: plain runtime calls with a valid out-pointer.
        let ok = unsafe { hipInit(0) } == HIP_SUCCESS
            && unsafe { hipGetDeviceCount(&mut count) } == HIP_SUCCESS;
        if ok {
            count.max(0) as usize
        } else {
            0
        }
    }

    /// Opens device `ordinal` (as the runtime numbers them after `HIP_VISIBLE_DEVICES`) and
    /// loads the code objects for its architecture.
    ///
    /// # Errors
    /// [`Error::NoDevice`] (one line) when the runtime finds no device, or none with that
    /// ordinal; [`Error::Hip`] when the device's architecture has no code object or a HIP
    /// call fails.
    pub fn on_device(ordinal: usize) -> Result<Self> {
        // SAFETY: plain runtime calls with valid out-pointers.
        let init = unsafe { hipInit(0) };
        let mut count = 0i32;
        let counted = unsafe { hipGetDeviceCount(&mut count) };
        if init != HIP_SUCCESS || counted != HIP_SUCCESS || count < 1 {
            let e = if counted != HIP_SUCCESS {
                status_error("hipGetDeviceCount", counted).to_string()
            } else if init != HIP_SUCCESS {
                status_error("hipInit", init).to_string()
            } else {
                format!("hipGetDeviceCount: {count} devices")
            };
            let mut version = 0i32;
            let v = unsafe { hipRuntimeGetVersion(&mut version) };
            let runtime = if v == HIP_SUCCESS {
                format!("HIP runtime {version}")
            } else {
                "HIP runtime".into()
            };
            return Err(no_device(format!("{runtime} found no GPU ({e})")));
        }
        let device = match i32::try_from(ordinal) {
            Ok(d) if d < count => d,
            _ => {
                return Err(no_device(format!(
                    "no HIP device {ordinal}: the runtime sees {count} (0 to {})",
                    count - 1
                )))
            }
        };
        check(&format!("hipSetDevice({device})"), unsafe {
            hipSetDevice(device)
        })?;
        let target_id = Self::target_id(device)?;
        let arch_name = processor(&target_id).to_string();
        // A code object directory could hold kernels for any target; these need CDNA's
        // wavefronts and MFMA, so other GPUs are refused by name.
        if !ARCHS.contains(&arch_name.as_str()) {
            return Err(HipError::UnsupportedArch {
                device,
                target: target_id,
            }
            .into());
        }
        let arch: Arch = arch_name
            .parse()
            .map_err(|e: String| HipError::Unsupported(format!("arch {arch_name}: {e}")))?;
        let dir = std::env::var_os(CODE_OBJECTS_ENV).map(PathBuf::from);
        let mut origins = Vec::new();
        let mut load = |stem: &'static str| -> std::result::Result<Module, HipError> {
            let co = find_code_object(dir.as_deref(), &arch_name, stem)?;
            let mut handle = std::ptr::null_mut();
            // SAFETY: the image is a complete code object that outlives the call (the runtime
            // copies it).
            check(&format!("hipModuleLoadData({})", co.origin), unsafe {
                hipModuleLoadData(&mut handle, co.bytes.as_ptr().cast())
            })?;
            origins.push(format!("{} ({})", co.origin, fingerprint(&co.bytes)));
            Ok(Module { handle })
        };
        let small = load("small_seq")?;
        let fallback = load("fallback")?;
        Ok(HipBackend {
            device,
            arch,
            target_id,
            origins,
            funcs: Mutex::new(HashMap::new()),
            small,
            fallback,
        })
    }

    fn target_id(device: i32) -> std::result::Result<String, HipError> {
        // Far larger than any revision of hipDeviceProp_t, so a runtime whose layout is larger
        // than hip-sys's cannot write past the buffer.
        let mut image = vec![0u8; 1 << 16];
        // SAFETY: the buffer is writable and larger than the structure.
        check(&format!("hipGetDeviceProperties({device})"), unsafe {
            hipGetDeviceProperties(image.as_mut_ptr().cast(), device)
        })?;
        let offset = std::mem::offset_of!(sys::hipDeviceProp_t, gcnArchName);
        arch_from_props(&image, offset).ok_or(HipError::NoArchName { device })
    }

    /// Makes this backend's device current on the calling thread: a campaign may call from
    /// any of its threads, and a thread that never chose one launches on device 0.
    fn make_current(&self) -> std::result::Result<(), HipError> {
        // SAFETY: a plain runtime call; the ordinal was checked when the backend opened.
        check(&format!("hipSetDevice({})", self.device), unsafe {
            hipSetDevice(self.device)
        })
    }

    /// The device's target ID (e.g. `gfx942:sramecc+:xnack-`).
    pub fn target(&self) -> &str {
        &self.target_id
    }

    /// Where the loaded code objects came from, each with its fingerprint.
    pub fn code_objects(&self) -> &[String] {
        &self.origins
    }

    fn func(&self, family: Family, name: &str) -> std::result::Result<FuncPtr, HipError> {
        let mut funcs = self
            .funcs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = funcs.get(name) {
            return Ok(*f);
        }
        let module = match family {
            Family::SmallSeq => &self.small,
            Family::Fallback => &self.fallback,
        };
        let cname = CString::new(name).map_err(|_| HipError::Unsupported(name.into()))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: valid module handle, NUL-terminated name, valid out-pointer.
        check(&format!("hipModuleGetFunction({name})"), unsafe {
            hipModuleGetFunction(&mut f, module.handle, cname.as_ptr())
        })?;
        funcs.insert(name.into(), FuncPtr(f));
        Ok(FuncPtr(f))
    }

    fn blocks(items: i64) -> std::result::Result<u32, HipError> {
        let blocks = (items.max(0) as u64).div_ceil(WARPS_PER_BLOCK as u64);
        u32::try_from(blocks)
            .ok()
            .filter(|&b| b < i32::MAX as u32)
            .ok_or(HipError::Grid { items })
    }

    /// Launches `name` with the argument list [`args_of`] builds for `kernel`, after
    /// [`check_aligned`], as the CUDA backend's `launch` does.
    fn launch(
        &self,
        family: Family,
        name: &str,
        kernel: Kernel,
        (d, p): (&LaunchDims, &Ptrs),
        (blocks, shared_bytes): (u32, u32),
    ) -> std::result::Result<(), HipError> {
        check_aligned(kernel, p)?;
        let f = self.func(family, name)?;
        let args = args_of(kernel, d, p);
        // Each argument by value in its own slot; the runtime reads them through `params`
        // according to the kernel's argument layout, during the call.
        let mut slots: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut s = [0u8; 8];
                match *a {
                    Arg::Ptr(p) => s.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I64(x) => s.copy_from_slice(&x.to_ne_bytes()),
                    Arg::I32(x) => s[..4].copy_from_slice(&x.to_ne_bytes()),
                    Arg::F32(x) => s[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                s
            })
            .collect();
        let mut params: Vec<*mut c_void> =
            slots.iter_mut().map(|s| s.as_mut_ptr().cast()).collect();
        // SAFETY: `params` points at one live slot per kernel argument, in order, each holding
        // the argument's bytes at its start; the null stream is the device's default stream.
        check(name, unsafe {
            hipModuleLaunchKernel(
                f.0,
                blocks,
                1,
                1,
                WARPS_PER_BLOCK * THREADS_PER_ITEM,
                1,
                1,
                shared_bytes,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Names of the fallback kernels (`fallback_fwd_bf16`, `fallback_bwd_q_…`,
    /// `fallback_bwd_kv_…`) for these dims.
    pub fn fallback_names(d: &LaunchDims) -> std::result::Result<[String; 3], HipError> {
        let suf = Self::dtype_suffix(d, true)?;
        Ok([
            format!("fallback_fwd_{suf}"),
            format!("fallback_bwd_q_{suf}"),
            format!("fallback_bwd_kv_{suf}"),
        ])
    }

    fn dtype_suffix(
        d: &LaunchDims,
        allow_f32: bool,
    ) -> std::result::Result<&'static str, HipError> {
        d.dtype_suffix(allow_f32)
            .map_err(|m| HipError::Unsupported(format!("hip {m}")))
    }

    /// Name of the small-seq kernel (`small_seq_fwd_bf16_d128_o32`, …).
    pub fn small_name(dir: &str, d: &LaunchDims) -> std::result::Result<String, HipError> {
        if let Some(m) = d.small_seq_unsupported() {
            return Err(HipError::Unsupported(format!("hip {m}")));
        }
        let base = match (d.dtype, d.out_f32) {
            (Dtype::Bf16, _) => "bf16",
            (Dtype::F16, _) => "f16",
            (Dtype::F32, _) => Self::dtype_suffix(d, false)?,
        };
        let o32 = if d.out_f32 { "_o32" } else { "" };
        Ok(format!("small_seq_{dir}_{base}_d{}{o32}", d.dqk))
    }

    fn check_fallback(d: &LaunchDims) -> std::result::Result<(), HipError> {
        d.fallback_unsupported()
            .map_or(Ok(()), |m| Err(HipError::Unsupported(format!("hip {m}"))))
    }

    /// Small-seq forward on raw pointers (`q, k, v, o, lse`, offsets).
    ///
    /// # Errors
    /// Unsupported shapes, HIP errors.
    pub fn launch_small_seq_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        let name = Self::small_name("fwd", d)?;
        let blocks = Self::blocks(d.b as i64 * d.heads as i64)?;
        if blocks == 0 {
            return Ok(());
        }
        Ok(self.launch(
            Family::SmallSeq,
            &name,
            Kernel::SmallSeqFwd,
            (d, p),
            (blocks, 0),
        )?)
    }

    /// Small-seq backward on raw pointers (`q, k, v, d_o, lse, dq, dk, dv`, offsets).
    ///
    /// # Errors
    /// Unsupported shapes, HIP errors.
    pub fn launch_small_seq_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        let name = Self::small_name("bwd", d)?;
        let blocks = Self::blocks(d.b as i64 * d.heads as i64)?;
        if blocks == 0 {
            return Ok(());
        }
        Ok(self.launch(
            Family::SmallSeq,
            &name,
            Kernel::SmallSeqBwd,
            (d, p),
            (blocks, 0),
        )?)
    }

    /// Fallback forward on raw pointers.
    ///
    /// # Errors
    /// Unsupported shapes, HIP errors.
    pub fn launch_fallback_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_fallback(d)?;
        if let Some((name, tiles)) = d.tiled_fwd(Gpu::Hip) {
            // One block per (head, slot, query tile): `blocks` counts items.
            let items = d.heads as i64 * d.b as i64 * tiles as i64;
            let blocks = Self::blocks(items * WARPS_PER_BLOCK as i64)?;
            if blocks == 0 {
                return Ok(());
            }
            let smem = d.tiled_fwd_smem();
            return Ok(self.launch(
                Family::Fallback,
                &name,
                Kernel::TiledFwd,
                (d, p),
                (blocks, smem),
            )?);
        }
        let [name, _, _] = Self::fallback_names(d)?;
        let blocks = Self::blocks(d.tq * d.heads as i64)?;
        if blocks == 0 || d.b == 0 {
            return Ok(());
        }
        // One f32 row of Dqk per wavefront.
        let smem = WARPS_PER_BLOCK * 4 * d.dqk as u32;
        Ok(self.launch(
            Family::Fallback,
            &name,
            Kernel::FallbackFwd,
            (d, p),
            (blocks, smem),
        )?)
    }

    /// Fallback backward on raw pointers (query side with `delta`, then key side).
    ///
    /// # Errors
    /// Unsupported shapes, HIP errors.
    pub fn launch_fallback_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        Self::check_fallback(d)?;
        let [_, name_q, name_kv] = Self::fallback_names(d)?;
        if d.b == 0 {
            return Ok(());
        }
        if let Some(([name_q, name_kv], key_tiles)) = d.tiled_bwd(Gpu::Hip) {
            // One block per (head, slot, query tile), then per (kv head, slot, key tile).
            let smem = d.tiled_bwd_smem();
            let sides = [
                (name_q, Kernel::TiledBwdQ, d.heads, d.tiled_tiles(), 1),
                (
                    name_kv,
                    Kernel::TiledBwdKv,
                    d.kv_heads,
                    key_tiles,
                    d.tiled_bwd_kv_parts(),
                ),
            ];
            for (name, kernel, heads, tiles, parts) in sides {
                let items = heads as i64 * d.b as i64 * tiles as i64 * parts;
                let blocks = Self::blocks(items * WARPS_PER_BLOCK as i64)?;
                if blocks > 0 {
                    self.launch(Family::Fallback, &name, kernel, (d, p), (blocks, smem))?;
                }
            }
            return Ok(());
        }
        let smem = WARPS_PER_BLOCK * 4 * (d.dqk + d.dv) as u32;
        let blocks = Self::blocks(d.tq * d.heads as i64)?;
        if blocks > 0 {
            self.launch(
                Family::Fallback,
                &name_q,
                Kernel::FallbackBwdQ,
                (d, p),
                (blocks, smem),
            )?;
        }
        let blocks = Self::blocks(d.tk * d.kv_heads as i64)?;
        if blocks > 0 {
            self.launch(
                Family::Fallback,
                &name_kv,
                Kernel::FallbackBwdKv,
                (d, p),
                (blocks, smem),
            )?;
        }
        Ok(())
    }

    /// Waits for the device and reports any asynchronous error.
    ///
    /// # Errors
    /// The first asynchronous error.
    pub fn sync(&self) -> Result<()> {
        // SAFETY: no arguments.
        Ok(check("hipDeviceSynchronize", unsafe {
            hipDeviceSynchronize()
        })?)
    }
}

/// A kernel this backend can launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// The kernel file whose code object holds it.
    pub stem: &'static str,
    pub name: String,
    /// Its arguments as the launch passes them: `P` a pointer, `4`/`8` a value of that size.
    pub args: String,
}

/// Every kernel this backend can launch, from the same name and argument functions the
/// launches use (`ci/hip-compile-check.sh` checks each against the code objects' metadata).
pub fn kernels() -> Vec<KernelInfo> {
    let sig = |k: Kernel, d: &LaunchDims| -> String {
        args_of(k, d, &Ptrs::default())
            .iter()
            .map(Arg::code)
            .collect()
    };
    kernel_names()
        .into_iter()
        .map(|(stem, name)| {
            let d = dims_for_signature();
            let k = if stem == "small_seq" {
                if name.starts_with("small_seq_fwd") {
                    Kernel::SmallSeqFwd
                } else {
                    Kernel::SmallSeqBwd
                }
            } else if name.starts_with("fallback_fwd_tc") {
                Kernel::TiledFwd
            } else if name.starts_with("fallback_bwd_q_tc") {
                Kernel::TiledBwdQ
            } else if name.starts_with("fallback_bwd_kv_tc") {
                Kernel::TiledBwdKv
            } else if name.starts_with("fallback_fwd") {
                Kernel::FallbackFwd
            } else if name.starts_with("fallback_bwd_q") {
                Kernel::FallbackBwdQ
            } else {
                Kernel::FallbackBwdKv
            };
            KernelInfo {
                stem,
                args: sig(k, &d),
                name,
            }
        })
        .collect()
}

fn dims_for_signature() -> LaunchDims {
    LaunchDims {
        dtype: Dtype::Bf16,
        out_f32: false,
        b: 1,
        heads: 1,
        kv_heads: 1,
        dqk: 64,
        dv: 64,
        tq: 1,
        tk: 1,
        max_lq: 1,
        max_lk: 1,
        scale: 1.0,
        mask: 0,
        window: (-1, -1),
    }
}

/// Every kernel this backend can launch, with the file (stem) whose code object holds it, from
/// the same name functions the launches use.
pub fn kernel_names() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for (dtype, out_f32) in [
        (Dtype::Bf16, false),
        (Dtype::Bf16, true),
        (Dtype::F16, false),
        (Dtype::F16, true),
        (Dtype::F32, false),
    ] {
        let mut d = LaunchDims {
            dtype,
            out_f32,
            max_lq: TILED_ROWS, // long enough for the tiled forward
            ..dims_for_signature()
        };
        if let Ok(names) = HipBackend::fallback_names(&d) {
            v.extend(names.into_iter().map(|n| ("fallback", n)));
        }
        for &dim in Gpu::Hip.tiled_fwd_dims() {
            d.dqk = dim as i32;
            d.dv = dim as i32;
            if let Some((n, _)) = d.tiled_fwd(Gpu::Hip) {
                v.push(("fallback", n));
            }
            if let Some((names, _)) = d.tiled_bwd(Gpu::Hip) {
                v.extend(names.into_iter().map(|n| ("fallback", n)));
            }
        }
        d.max_lq = SMALL_SEQ_MAX_ROWS;
        for dim in SMALL_SEQ_HEAD_DIMS {
            d.dqk = dim as i32;
            d.dv = dim as i32;
            for dir in ["fwd", "bwd"] {
                if let Ok(n) = HipBackend::small_name(dir, &d) {
                    v.push(("small_seq", n));
                }
            }
        }
    }
    v
}

fn upload_tensor(
    what: &str,
    dtype: Dtype,
    a: &ArrayView3<f32>,
) -> std::result::Result<DevMem, HipError> {
    match dtype {
        Dtype::Bf16 => {
            let v: Vec<u16> = a
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            DevMem::upload(what, &v)
        }
        Dtype::F16 => {
            let v: Vec<u16> = a
                .iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect();
            DevMem::upload(what, &v)
        }
        Dtype::F32 => {
            let v: Vec<f32> = a.iter().copied().collect();
            DevMem::upload(what, &v)
        }
    }
}

/// Device copies of the inputs and offsets of one call.
struct Inputs {
    tensors: Vec<DevMem>,
    offsets: Vec<DevMem>,
}

impl Inputs {
    fn upload(args: &FwdArgs, extra: &[&ArrayView3<f32>]) -> std::result::Result<Self, HipError> {
        let dt = args.config.dtype;
        let mut tensors = vec![
            upload_tensor("q", dt, &args.q)?,
            upload_tensor("k", dt, &args.k)?,
            upload_tensor("v", dt, &args.v)?,
        ];
        for (i, a) in extra.iter().enumerate() {
            tensors.push(upload_tensor(&format!("extra {i}"), dt, a)?);
        }
        let l = args.layout;
        let offsets = vec![
            DevMem::upload("cu_seqlens_q", &l.q.cu)?,
            DevMem::upload("cu_seqlens_kv", &l.kv.cu)?,
            DevMem::upload("offsets_q", l.q.offsets())?,
            DevMem::upload("offsets_kv", l.kv.offsets())?,
        ];
        Ok(Inputs { tensors, offsets })
    }

    fn ptrs(&self) -> Ptrs {
        Ptrs {
            q: self.tensors[0].addr(),
            k: self.tensors[1].addr(),
            v: self.tensors[2].addr(),
            cu_q: self.offsets[0].addr(),
            cu_kv: self.offsets[1].addr(),
            off_q: self.offsets[2].addr(),
            off_kv: self.offsets[3].addr(),
            ..Ptrs::default()
        }
    }
}

fn body_addr(m: &DevMem, buf: &DevBuf) -> u64 {
    m.addr() + (buf.base * 4) as u64
}

impl HipBackend {
    fn fwd(&self, family: Family, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        let d = dims_of(args.config, args.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        self.make_current()?;
        let inp = Inputs::upload(args, &[])?;
        let o = DevMem::upload("o", &out.o.data)?;
        let lse = DevMem::upload("lse", &out.lse.data)?;
        let p = Ptrs {
            o: body_addr(&o, &out.o),
            lse: body_addr(&lse, &out.lse),
            ..inp.ptrs()
        };
        match family {
            Family::SmallSeq => self.launch_small_seq_fwd(&d, &p)?,
            Family::Fallback => self.launch_fallback_fwd(&d, &p)?,
        }
        self.sync()?;
        o.download("o", &mut out.o.data)?;
        lse.download("lse", &mut out.lse.data)?;
        Ok(())
    }

    fn bwd(&self, family: Family, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        let f = &args.fwd;
        let d = dims_of(f.config, f.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        self.make_current()?;
        let inp = Inputs::upload(f, &[&args.d_o])?;
        let lse_host: Vec<f32> = args.lse.iter().copied().collect();
        let lse = DevMem::upload("lse", &lse_host)?;
        let dq = DevMem::upload("dq", &out.dq.data)?;
        let dk = DevMem::upload("dk", &out.dk.data)?;
        let dv = DevMem::upload("dv", &out.dv.data)?;
        let ws = DevMem::upload("workspace", &out.workspace.data)?;
        let mut p = Ptrs {
            d_o: inp.tensors[3].addr(),
            lse: lse.addr(),
            dq: body_addr(&dq, &out.dq),
            dk: body_addr(&dk, &out.dk),
            dv: body_addr(&dv, &out.dv),
            ..inp.ptrs()
        };
        if family == Family::Fallback {
            let base = body_addr(&ws, &out.workspace);
            let at = |name| {
                scratch_addr(f.plan, name, &d, base, out.workspace.len).map_err(Error::Workspace)
            };
            p.delta = at(names::DELTA)?;
            p.rowsum = at(names::ROWSUM)?;
        }
        match family {
            Family::SmallSeq => self.launch_small_seq_bwd(&d, &p)?,
            Family::Fallback => self.launch_fallback_bwd(&d, &p)?,
        }
        self.sync()?;
        dq.download("dq", &mut out.dq.data)?;
        dk.download("dk", &mut out.dk.data)?;
        dv.download("dv", &mut out.dv.data)?;
        ws.download("workspace", &mut out.workspace.data)?;
        Ok(())
    }
}

impl Backend for HipBackend {
    fn name(&self) -> &str {
        "hip"
    }

    fn provenance(&self) -> BTreeMap<String, String> {
        let mut p = BTreeMap::from([
            ("device".to_string(), self.device.to_string()),
            ("target".to_string(), self.target_id.clone()),
            ("code_objects".to_string(), self.origins.join("; ")),
        ]);
        let mut version = 0i32;
        // SAFETY: one valid out-pointer.
        if unsafe { hipRuntimeGetVersion(&mut version) } == HIP_SUCCESS {
            p.insert("runtime".into(), version.to_string());
        }
        p
    }

    fn arch(&self) -> Arch {
        self.arch.clone()
    }

    fn has_small_seq(&self) -> bool {
        // The small-seq code object loaded for this arch; every gfx arch this backend builds
        // for has matrix cores.
        true
    }

    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        super::rounding_budget_of("hip", tensor)
    }

    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        Some(dims_of(config, layout, false).fallback_fwd_kernel(Gpu::Hip))
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

    fn dims(dtype: Dtype, out_f32: bool, d: i32) -> LaunchDims {
        LaunchDims {
            dtype,
            out_f32,
            b: 1,
            heads: 2,
            kv_heads: 2,
            dqk: d,
            dv: d,
            tq: 1,
            tk: 1,
            max_lq: 1,
            max_lk: 1,
            scale: 1.0,
            mask: 0,
            window: (-1, -1),
        }
    }

    #[test]
    fn kernel_names_exist_in_the_sources() {
        let small = include_str!("../../kernels/small_seq.cu");
        for d in SMALL_SEQ_HEAD_DIMS {
            assert!(small.contains(&format!("SS_ALL({d})")));
            for dt in [Dtype::Bf16, Dtype::F16] {
                for o32 in [false, true] {
                    let n = HipBackend::small_name("fwd", &dims(dt, o32, d as i32)).unwrap();
                    assert!(n.starts_with("small_seq_fwd_") && n.contains(&format!("_d{d}")));
                    assert_eq!(n.ends_with("_o32"), o32, "{n}");
                }
            }
        }
        assert!(HipBackend::small_name("fwd", &dims(Dtype::F32, false, 64)).is_err());
        assert!(HipBackend::small_name("fwd", &dims(Dtype::Bf16, false, 96)).is_err());
    }

    #[test]
    fn every_launchable_kernel_is_listed() {
        let names = kernel_names();
        // 2 dtypes x 2 output kinds x 3 dims x fwd/bwd; 5 fallback suffixes x 3 kernels, and
        // the tiled forward for 4 suffixes x 2 dims (HIP builds no tiled backward and no
        // tiled forward at D = 256: kernels/fallback.cu says why).
        assert_eq!(names.iter().filter(|(s, _)| *s == "small_seq").count(), 24);
        assert_eq!(
            names.iter().filter(|(s, _)| *s == "fallback").count(),
            15 + 4 * 2
        );
        let fb = include_str!("../../kernels/fallback.cu");
        for suf in ["bf16", "f16", "f32", "bf16_o32", "f16_o32"] {
            assert!(fb.contains(&format!("FB_KERNELS({suf},")), "{suf}");
        }
        for &d in Gpu::Hip.tiled_fwd_dims() {
            assert!(fb.contains(&format!("\nFT_KERNELS({d})")), "{d}");
        }
    }

    #[test]
    fn arch_names_from_property_images() {
        let mut img = vec![0u8; 2048];
        img[1000..1000 + 22].copy_from_slice(b"gfx942:sramecc+:xnack-");
        assert_eq!(
            arch_from_props(&img, 1000).as_deref(),
            Some("gfx942:sramecc+:xnack-")
        );
        // Wrong offset: found by scanning; a marketing name before it is skipped.
        img[10..29].copy_from_slice(b"AMD Instinct MI300X");
        assert_eq!(
            arch_from_props(&img, 500).as_deref(),
            Some("gfx942:sramecc+:xnack-")
        );
        assert_eq!(arch_from_props(&[0u8; 64], 8), None);
        // Unterminated or not hex digits after gfx: rejected.
        assert_eq!(arch_from_props(b"gfx942", 0), None);
        assert_eq!(arch_from_props(b"gfxzz\0", 0), None);
        assert_eq!(processor("gfx90a:xnack+"), "gfx90a");
    }

    #[test]
    fn missing_code_objects_are_typed_errors() {
        let dir = std::env::temp_dir().join(format!("smallseq-hip-none-{}", std::process::id()));
        match find_code_object(Some(&dir), "gfx942", "small_seq") {
            Err(HipError::NoCodeObject { arch, stem, .. }) => {
                assert_eq!((arch.as_str(), stem), ("gfx942", "small_seq"))
            }
            other => panic!("{other:?}"),
        }
        match find_code_object(None, "gfx1", "fallback") {
            Err(e @ HipError::NoCodeObject { .. }) => {
                assert!(e.to_string().contains("SMALLSEQ_HIP_CODE_OBJECTS"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn new_never_panics() {
        // Without a GPU (this machine, CI) it is NoDevice in one line; with one it is Ok, or a
        // typed error naming what is missing.
        match HipBackend::new() {
            Ok(b) => assert!(b.target().starts_with("gfx")),
            Err(e) => {
                let s = e.to_string();
                assert_eq!(s.lines().count(), 1, "{s}");
                assert!(e.is_no_device() || s.contains("hip"), "{s}");
            }
        }
    }

    #[test]
    fn an_ordinal_past_the_devices_is_a_one_line_error() {
        let n = HipBackend::device_count();
        let e = HipBackend::on_device(n).expect_err("no device has the ordinal of the count");
        let s = e.to_string();
        assert!(e.is_no_device(), "{s}");
        assert_eq!(s.lines().count(), 1, "{s}");
        if n > 0 {
            assert!(s.contains(&format!("no HIP device {n}")), "{s}");
        }
    }
}
