//! The shared GPU backend against a runtime that keeps "device" memory on the host and
//! records every call: what a call uploads, launches, synchronises and downloads, and how each
//! failure is judged, with no GPU.

use super::*;
use crate::backend::kernel_args::Kernel;
use crate::backend::{Backend, DevBuf, GUARD};
use crate::workspace::{plan, Direction, Plan, Shape};
use ndarray::{Array2, Array3};
use smallseq_reference::Mask;
use std::sync::Mutex;

/// A call the fake runtime saw.
#[derive(Clone, Debug, PartialEq)]
enum Call {
    Current,
    Upload(String, usize),
    Lookup(String),
    Launch(String, Grid, Vec<String>),
    Sync,
    Download(String),
}

/// "Device" memory on the host: each allocation at its own 256-byte aligned address (the low
/// 24 bits of an address are the offset inside it).
struct Fake {
    calls: Mutex<Vec<Call>>,
    mem: Mutex<Vec<Vec<u8>>>,
    /// An upload whose address is moved by 8 bytes (a misaligned tensor).
    misalign: Option<&'static str>,
    /// A call that fails as the runtime's own error, by its `Call` kind.
    fail_sync: bool,
    /// Each launch's pointer arguments, in order.
    ptrs: Mutex<Vec<Vec<u64>>>,
    /// The kernels' defines ([`DeviceApi::defines`]).
    defines: Vec<String>,
}

const BASE: u64 = 1 << 32;

impl Fake {
    fn new() -> Self {
        Fake {
            calls: Mutex::new(Vec::new()),
            mem: Mutex::new(Vec::new()),
            misalign: None,
            fail_sync: false,
            ptrs: Mutex::new(Vec::new()),
            defines: Vec::new(),
        }
    }

    /// `n` bytes of "device" memory at `addr`.
    fn bytes_at(&self, addr: u64, n: usize) -> Vec<u8> {
        let mem = self.mem.lock().unwrap();
        let (i, at) = (((addr - BASE) >> 24) as usize, (addr & 0xff_ffff) as usize);
        mem[i][at..at + n].to_vec()
    }

    /// The pointer arguments of launch `i`.
    fn launch_ptrs(&self, i: usize) -> Vec<u64> {
        self.ptrs.lock().unwrap()[i].clone()
    }

