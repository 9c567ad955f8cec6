//! The HIP runtime of the GPU backend ([`super::GpuBackend`], feature `hip`): the portable
//! kernels of `kernels/` as AMD GPU code objects (gfx942 first; gfx90a and gfx950 where the
//! compiler could build them), loaded with `hipModuleLoadData` and launched with
//! `hipModuleLaunchKernel`, on the HIP runtime that `hip-sys` links (`libamdhip64`).
//!
//! Code objects come from `SMALLSEQ_HIP_CODE_OBJECTS=DIR` (files `small_seq.<arch>.hsaco` and
//! `fallback.<arch>.hsaco`) when set, else from those the build embedded (`build.rs`). The
//! device's architecture picks the pair.
//!
//! Uploads, launches and downloads are the shared backend's; launch geometry differs from
//! CUDA's in one way: every kernel gets 64 threads per work item (one wavefront; the
//! small-seq kernels run one item per wavefront, see `kernels/portable.h`), 4 items per block.
//!
//! Every HIP call is checked and fails as [`HipError::Call`] naming the call and the HIP error
//! (an [`Error::Device`]). The runtime functions are declared here with plain integer status
//! codes rather than taken from `hip-sys`, whose `hipError_t` is a Rust enum: a status code
//! that a newer runtime added would be undefined behaviour there. `hip-sys` provides the link
//! to `libamdhip64` and the `hipDeviceProp_t` layout.

pub use super::plan::KernelInfo;
use super::{DeviceApi, GpuBackend, Grid};
use crate::backend::kernel_args::Arg;
use crate::backend::kernel_cache::fingerprint;
pub use crate::backend::launch::{
    dims_of, mask_code, scratch_addr, LaunchDims, Ptrs, FALLBACK_MAX_HEAD_DIM, SMALL_SEQ_HEAD_DIMS,
    SMALL_SEQ_MAX_ROWS, TILED_HEAD_DIMS, TILED_ROWS,
};
use crate::backend::launch::{Family, Gpu};
use crate::dispatch::Arch;
use crate::error::{Error, Result};
use hip_sys::hiprt as sys;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
}

/// Architectures code objects are built for, in order of preference.
pub const ARCHS: [&str; 3] = ["gfx942", "gfx90a", "gfx950"];
/// The kernel files, each one code object per architecture ([`Family::stem`], in module order).
pub const STEMS: [&str; 2] = [Family::SmallSeq.stem(), Family::Fallback.stem()];
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
    /// An argument the kernels cannot take.
    #[error("{0}")]
    Unsupported(String),
}

