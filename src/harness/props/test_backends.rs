//! A stand-in for a device backend's quirks in the properties' tests: the CPU backend with
//! its fallback launches' outputs edited afterwards, and optionally naming fallback forward
//! kernels, as CUDA and HIP do; and the fixtures the properties' tests share (a random case, a
//! judged base run to build a [`CaseContext`] from).

use super::checker::CaseContext;
use super::numeric::numeric;
use super::verdict::Outcome;
use super::yardstick::{oracle_for, Yardstick};
use crate::backend::cpu::CpuBackend;
use crate::backend::{BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use crate::case::{Case, Outputs};
use crate::config::AttnConfig;
use crate::design::Design;
use crate::dispatch::Arch;
use crate::error::Result;
use crate::harness::rng::Rng;
use crate::harness::tolerance::Judgement;
use crate::runner::Pair;
use ndarray::Array3;
use smallseq_reference::{Dtype, Layout};

/// A forward-only bf16 case of `cfg` on `layout`: q, k, v standard normal from `seed`, drawn
/// in that order and rounded to bf16.
pub(super) fn bf16_case(cfg: AttnConfig, layout: Layout, seed: u64) -> Case {
    let p = &cfg.params;
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let mut rng = Rng::new(seed);
    let mut t = |shape: (usize, usize, usize)| {
        Array3::from_shape_simple_fn(shape, || Dtype::Bf16.round(rng.normal() as f32))
    };
    let q = t((tq, p.num_heads, p.head_dim_qk));
    let k = t((tk, p.num_kv_heads, p.head_dim_qk));
    let v = t((tk, p.num_kv_heads, p.head_dim_v));
    Case::new(cfg, layout, q, k, v, None).unwrap()
}

/// A case's base run judged by `numeric_agreement` (envelope design), as a property's test
/// hands it to a relation.
pub(super) struct Judged {
    pub base: Pair,
    pub actual: Outputs,
    pub y: Yardstick,
    pub numeric: Outcome,
    pub judgements: Vec<Judgement>,
}

impl Judged {
    pub fn new(case: &Case, base: Pair) -> Self {
        let actual = base.outputs();
        // The test backends are the CPU backend with hooks: the project's design, as the
        // checker judges them.
        let y = oracle_for(case, Design::Project).unwrap();
        let (numeric, judgements) = numeric(case, &actual, &y);
        Judged {
            base,
            actual,
            y,
            numeric,
            judgements,
        }
    }

    /// The context of `case` (salt 0).
    pub fn cx<'a>(&'a self, case: &'a Case) -> CaseContext<'a> {
        CaseContext {
            case,
            base: &self.base,
            actual: &self.actual,
            y: &self.y,
            judgements: &self.judgements,
            salt: 0,
        }
    }
}

type FwdHook = Box<dyn Fn(&FwdArgs, &mut FwdBufs) + Send + Sync>;
type BwdHook = Box<dyn Fn(&BwdArgs, &mut BwdBufs) + Send + Sync>;

/// The CPU backend, its fallback launches' outputs passed through `after_fwd`/`after_bwd`.
pub(super) struct HookedCpu {
    pub cpu: CpuBackend,
    pub kernel_name: Option<fn(&AttnConfig, &Layout) -> String>,
    /// Whether it declares the CPU's bias (off: the tests of refused biases use it so).
    pub computes_bias: bool,
    pub after_fwd: FwdHook,
    pub after_bwd: BwdHook,
}

impl HookedCpu {
    pub fn new() -> Self {
        HookedCpu {
            cpu: CpuBackend::default(),
            kernel_name: None,
            computes_bias: false,
            after_fwd: Box::new(|_, _| {}),
            after_bwd: Box::new(|_, _| {}),
        }
    }
}

impl BackendInfo for HookedCpu {
    fn name(&self) -> &str {
        "hooked-cpu"
    }
    fn arch(&self) -> Arch {
        self.cpu.arch()
    }
    fn has_small_seq(&self) -> bool {
        true
    }
    fn computes_bias(&self) -> bool {
        self.computes_bias
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        self.kernel_name.map(|f| f(config, layout))
    }
}

impl MutationHooks for HookedCpu {}

impl Compute for HookedCpu {
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.cpu.small_seq_fwd(args, out)
    }
    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.cpu.fallback_fwd(args, out)?;
        (self.after_fwd)(args, out);
        Ok(())
    }
    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.cpu.small_seq_bwd(args, out)
    }
    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.cpu.fallback_bwd(args, out)?;
        (self.after_bwd)(args, out);
        Ok(())
    }
}