    fn log(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

/// An allocation: its index and the address offset it was given.
struct FakeMem(usize, u64);

impl DeviceApi for Fake {
    const NAME: &'static str = "fake";
    const GPU: Gpu = Gpu::Hip;
    const THREADS_PER_ITEM: u32 = 64;
    type Mem = FakeMem;
    type Func = String;

    fn arch(&self) -> Arch {
        "gfx942".parse().unwrap()
    }

    fn has_small_seq(&self) -> bool {
        true
    }

    fn provenance(&self) -> BTreeMap<String, String> {
        BTreeMap::from([("device".to_string(), "fake".to_string())])
    }

    fn defines(&self) -> Vec<String> {
        self.defines.clone()
    }

    fn make_current(&self) -> Result<()> {
        self.log(Call::Current);
        Ok(())
    }

    fn upload(&self, what: &str, bytes: &[u8]) -> Result<FakeMem> {
        self.log(Call::Upload(what.into(), bytes.len()));
        let mut mem = self.mem.lock().unwrap();
        mem.push(bytes.to_vec());
        let shift = if self.misalign == Some(what) { 8 } else { 0 };
        Ok(FakeMem(mem.len() - 1, shift))
    }

    fn download(&self, what: &str, m: &FakeMem, host: &mut [u8]) -> Result<()> {
        self.log(Call::Download(what.into()));
        let mem = self.mem.lock().unwrap();
        let n = host.len().min(mem[m.0].len());
        host[..n].copy_from_slice(&mem[m.0][..n]);
        Ok(())
    }

    fn addr(&self, m: &FakeMem) -> u64 {
        BASE + ((m.0 as u64) << 24) + m.1
    }

    fn load_modules(&self) -> Result<()> {
        Ok(())
    }

    fn function(&self, family: Family, name: &str) -> Result<String> {
        self.log(Call::Lookup(name.into()));
        Ok(format!("{}:{name}", family.stem()))
    }

    unsafe fn launch(&self, f: &String, name: &str, grid: Grid, args: &[Arg]) -> Result<()> {
        assert_eq!(f.split(':').nth(1), Some(name));
        let codes = args.iter().map(|a| a.code().to_string()).collect();
        self.log(Call::Launch(name.into(), grid, codes));
        let ptrs = args.iter().filter_map(|a| match a {
            Arg::Ptr(p) => Some(*p),
            _ => None,
        });
        self.ptrs.lock().unwrap().push(ptrs.collect());
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.log(Call::Sync);
        if self.fail_sync {
            return Err(Error::Device {
                backend: "fake".into(),
                detail: "synchronize failed: illegal address".into(),
            });
        }
        Ok(())
    }
}

struct Case {
    config: AttnConfig,
    layout: Layout,
    q: Array3<f32>,
    k: Array3<f32>,
    v: Array3<f32>,
}

fn case(dtype: Dtype, d: usize, lens: &[(usize, usize)]) -> Case {
    let config = AttnConfig::new(dtype, 2, d, Mask::NoMask);
    let layout = Layout::packed(lens);
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    Case {
        config,
        q: Array3::from_elem((tq, 2, d), 0.5),
        k: Array3::from_elem((tk, 2, d), 0.25),
        v: Array3::from_elem((tk, 2, d), 1.0),
        layout,
    }
}

fn shape(c: &Case) -> Shape {
    let p = &c.config.params;
    Shape {
        tq: c.layout.q.tokens,
        tk: c.layout.kv.tokens,
        tq_addressed: c.layout.q.tokens,
        heads: p.num_heads,
        kv_heads: p.num_kv_heads,
        head_dim_qk: p.head_dim_qk,
        head_dim_v: p.head_dim_v,
        thd: false,
    }
}

fn fwd_bufs(c: &Case, ws: usize) -> FwdBufs {
    let (tq, h, d) = c.q.dim();
    FwdBufs {
        o: DevBuf::new(tq * h * d, f32::NAN),
        lse: DevBuf::new(tq * h, f32::NAN),
        workspace: DevBuf::new(ws, f32::NAN),
    }
}

/// The backward's guarded outputs for `c`, NaN-poisoned, with a workspace of `ws` elements.
fn bwd_bufs(c: &Case, ws: usize, dbias: Option<DevBuf>) -> BwdBufs {
    let (tq, h, d) = c.q.dim();
    let (tk, hk, dv) = c.v.dim();
    BwdBufs {
        dq: DevBuf::new(tq * h * d, f32::NAN),
        dk: DevBuf::new(tk * hk * d, f32::NAN),
        dv: DevBuf::new(tk * hk * dv, f32::NAN),
        workspace: DevBuf::new(ws, f32::NAN),
        dbias,
    }
}

fn uploads(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Upload(w, _) => Some(w.clone()),
            _ => None,
        })
        .collect()
}

/// The small-seq forward's plan for `c`.
fn small_seq_fwd_plan(c: &Case) -> Plan {
    plan(
        Direction::Fwd,
        Some(crate::dispatch::Path::SmallSeq),
        &shape(c),
    )
}

/// A forward's arguments: `c`'s inputs under `p`.
fn fwd_args<'a>(c: &'a Case, p: &'a Plan) -> FwdArgs<'a> {
    FwdArgs {
        config: &c.config,
        layout: &c.layout,
        q: c.q.view(),
        k: c.k.view(),
        v: c.v.view(),
        plan: p,
    }
}