impl From<HipError> for Error {
    fn from(e: HipError) -> Self {
        match e {
            // The harness skips unsupported cases by this variant, whatever the backend.
            HipError::Unsupported(s) => Error::Unsupported(s),
            // A failed call, or a device without kernels to load.
            other => Error::Device {
                backend: "hip".into(),
                detail: other.to_string(),
            },
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
pub struct DevMem {
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

    fn upload(what: &str, host: &[u8]) -> std::result::Result<Self, HipError> {
        let bytes = host.len();
        let m = Self::alloc(what, bytes)?;
        if bytes > 0 {
            // SAFETY: m holds at least `bytes`; host is `bytes` long.
            check(&format!("hipMemcpyHtoD({what})"), unsafe {
                hipMemcpyHtoD(m.ptr, host.as_ptr().cast(), bytes)
            })?;
        }
        Ok(m)
    }

    fn download(&self, what: &str, host: &mut [u8]) -> std::result::Result<(), HipError> {
        let bytes = host.len().min(self.bytes);
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

/// The HIP backend: [`GpuBackend`] over [`Hip`].
pub type HipBackend = GpuBackend<Hip>;

/// The HIP runtime on one device, with the code objects for its architecture loaded.
pub struct Hip {
    /// The device's ordinal, made current on the calling thread before each call (HIP's
    /// current device is per host thread).
    device: i32,
    arch: Arch,
    target_id: String,
    origins: Vec<String>,
    // The shared backend's function handles point into the modules below, which unload when
    // the runtime drops (after those handles: `GpuBackend` drops them first).
    small: Module,
    fallback: Module,
}

/// A kernel's handle in a loaded module.
#[derive(Clone, Copy)]
pub struct FuncPtr(sys::hipFunction_t);
// SAFETY: a hipFunction_t is a handle into a loaded module, valid from any host thread while
// the module is loaded (HIP's module API is thread-safe); the backend owns the module.
unsafe impl Send for FuncPtr {}
// SAFETY: as above.
unsafe impl Send for Module {}
// SAFETY: a module handle is only read after loading.
unsafe impl Sync for Module {}

impl std::fmt::Debug for Hip {
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
    /// ordinal; [`Error::Device`] when the device's architecture has no code object or a
    /// HIP call fails.
    pub fn on_device(ordinal: usize) -> Result<Self> {
        GpuBackend::from_runtime(Hip::open(ordinal)?)
    }

    /// The device's target ID (e.g. `gfx942:sramecc+:xnack-`).
    pub fn target(&self) -> &str {
        &self.runtime().target_id
    }

    /// Where the loaded code objects came from, each with its fingerprint.
    pub fn code_objects(&self) -> &[String] {
        &self.runtime().origins
    }
}

impl Hip {
    fn open(ordinal: usize) -> Result<Self> {
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
        Ok(Hip {
            device,
            arch,
            target_id,
            origins,
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
}

impl DeviceApi for Hip {
    const NAME: &'static str = "hip";
    const GPU: Gpu = Gpu::Hip;
    /// One wavefront (`PT_LWARP_THREADS`, `PT_WARP`).
    const THREADS_PER_ITEM: u32 = 64;
    type Mem = DevMem;
    type Func = FuncPtr;

    fn arch(&self) -> Arch {
        self.arch.clone()
    }

    fn has_small_seq(&self) -> bool {
        // The small-seq code object loaded for this arch; every gfx arch this backend builds
        // for has matrix cores.
        true
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

    /// Makes this backend's device current on the calling thread: a campaign may call from
    /// any of its threads, and a thread that never chose one launches on device 0.
    fn make_current(&self) -> Result<()> {
        // SAFETY: a plain runtime call; the ordinal was checked when the backend opened.
        Ok(check(&format!("hipSetDevice({})", self.device), unsafe {
            hipSetDevice(self.device)
        })?)
    }

    fn upload(&self, what: &str, bytes: &[u8]) -> Result<DevMem> {
        Ok(DevMem::upload(what, bytes)?)
    }

    /// `hipMemcpyDtoH` returns once the copy has completed.
    fn download(&self, what: &str, mem: &DevMem, host: &mut [u8]) -> Result<()> {
        Ok(mem.download(what, host)?)
    }

    fn addr(&self, mem: &DevMem) -> u64 {
        mem.addr()
    }

    /// The code objects loaded when the runtime opened.
    fn load_modules(&self) -> Result<()> {
        Ok(())
    }

    fn function(&self, family: Family, name: &str) -> Result<FuncPtr> {
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
        Ok(FuncPtr(f))
    }

    unsafe fn launch(&self, f: &FuncPtr, name: &str, grid: Grid, args: &[Arg]) -> Result<()> {
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
        // the argument's bytes at its start (the caller's contract: they are the kernel's
        // arguments); the null stream is the device's default stream.
        Ok(check(name, unsafe {
            hipModuleLaunchKernel(
                f.0,
                grid.blocks,
                1,
                1,
                grid.threads,
                1,
                1,
                grid.smem,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?)
    }

    fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments.
        Ok(check("hipDeviceSynchronize", unsafe {
            hipDeviceSynchronize()
        })?)
    }
}

/// Every kernel this backend can launch, from the same rule the launches follow
/// ([`super::plan::kernels`]; `ci/hip-compile-check.sh` checks each against the code objects'
/// metadata).
pub fn kernels() -> Vec<KernelInfo> {
    super::plan::kernels(Gpu::Hip)
}

/// [`kernels`]' names, each with the stem of the file whose code object holds it.
pub fn kernel_names() -> Vec<(&'static str, String)> {
    super::plan::kernel_names(Gpu::Hip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hip_errors_keep_their_verdicts() {
        let e: Error = HipError::Unsupported("hip small-seq kernel: …".into()).into();
        assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
        let e: Error = HipError::NoArchName { device: 3 }.into();
        assert!(
            matches!(&e, Error::Device { backend, .. } if backend == "hip"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "backend hip: device 3 reports no gfx architecture name"
        );
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
