//! One GPU backend for CUDA and HIP: [`GpuBackend`] over a small device API ([`DeviceApi`]).
//!
//! Everything both runtimes share is written once, here and in [`plan`]: the launch policy
//! (which kernels a call launches, their names, grids and shared memory), the uploads (inputs
//! in their dtype, the guarded output buffers whole, guards and poison included), the carving
//! of the fallback backward's scratch out of the workspace, one synchronisation per call, the
//! downloads, and how each failure becomes an [`Error`]. A runtime provides only memory,
//! modules, launches, synchronisation and its own errors: [`cuda`] (cudarc, feature `cuda`)
//! and [`hip`] (hip-sys, feature `hip`). This module is pure Rust, compiled and tested
//! without either feature, against a runtime that records what it is asked to do.
//!
//! How failures are judged, the same on both runtimes:
//!
//! | failure | error |
//! |---|---|
//! | a shape or dtype the kernels do not take | [`Error::Unsupported`] (`"cuda …"`, `"hip …"`) |
//! | a grid past what a 1-D grid holds | [`Error::Backend`] |
//! | a tensor a vector kernel needs on 16 bytes | [`Error::Misaligned`] |
//! | the workspace lacks the fallback backward's scratch, or holds too little | [`Error::Workspace`] |
//! | a runtime call (allocation, copy, kernel lookup, launch, synchronisation) | [`Error::Device`], from the runtime |
//! | a kernel build (CUDA's NVRTC or module load) | [`Error::Backend`], from the runtime |

/// One call's buffers as one allocation.
pub(crate) mod arena;
pub(crate) mod host;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
#[cfg(feature = "cuda")]
pub mod nvrtc;

use self::arena::{body_addr, unpack, Arena};
use self::host::{bytes_of, to_host};
use self::plan::{launches, Dir, Refusal};
use super::kernel_args::{args_of, check_aligned, Arg};
use super::launch::{
    dims_of, scratch_addr, BiasArgs, Family, Gpu, LaunchDims, Ptrs, WARPS_PER_BLOCK,
};
use super::{BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use crate::config::AttnConfig;
use crate::design::Design;
use crate::dispatch::Arch;
use crate::error::{Error, Result};
use crate::workspace::names;
use ndarray::ArrayView3;
use smallseq_reference::{Dtype, Layout};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// The geometry of one launch as the runtime takes it: a 1-D grid of `blocks` blocks of
/// `threads` threads, `smem` bytes of dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub blocks: u32,
    pub threads: u32,
    pub smem: u32,
}

/// What differs between the GPU runtimes. Every method fails with an [`Error`] the runtime
/// made from its own: [`Error::Device`] for a failed runtime call, [`Error::Backend`] for a
/// kernel build, [`Error::NoDevice`] only when opening.
pub trait DeviceApi: Send + Sync + Sized {
    /// The backend's name: `cuda`, `hip`.
    const NAME: &'static str;
    /// Which tiled kernels its build has ([`Gpu`]).
    const GPU: Gpu;
    /// Threads per work item: a warp (32) on CUDA, a wavefront (64) on HIP.
    const THREADS_PER_ITEM: u32;
    /// A device allocation, freed when dropped.
    type Mem;
    /// A loaded kernel.
    type Func: Clone + Send;

    /// The device's architecture.
    fn arch(&self) -> Arch;
    /// Whether the device runs the small-seq kernels.
    fn has_small_seq(&self) -> bool;
    /// Device, driver or runtime, and kernel build ([`BackendInfo::provenance`]).
    fn provenance(&self) -> BTreeMap<String, String>;
    /// The preprocessor defines its kernels were built with beyond the sources' defaults
    /// (`NAME` or `NAME=VALUE`): the launch policy reads the ones that change what a call
    /// launches (`FTB_D_FROM_O`, [`plan::d_form_in`]). None where the build is fixed.
    fn defines(&self) -> Vec<String> {
        Vec::new()
    }
    /// Makes the device current on the calling thread (HIP's current device is per thread).
    fn make_current(&self) -> Result<()>;
    /// A new allocation holding `bytes` (at least one byte, so never a null pointer).
    fn upload(&self, what: &str, bytes: &[u8]) -> Result<Self::Mem>;
    /// Copies the start of `mem` into `host`; returns once the bytes are on the host.
    fn download(&self, what: &str, mem: &Self::Mem, host: &mut [u8]) -> Result<()>;
    /// The device address of `mem`.
    fn addr(&self, mem: &Self::Mem) -> u64;
    /// Loads the modules now (compiling them first where the runtime compiles).
    fn load_modules(&self) -> Result<()>;
    /// The kernel `name` in `family`'s module.
    fn function(&self, family: Family, name: &str) -> Result<Self::Func>;
    /// Launches `f` on the device's default stream.
    ///
    /// # Safety
    /// `args` are the kernel's parameters in order and every pointer among them is a live
    /// device allocation (or inside one) that outlives the launch's completion.
    unsafe fn launch(&self, f: &Self::Func, name: &str, grid: Grid, args: &[Arg]) -> Result<()>;
    /// Waits for the device and reports any asynchronous error.
    fn synchronize(&self) -> Result<()>;
}

