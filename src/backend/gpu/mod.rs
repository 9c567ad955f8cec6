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

pub(crate) mod host;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
#[cfg(feature = "cuda")]
pub mod nvrtc;

use self::host::{bytes_of, bytes_of_mut, to_host};
use self::plan::{launches, Dir, Refusal};
use super::launch::{
    args_of, check_aligned, dims_of, scratch_addr, Arg, BiasArgs, Family, Gpu, LaunchDims, Ptrs,
    WARPS_PER_BLOCK,
};
use super::{BackendInfo, BwdArgs, BwdBufs, Compute, DevBuf, FwdArgs, FwdBufs, MutationHooks};
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
    /// launches (`FTB_D_FROM_O`, [`plan::d_from_o_in`]). None where the build is fixed.
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
    /// Whether the kernels take the fallback backward's D from the stored O
    /// ([`plan::d_from_o_in`] of the runtime's defines).
    d_from_o: bool,
    rt: R,
}

impl<R: DeviceApi + std::fmt::Debug> std::fmt::Debug for GpuBackend<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.rt.fmt(f)
    }
}

/// Device copies of the inputs and offsets of one call.
struct Inputs<M> {
    tensors: Vec<M>,
    offsets: [M; 4],
    /// The bias's f32 tensor or slopes, where the case has a bias.
    bias: Option<M>,
}

impl<R: DeviceApi> GpuBackend<R> {
    /// The backend over an opened runtime.
    pub fn from_runtime(rt: R) -> Self {
        GpuBackend {
            funcs: Mutex::new(HashMap::new()),
            d_from_o: plan::d_from_o_in(&rt.defines()),
            rt,
        }
    }