#[test]
fn a_forward_uploads_launches_synchronises_once_then_downloads() {
    let be = GpuBackend::from_runtime(Fake::new()).unwrap();
    let c = case(Dtype::Bf16, 64, &[(3, 5), (17, 17)]);
    let p = small_seq_fwd_plan(&c);
    let args = fwd_args(&c, &p);
    let mut out = fwd_bufs(&c, p.total);
    // The fake's memory holds what was uploaded: the guarded buffers come back unchanged.
    let before = out.o.data.clone();
    be.small_seq_fwd(&args, &mut out).unwrap();
    assert!(out
        .o
        .data
        .iter()
        .zip(&before)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let calls = be.runtime().calls();
    assert_eq!(calls[0], Call::Current);
    // One allocation, one copy each way: the outputs first (downloaded as one prefix), then
    // the inputs, each where a launch pointer says it is.
    assert_eq!(uploads(&calls), ["the call's buffers"]);
    let ptrs = be.runtime().launch_ptrs(0);
    let (q, k, o, lse) = (ptrs[0], ptrs[1], ptrs[3], ptrs[4]);
    // q in bf16: 2 bytes an element.
    let want_q = to_host(Dtype::Bf16, &c.q.view());
    assert_eq!(be.runtime().bytes_at(q, 20 * 2 * 64 * 2), want_q.bytes());
    assert_eq!(
        be.runtime().bytes_at(k, 4),
        to_host(Dtype::Bf16, &c.k.view()).bytes()[..4]
    );
    assert!(o < lse && lse < q && k > q, "outputs first, then q, k");
    for p in &ptrs {
        assert_eq!(p % 16, 0, "every tensor on a 16-byte boundary");
    }
    let tail: Vec<&Call> = calls.iter().skip(2).collect();
    let grid = Grid {
        blocks: 1,
        threads: 256,
        smem: 0,
    };
    let codes = "PPPPPPPPP4444".chars().map(String::from).collect();
    assert_eq!(
        tail,
        [
            &Call::Lookup("small_seq_fwd_bf16_d64_o32".into()),
            &Call::Launch("small_seq_fwd_bf16_d64_o32".into(), grid, codes),
            &Call::Sync,
            &Call::Download("the call's outputs".into()),
        ]
    );
    // A second call finds the kernel without looking it up again.
    be.small_seq_fwd(&args, &mut out).unwrap();
    let lookups = be.runtime().calls();
    let lookups = lookups.iter().filter(|c| matches!(c, Call::Lookup(_)));
    assert_eq!(lookups.count(), 1);
    assert_eq!(be.name(), "fake");
    assert_eq!(be.provenance()["device"], "fake");
    assert_eq!(be.rounding_budget("o"), None);
}

/// A batch of one query per slot (or none) runs the `_q1` kernel, found by its own name; one
/// slot of two queries sends the same head dim back to the general kernel.
#[test]
fn one_query_batches_launch_the_q1_kernel() {
    let launched = |lens: &[(usize, usize)]| {
        let be = GpuBackend::from_runtime(Fake::new()).unwrap();
        let c = case(Dtype::F16, 128, lens);
        let p = small_seq_fwd_plan(&c);
        be.small_seq_fwd(&fwd_args(&c, &p), &mut fwd_bufs(&c, p.total))
            .unwrap();
        let calls = be.runtime().calls();
        let names: Vec<String> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Launch(n, ..) => Some(n.clone()),
                _ => None,
            })
            .collect();
        names
    };
    assert_eq!(
        launched(&[(1, 5), (0, 3), (1, 17)]),
        ["small_seq_fwd_f16_d128_o32_q1"]
    );
    assert_eq!(launched(&[(1, 5), (2, 3)]), ["small_seq_fwd_f16_d128_o32"]);
}