/// A GPU backend: the shared launch policy and buffers over runtime `R`.
pub struct GpuBackend<R: DeviceApi> {
    /// Kernels looked up so far, by name (dropped before the runtime whose modules they are
    /// in: fields drop in order).
    funcs: Mutex<HashMap<String, R::Func>>,
    /// Where the fallback backward's D comes from ([`plan::d_form_in`] of the runtime's
    /// defines).
    d_form: plan::DForm,
    rt: R,
}

impl<R: DeviceApi + std::fmt::Debug> std::fmt::Debug for GpuBackend<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.rt.fmt(f)
    }
}

/// Where one call's inputs and offsets lie in its [`Arena`].
struct InputsAt {
    tensors: Vec<usize>,
    offsets: [usize; 4],
    /// The bias's f32 tensor or slopes, where the case has a bias.
    bias: Option<usize>,
}

impl InputsAt {
    /// The launch's input pointers, for the call's allocation at `base`.
    fn ptrs(&self, base: u64) -> Ptrs {
        let a = |at: usize| base + at as u64;
        Ptrs {
            q: a(self.tensors[0]),
            k: a(self.tensors[1]),
            v: a(self.tensors[2]),
            cu_q: a(self.offsets[0]),
            cu_kv: a(self.offsets[1]),
            off_q: a(self.offsets[2]),
            off_kv: a(self.offsets[3]),
            bias: self.bias.map_or(0, a),
            ..Ptrs::default()
        }
    }
}

impl<R: DeviceApi> GpuBackend<R> {
    /// The backend over an opened runtime; refuses defines whose `FTB_D_FROM_O` the kernels
    /// do not know.
    pub fn from_runtime(rt: R) -> Result<Self> {
        Ok(GpuBackend {
            funcs: Mutex::new(HashMap::new()),
            d_form: plan::d_form_in(&rt.defines()).map_err(Error::Config)?,
            rt,
        })
    }

    /// Whether its fallback backward takes the stored O (`FTB_D_FROM_O` 1 or 2): a launch on
    /// raw pointers then needs `Ptrs::o` and [`LaunchDims::d_from_o`] set.
    pub fn d_from_o(&self) -> bool {
        self.d_form.takes_o()
    }

    /// The runtime.
    pub fn runtime(&self) -> &R {
        &self.rt
    }

    /// Compiles (if needed) and loads every kernel, so timing excludes compilation.
    ///
    /// # Errors
    /// The runtime's build or load errors.
    pub fn warm_up(&self) -> Result<()> {
        self.rt.load_modules()
    }

    /// Waits for the device and reports any asynchronous error.
    ///
    /// # Errors
    /// The first asynchronous error.
    pub fn sync(&self) -> Result<()> {
        self.rt.synchronize()
    }

    fn refusal(r: Refusal) -> Error {
        match r {
            // The harness skips unsupported cases by this variant, whatever the backend.
            Refusal::Unsupported(m) => Error::Unsupported(format!("{} {m}", R::NAME)),
            grid @ Refusal::Grid { .. } => Error::Backend {
                backend: R::NAME.into(),
                detail: grid.to_string(),
            },
        }
    }

    fn func(&self, family: Family, name: &str) -> Result<R::Func> {
        let mut funcs = self
            .funcs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = funcs.get(name) {
            return Ok(f.clone());
        }
        let f = self.rt.function(family, name)?;
        funcs.insert(name.into(), f.clone());
        Ok(f)
    }

    /// Launches what one call of `family` in direction `dir` takes ([`plan::launches`]) on
    /// raw pointers, each with the argument list [`args_of`] builds (the list the HIP compile
    /// check compares with the kernels' declared arguments), after [`check_aligned`].
    ///
    /// # Errors
    /// Unsupported shapes, a grid too large, misaligned tensors, runtime errors.
    pub fn launch(&self, family: Family, dir: Dir, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        let threads = WARPS_PER_BLOCK * R::THREADS_PER_ITEM;
        for l in launches(R::GPU, family, dir, d).map_err(Self::refusal)? {
            check_aligned(l.kernel, p)?;
            let f = self.func(l.family, &l.name)?;
            let args = args_of(l.kernel, d, p);
            let grid = Grid {
                blocks: l.blocks,
                threads,
                smem: l.smem,
            };
            // SAFETY: the argument list matches the kernel's parameters (args_of, checked
            // against the compiled kernels' metadata by ci/hip-compile-check.sh) and every
            // pointer is a live device allocation of the caller's (the entry points below keep
            // theirs until after the synchronisation).
            unsafe { self.rt.launch(&f, &l.name, grid, &args)? };
        }
        Ok(())
    }