    /// Whether its fallback backward takes D from the stored O (`FTB_D_FROM_O`): a launch on
    /// raw pointers then needs `Ptrs::o` and [`LaunchDims::d_from_o`] set.
    pub fn d_from_o(&self) -> bool {
        self.d_from_o
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

    fn upload_tensor(&self, what: &str, dtype: Dtype, a: &ArrayView3<f32>) -> Result<R::Mem> {
        if let (Dtype::F32, Some(host)) = (dtype, a.as_slice()) {
            return self.rt.upload(what, bytes_of(host));
        }
        self.rt.upload(what, to_host(dtype, a).bytes())
    }

    fn upload_inputs(&self, args: &FwdArgs, extra: &[&ArrayView3<f32>]) -> Result<Inputs<R::Mem>> {
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
        let offsets = [
            self.rt.upload("cu_seqlens_q", bytes_of(&l.q.cu))?,
            self.rt.upload("cu_seqlens_kv", bytes_of(&l.kv.cu))?,
            self.rt.upload("offsets_q", bytes_of(l.q.offsets()))?,
            self.rt.upload("offsets_kv", bytes_of(l.kv.offsets()))?,
        ];
        let bias = match BiasArgs::host_values(&args.config.params.bias) {
            Some(host) => Some(self.rt.upload("bias", bytes_of(&host))?),
            None => None,
        };
        Ok(Inputs {
            tensors,
            offsets,
            bias,
        })
    }

    fn base_ptrs(&self, inp: &Inputs<R::Mem>) -> Ptrs {
        let a = |m| self.rt.addr(m);
        Ptrs {
            q: a(&inp.tensors[0]),
            k: a(&inp.tensors[1]),
            v: a(&inp.tensors[2]),
            cu_q: a(&inp.offsets[0]),
            cu_kv: a(&inp.offsets[1]),
            off_q: a(&inp.offsets[2]),
            off_kv: a(&inp.offsets[3]),
            bias: inp.bias.as_ref().map_or(0, a),
            ..Ptrs::default()
        }
    }

    /// A guarded buffer uploaded whole, and the device address of its body.
    fn upload_buf(&self, what: &str, buf: &DevBuf) -> Result<(R::Mem, u64)> {
        let m = self.rt.upload(what, bytes_of(&buf.data))?;
        let body = self.rt.addr(&m) + (buf.base * 4) as u64;
        Ok((m, body))
    }

    fn download_into(&self, what: &str, m: &R::Mem, buf: &mut DevBuf) -> Result<()> {
        self.rt.download(what, m, bytes_of_mut(&mut buf.data))
    }

    fn fwd(&self, family: Family, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        let d = dims_of(args.config, args.layout, true);
        if d.b == 0 {
            return Ok(());
        }
        self.rt.make_current()?;
        let inp = self.upload_inputs(args, &[])?;
        let (o, o_body) = self.upload_buf("o", &out.o)?;
        let (lse, lse_body) = self.upload_buf("lse", &out.lse)?;
        let p = Ptrs {
            o: o_body,
            lse: lse_body,
            ..self.base_ptrs(&inp)
        };
        self.launch(family, Dir::Fwd, &d, &p)?;
        self.sync()?;
        self.download_into("o", &o, &mut out.o)?;
        self.download_into("lse", &lse, &mut out.lse)
    }

    fn bwd(&self, family: Family, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        let f = &args.fwd;
        let d = LaunchDims {
            d_from_o: self.d_from_o && family == Family::Fallback,
            ..dims_of(f.config, f.layout, true)
        };
        if d.b == 0 {
            return Ok(());
        }
        self.rt.make_current()?;
        // O in the input type (the forward stored it rounded to it, so the upload is exact),
        // for the D kernel.
        let extra: &[&ArrayView3<f32>] = if d.d_from_o {
            &[&args.d_o, &args.o]
        } else {
            &[&args.d_o]
        };
        let inp = self.upload_inputs(f, extra)?;
        let lse = match args.lse.as_slice() {
            Some(host) => self.rt.upload("lse", bytes_of(host))?,
            None => {
                let host: Vec<f32> = args.lse.iter().copied().collect();
                self.rt.upload("lse", bytes_of(&host))?
            }
        };
        let (dq, dq_body) = self.upload_buf("dq", &out.dq)?;
        let (dk, dk_body) = self.upload_buf("dk", &out.dk)?;
        let (dv, dv_body) = self.upload_buf("dv", &out.dv)?;
        let (ws, ws_body) = self.upload_buf("workspace", &out.workspace)?;
        let mut p = Ptrs {
            d_o: self.rt.addr(&inp.tensors[3]),
            o: inp.tensors.get(4).map_or(0, |m| self.rt.addr(m)),
            lse: self.rt.addr(&lse),
            dq: dq_body,
            dk: dk_body,
            dv: dv_body,
            ..self.base_ptrs(&inp)
        };
        if family == Family::Fallback {
            // A workspace without the scratch the launch needs is refused as the wrapper
            // refuses one sized under another plan.
            let len = out.workspace.len;
            let at = |name| scratch_addr(f.plan, name, &d, ws_body, len).map_err(Error::Workspace);
            p.delta = at(names::DELTA)?;
            p.rowsum = at(names::ROWSUM)?;
        }
        // A post-scale bias's gradient is written whole (every element of [Bb, Hb, Sq, Sk]).
        let dbias = match (d.bias.grad_rows(), out.dbias.as_ref()) {
            (0, _) => None,
            (rows, Some(buf)) if buf.len as i64 >= rows * d.bias.dims[3] as i64 => {
                let (m, body) = self.upload_buf("dbias", buf)?;
                p.dbias = body;
                Some(m)
            }
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
        self.launch(family, Dir::Bwd, &d, &p)?;
        self.sync()?;
        if let (Some(m), Some(buf)) = (&dbias, out.dbias.as_mut()) {
            self.download_into("dbias", m, buf)?;
        }
        self.download_into("dq", &dq, &mut out.dq)?;
        self.download_into("dk", &dk, &mut out.dk)?;
        self.download_into("dv", &dv, &mut out.dv)?;
        self.download_into("workspace", &ws, &mut out.workspace)
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
        if self.d_from_o {
            Design::ProjectDFromO
        } else {
            Design::Project
        }
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