#[test]
fn the_launch_policy_of_each_runtime_sets_the_block_size() {
    let c = case(Dtype::F16, 128, &[(40, 40)]);
    let d = dims_of(&c.config, &c.layout, true);
    let be = GpuBackend::from_runtime(Fake::new()).unwrap();
    be.launch_fallback_fwd(&d, &Ptrs::default()).unwrap();
    match &be.runtime().calls()[1] {
        // The tiled forward on HIP's dims: 64 threads a work item, 4 items a block.
        Call::Launch(name, grid, _) => {
            assert_eq!(name, "fallback_fwd_tc_f16_o32_d128");
            assert_eq!(grid.threads, 256);
            assert_eq!(grid.smem, d.tiled_fwd_smem());
            assert_eq!(grid.blocks, 2);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        be.fallback_fwd_kernel(&c.config, &c.layout).as_deref(),
        Some("fallback_fwd_tc_f16_d128")
    );
}

#[test]
fn failures_are_judged_alike_on_every_runtime() {
    let be = GpuBackend::from_runtime(Fake::new()).unwrap();
    let c = case(Dtype::F32, 64, &[(2, 2)]);
    let d = dims_of(&c.config, &c.layout, true);
    // A dtype the small-seq kernels do not take: Unsupported, named by the backend.
    match be.launch_small_seq_fwd(&d, &Ptrs::default()) {
        Err(Error::Unsupported(m)) => assert!(m.starts_with("fake small-seq kernels"), "{m}"),
        other => panic!("{other:?}"),
    }
    // A grid too large: the backend's own error.
    let huge = LaunchDims {
        dtype: Dtype::Bf16,
        b: i32::MAX,
        heads: 8,
        kv_heads: 8,
        ..d
    };
    match be.launch_small_seq_fwd(&huge, &Ptrs::default()) {
        Err(e @ Error::Backend { .. }) => {
            assert!(
                e.to_string().contains("work items exceed the 1-D grid"),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    // A misaligned tensor of a vector kernel: Misaligned, before any lookup or launch.
    let misaligned = Ptrs {
        q: 8,
        ..Ptrs::default()
    };
    let small = LaunchDims {
        dtype: Dtype::Bf16,
        ..d
    };
    match be.launch_small_seq_fwd(&small, &misaligned) {
        Err(Error::Misaligned(m)) => {
            assert_eq!((m.kernel, m.tensor, m.addr), ("SmallSeqFwd", "q", 8))
        }
        other => panic!("{other:?}"),
    }
    assert!(be.runtime().calls().is_empty());
    // The runtime's error passes through as it made it.
    let failing = GpuBackend::from_runtime(Fake {
        fail_sync: true,
        ..Fake::new()
    })
    .unwrap();
    let c = case(Dtype::Bf16, 64, &[(2, 2)]);
    let p = small_seq_fwd_plan(&c);
    let args = fwd_args(&c, &p);
    let mut out = fwd_bufs(&c, p.total);
    assert!(matches!(
        failing.small_seq_fwd(&args, &mut out),
        Err(Error::Device { .. })
    ));
    // Nothing is downloaded after a failed synchronisation.
    let calls = failing.runtime().calls();
    assert!(!calls.iter().any(|c| matches!(c, Call::Download(_))));
}

#[test]
fn the_fallback_backward_carves_its_scratch_or_refuses_the_workspace() {
    let c = case(Dtype::Bf16, 64, &[(5, 7), (3, 2)]);
    let (tq, h, _) = c.q.dim();
    let lse = Array2::<f32>::zeros((tq, h));
    let run = |p: &Plan| {
        let be = GpuBackend::from_runtime(Fake::new()).unwrap();
        let args = BwdArgs {
            fwd: fwd_args(&c, p),
            o: c.q.view(),
            lse: lse.view(),
            d_o: c.q.view(),
        };
        let mut out = bwd_bufs(&c, p.total, None);
        let r = be.fallback_bwd(&args, &mut out);
        (r, be.runtime().calls())
    };
    let full = plan(
        Direction::Bwd,
        Some(crate::dispatch::Path::Fallback),
        &shape(&c),
    );
    let (r, calls) = run(&full);
    r.unwrap();
    assert_eq!(uploads(&calls), ["the call's buffers"]);
    let after: Vec<String> = calls
        .iter()
        .skip_while(|c| matches!(c, Call::Current | Call::Upload(..)))
        .map(|c| match c {
            Call::Lookup(n) => format!("lookup {n}"),
            Call::Launch(n, g, _) => format!("launch {n} {}", g.blocks),
            Call::Sync => "sync".into(),
            Call::Download(w) => format!("download {w}"),
            other => format!("{other:?}"),
        })
        .collect();
    // The scalar kernels on HIP's dims: one work item per query token and head, then per key
    // token and kv head; one synchronisation, then every buffer whole.
    assert_eq!(
        after,
        [
            "lookup fallback_bwd_q_bf16_o32",
            "launch fallback_bwd_q_bf16_o32 4",
            "lookup fallback_bwd_kv_bf16_o32",
            "launch fallback_bwd_kv_bf16_o32 5",
            "sync",
            "download the call's outputs",
        ]
    );
    // A plan without the scratch, or a workspace too small for it: refused as a workspace,
    // before any launch (CUDA called this a backend error, HIP a workspace one).
    let mut no_rowsum = full.clone();
    no_rowsum.regions.retain(|r| r.name != names::ROWSUM);
    let mut short = full.clone();
    short.total -= 1;
    for (p, why) in [(&no_rowsum, "no rowsum region"), (&short, "region holds")] {
        let (r, calls) = run(p);
        match r {
            Err(Error::Workspace(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(!calls.iter().any(|c| matches!(c, Call::Launch(..))));
    }
    // Small-seq carves nothing.
    let small = plan(
        Direction::Bwd,
        Some(crate::dispatch::Path::SmallSeq),
        &shape(&c),
    );
    let be = GpuBackend::from_runtime(Fake {
        misalign: Some("the call's buffers"),
        ..Fake::new()
    })
    .unwrap();
    let args = BwdArgs {
        fwd: fwd_args(&c, &small),
        o: c.q.view(),
        lse: lse.view(),
        d_o: c.q.view(),
    };
    let mut out = bwd_bufs(&c, small.total, None);
    // The body of each guarded buffer starts GUARD elements in: 256 bytes, still aligned; a
    // buffer that is not is refused by the vector kernels.
    assert_eq!(GUARD * 4 % 16, 0);
    match be.small_seq_bwd(&args, &mut out) {
        Err(Error::Misaligned(m)) => assert_eq!((m.kernel, m.tensor), ("SmallSeqBwd", "q")),
        other => panic!("{other:?}"),
    }
    let _: &dyn Backend = &be;
    let _ = Kernel::SmallSeqBwd;
}

/// A post-scale bias: the backward uploads the tensor and dBias, launches the dBias kernel
/// after the scalar kernels with both addresses, and downloads dBias; without a dBias buffer
/// of the tensor's size it refuses before any launch. The backend says it computes both.
#[test]
fn a_post_scale_bias_uploads_its_tensor_and_downloads_dbias() {
    use ndarray::Array4;
    use smallseq_reference::AttnBias;
    let mut c = case(Dtype::Bf16, 64, &[(5, 7), (3, 2)]);
    c.config.params.bias = AttnBias::PostScale(std::sync::Arc::new(Array4::zeros((1, 2, 5, 7))));
    let (tq, h, _) = c.q.dim();
    let lse = Array2::<f32>::zeros((tq, h));
    let full = plan(
        Direction::Bwd,
        Some(crate::dispatch::Path::Fallback),
        &shape(&c),
    );
    let run = |dbias: Option<DevBuf>| {
        let be = GpuBackend::from_runtime(Fake::new()).unwrap();
        assert!(be.computes_bias() && be.computes_dropout());
        let args = BwdArgs {
            fwd: fwd_args(&c, &full),
            o: c.q.view(),
            lse: lse.view(),
            d_o: c.q.view(),
        };
        let mut out = bwd_bufs(&c, full.total, dbias);
        let r = be.fallback_bwd(&args, &mut out);
        (r, be)
    };
    let (r, be) = run(Some(DevBuf::new(2 * 5 * 7, f32::NAN)));
    r.unwrap();
    let calls = be.runtime().calls();
    assert_eq!(uploads(&calls), ["the call's buffers"]);
    let launches: Vec<(&str, &Vec<String>)> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Launch(n, _, a) => Some((n.as_str(), a)),
            _ => None,
        })
        .collect();
    let names: Vec<&str> = launches.iter().map(|l| l.0).collect();
    assert_eq!(
        names,
        [
            "fallback_bwd_q_bf16_o32",
            "fallback_bwd_kv_bf16_o32",
            "fallback_dbias_bf16_o32"
        ]
    );
    // The dBias kernel's pointers: the bias where it was packed (its zeros) and dBias inside
    // the outputs' prefix, as uploaded (NaN poison), which comes back in one download.
    let ptrs = be.runtime().launch_ptrs(2);
    let rt = be.runtime();
    let bias = ptrs
        .iter()
        .filter(|&&p| p != 0 && rt.bytes_at(p, 4) == 0f32.to_ne_bytes());
    assert!(bias.count() >= 1, "no pointer at the bias's zeros");
    let nan = ptrs
        .iter()
        .filter(|&&p| p != 0 && f32::from_ne_bytes(rt.bytes_at(p, 4).try_into().unwrap()).is_nan());
    assert!(nan.count() >= 1, "no pointer at dBias's poison");
    assert!(calls.contains(&Call::Download("the call's outputs".into())));
    for (short, why) in [(None, "got 0"), (Some(DevBuf::new(69, 0.0)), "got 69")] {
        let (r, be) = run(short);
        let calls = be.runtime().calls();
        match r {
            Err(Error::Tensor { tensor, detail }) => {
                assert_eq!(tensor, "dbias");
                assert!(
                    detail.contains("[1, 2, 5, 7]") && detail.contains(why),
                    "{detail}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(!calls.iter().any(|c| matches!(c, Call::Launch(..))));
    }
}

/// `FTB_D_FROM_O` decides whether the backward takes O and which design it declares; a value
/// the kernels do not know is refused when the backend opens, naming it.
#[test]
fn the_form_of_d_follows_the_defines() {
    let with = |d: &str| {
        GpuBackend::from_runtime(Fake {
            defines: vec![d.to_string()],
            ..Fake::new()
        })
    };
    let corrected = with("FTB_D_FROM_O=2").unwrap();
    assert!(corrected.d_from_o());
    assert_eq!(corrected.design(), Design::Project);
    let stored = with("FTB_D_FROM_O=1").unwrap();
    assert!(stored.d_from_o());
    assert_eq!(stored.design(), Design::ProjectDFromO);
    assert!(!with("FTB_D_FROM_O=0").unwrap().d_from_o());
    let e = with("FTB_D_FROM_O=x")
        .err()
        .expect("an unknown form is refused");
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().contains("FTB_D_FROM_O=x"), "{e}");
}