    /// Small-seq forward on raw pointers (`q, k, v, o, lse`, offsets).
    ///
    /// # Errors
    /// As [`GpuBackend::launch`].
    pub fn launch_small_seq_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        self.launch(Family::SmallSeq, Dir::Fwd, d, p)
    }

    /// Small-seq backward on raw pointers (`q, k, v, d_o, lse, dq, dk, dv`, offsets).
    ///
    /// # Errors
    /// As [`GpuBackend::launch`].
    pub fn launch_small_seq_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        self.launch(Family::SmallSeq, Dir::Bwd, d, p)
    }

    /// Fallback forward on raw pointers: the tiled kernel where it applies
    /// ([`LaunchDims::tiled_fwd`]), else the scalar one.
    ///
    /// # Errors
    /// As [`GpuBackend::launch`].
    pub fn launch_fallback_fwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        self.launch(Family::Fallback, Dir::Fwd, d, p)
    }

    /// Fallback backward on raw pointers (the query side with `delta`, then the key side).
    ///
    /// # Errors
    /// As [`GpuBackend::launch`].
    pub fn launch_fallback_bwd(&self, d: &LaunchDims, p: &Ptrs) -> Result<()> {
        self.launch(Family::Fallback, Dir::Bwd, d, p)
    }

    /// Packs the inputs of one call (`extra`: tensors after q, k, v, such as dO) into `a`.
    fn pack_inputs(a: &mut Arena, args: &FwdArgs, extra: &[&ArrayView3<f32>]) -> InputsAt {
        let dt = args.config.dtype;
        let tensor = |a: &mut Arena, t: &ArrayView3<f32>| match (dt, t.as_slice()) {
            (Dtype::F32, Some(host)) => a.push(bytes_of(host)),
            _ => a.push(to_host(dt, t).bytes()),
        };
        let mut tensors = vec![tensor(a, &args.q), tensor(a, &args.k), tensor(a, &args.v)];
        for t in extra {
            tensors.push(tensor(a, t));
        }
        let l = args.layout;
        let offsets = [
            a.push(bytes_of(&l.q.cu)),
            a.push(bytes_of(&l.kv.cu)),
            a.push(bytes_of(l.q.offsets())),
            a.push(bytes_of(l.kv.offsets())),
        ];
        let bias = BiasArgs::host_values(&args.config.params.bias).map(|h| a.push(bytes_of(&h)));
        InputsAt {
            tensors,
            offsets,
            bias,
        }
    }

    /// Uploads `a` as one allocation; returns it and its device address.
    fn upload_arena(&self, a: &Arena) -> Result<(R::Mem, u64)> {
        let mem = self.rt.upload("the call's buffers", a.bytes())?;
        let base = self.rt.addr(&mem);
        Ok((mem, base))
    }

    /// Downloads the first `len` bytes of the call's allocation: its outputs.
    fn download_outputs(&self, mem: &R::Mem, len: usize) -> Result<Vec<u8>> {
        let mut host = vec![0u8; len];
        self.rt.download("the call's outputs", mem, &mut host)?;
        Ok(host)
    }

    fn fwd(&self, family: Family, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        let d = dims_of(args.config, args.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        self.rt.make_current()?;
        let mut a = Arena::default();
        let o_at = a.push_buf(&out.o);
        let lse_at = a.push_buf(&out.lse);
        let outputs = a.len();
        let inp = Self::pack_inputs(&mut a, args, &[]);
        let (mem, base) = self.upload_arena(&a)?;
        let p = Ptrs {
            o: body_addr(base, o_at, &out.o),
            lse: body_addr(base, lse_at, &out.lse),
            ..inp.ptrs(base)
        };
        self.launch(family, Dir::Fwd, &d, &p)?;
        self.sync()?;
        let host = self.download_outputs(&mem, outputs)?;
        unpack(&host, o_at, &mut out.o);
        unpack(&host, lse_at, &mut out.lse);
        Ok(())
    }

    fn bwd(&self, family: Family, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        let f = &args.fwd;
        let d = LaunchDims {
            d_from_o: self.d_form.takes_o() && family == Family::Fallback,
            ..dims_of(f.config, f.layout, true)
        };
        if d.b == 0 {
            return Ok(());
        }
        self.rt.make_current()?;
        // A post-scale bias's gradient is written whole (every element of [Bb, Hb, Sq, Sk]).
        let dbias = match (d.bias.grad_rows(), out.dbias.as_ref()) {
            (0, _) => None,
            (rows, Some(buf)) if buf.len as i64 >= rows * d.bias.dims[3] as i64 => Some(buf),
            (rows, buf) => {
                return Err(Error::Tensor {
                    tensor: "dbias".into(),
                    detail: format!(
                        "the post-scale bias [{}] needs a buffer of {} elements, got {}",
                        d.bias.dims.map(|x| x.to_string()).join(", "),
                        rows * d.bias.dims[3] as i64,
                        buf.map_or(0, |b| b.len)
                    ),
                })
            }
        };
        let mut a = Arena::default();
        let dq_at = a.push_buf(&out.dq);
        let dk_at = a.push_buf(&out.dk);
        let dv_at = a.push_buf(&out.dv);
        let ws_at = a.push_buf(&out.workspace);
        let dbias_at = dbias.map(|b| a.push_buf(b));
        let outputs = a.len();
        // O in the input type (the forward stored it rounded to it, so the copy is exact),
        // for the D kernel.
        let extra: &[&ArrayView3<f32>] = if d.d_from_o {
            &[&args.d_o, &args.o]
        } else {
            &[&args.d_o]
        };
        let inp = Self::pack_inputs(&mut a, f, extra);
        let lse_at = match args.lse.as_slice() {
            Some(host) => a.push(bytes_of(host)),
            None => a.push(bytes_of(&args.lse.iter().copied().collect::<Vec<f32>>())),
        };
        let (mem, base) = self.upload_arena(&a)?;
        let ws_body = body_addr(base, ws_at, &out.workspace);
        let mut p = Ptrs {
            d_o: base + inp.tensors[3] as u64,
            o: inp.tensors.get(4).map_or(0, |&at| base + at as u64),
            lse: base + lse_at as u64,
            dq: body_addr(base, dq_at, &out.dq),
            dk: body_addr(base, dk_at, &out.dk),
            dv: body_addr(base, dv_at, &out.dv),
            ..inp.ptrs(base)
        };
        if family == Family::Fallback {
            // A workspace without the scratch the launch needs is refused as the wrapper
            // refuses one sized under another plan.
            let len = out.workspace.len;
            let at = |name| scratch_addr(f.plan, name, &d, ws_body, len).map_err(Error::Workspace);
            p.delta = at(names::DELTA)?;
            p.rowsum = at(names::ROWSUM)?;
        }
        if let (Some(at), Some(buf)) = (dbias_at, dbias) {
            p.dbias = body_addr(base, at, buf);
        }
        self.launch(family, Dir::Bwd, &d, &p)?;
        self.sync()?;
        let host = self.download_outputs(&mem, outputs)?;
        if let (Some(at), Some(buf)) = (dbias_at, out.dbias.as_mut()) {
            unpack(&host, at, buf);
        }
        unpack(&host, dq_at, &mut out.dq);
        unpack(&host, dk_at, &mut out.dk);
        unpack(&host, dv_at, &mut out.dv);
        unpack(&host, ws_at, &mut out.workspace);
        Ok(())
    }
}

impl<R: DeviceApi> BackendInfo for GpuBackend<R> {
    fn name(&self) -> &str {
        R::NAME
    }

    fn arch(&self) -> Arch {
        self.rt.arch()
    }

    fn has_small_seq(&self) -> bool {
        self.rt.has_small_seq()
    }

    /// The scalar fallback kernels compute it (kernels/fallback.cu, `fb_drop`); a call with
    /// dropout launches them ([`LaunchDims::tiled_fwd`]).
    fn computes_dropout(&self) -> bool {
        true
    }

    /// The scalar fallback kernels add it and the dBias kernel reduces its gradient
    /// (kernels/fallback.cu, `fb_bias`, `fb_dbias`).
    fn computes_bias(&self) -> bool {
        true
    }

    fn provenance(&self) -> BTreeMap<String, String> {
        self.rt.provenance()
    }

    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        super::rounding_budget_of(R::NAME, tensor)
    }

    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        Some(dims_of(config, layout, false).fallback_fwd_kernel(R::GPU))
    }

    fn design(&self) -> Design {
        self.d_form.design()
    }
}

impl<R: DeviceApi> Compute for GpuBackend<R> {
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

/// Real devices plant nothing.
impl<R: DeviceApi> MutationHooks for GpuBackend<R> {}

#[cfg(test)]
mod tests;
