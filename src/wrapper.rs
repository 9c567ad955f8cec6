//! Dispatch wrappers: plan, decide, zero the don't-care outputs, launch, and return the
//! outputs with the path that ran (what TE's `fused_attn_ck_fwd/bwd` do around their kernels,
//! without their defects).

use crate::backend::{Backend, BwdArgs, BwdBufs, DevBuf, FwdArgs, FwdBufs};
use crate::case::Case;
use crate::dispatch::gate::Dispatcher;
use crate::dispatch::{Decision, EnvView, Path, Profile, RuntimeFacts};
use crate::error::{Error, Result};
use crate::segments::{self, Segmented};
use crate::workspace::{self, Direction, Plan, Shape};
use ndarray::{Array2, Array3, Array4};
use serde::Serialize;
use std::borrow::Cow;

/// How to run one case.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub profile: Profile,
    pub env: EnvView,
    /// Run this path instead of the decided one. Forcing small-seq on a case the dispatcher
    /// declines is an error; forcing the fallback is always allowed.
    pub force: Option<Path>,
    /// Initial value of every output element before zeroing and launch (poison for the
    /// determinism property).
    pub fill: f32,
    /// The environment when the workspace was sized (a framework's trace time), when it
    /// differs from `env` (launch time). `None`: the same snapshot.
    pub trace_env: Option<EnvView>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            profile: Profile::Native,
            env: EnvView::from_process(),
            force: None,
            fill: 0.0,
            trace_env: None,
        }
    }
}

/// What the workspace looked like after a launch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct WorkspaceReport {
    /// Elements (f32) the plan reserved.
    pub planned: usize,
    /// One past the last element the kernel wrote (sentinel scan).
    pub used: usize,
    /// The trace-time bound.
    pub bound: usize,
    /// Buffers whose guard bands were overwritten, with the first offending index.
    pub corrupted: Vec<String>,
}

/// Forward outputs.
#[derive(Clone, Debug)]
pub struct FwdResult {
    pub o: Array3<f32>,
    pub lse: Array2<f32>,
    /// The path that ran; `None` when no kernel ran (empty batch).
    pub path: Option<Path>,
    pub workspace: WorkspaceReport,
}

/// Backward outputs.
#[derive(Clone, Debug)]
pub struct BwdResult {
    pub dq: Array3<f32>,
    pub dk: Array3<f32>,
    pub dv: Array3<f32>,
    /// dBias `[Bb, Hb, Sq, Sk]` of a case with a post-scale bias, where the run returns one.
    pub dbias: Option<Array4<f32>>,
    pub path: Option<Path>,
    pub workspace: WorkspaceReport,
}

/// The dispatcher a backend gets under these options.
pub fn dispatcher(backend: &dyn Backend, opts: &RunOptions) -> Dispatcher {
    Dispatcher {
        profile: opts.profile,
        arch: backend.arch(),
        env: opts.env.clone(),
        backend_has_kernel: backend.has_small_seq(),
        defects: backend.gate_defects(),
    }
}

/// The decision for a case (static part at plan time, runtime part from the layout).
pub fn decide(backend: &dyn Backend, case: &Case, opts: &RunOptions) -> Decision {
    let d = dispatcher(backend, opts);
    let plan = d.plan(&case.config);
    d.decide(&plan, &RuntimeFacts::new(case.config.layout, &case.layout))
}

fn shape(case: &Case) -> Shape {
    let p = &case.config.params;
    let l = &case.layout;
    Shape {
        tq: l.q.tokens,
        tk: l.kv.tokens,
        tq_addressed: *l.q.offsets().last().expect("validated layout") as usize,
        heads: p.num_heads,
        kv_heads: p.num_kv_heads,
        head_dim_qk: p.head_dim_qk,
        head_dim_v: p.head_dim_v,
        thd: case.config.layout == crate::config::LayoutKind::Thd,
    }
}

/// Sentinel for unused workspace: a NaN payload distinct from the guard pattern.
const WS_SENTINEL: u32 = 0x7fc0_ab1e;

/// The path a decision leads to under the options (forcing, empty batches).
fn chosen_path(
    backend: &dyn Backend,
    decision: &Decision,
    opts: &RunOptions,
) -> Result<Option<Path>> {
    let path = match opts.force {
        Some(Path::SmallSeq) if decision.path != Path::SmallSeq => {
            return Err(Error::Unsupported(format!(
                "small-seq forced on a case the dispatcher declines: {}",
                decision
                    .codes()
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
        Some(p) => Some(p),
        None => Some(decision.path),
    };
    if decision.is_empty_batch() {
        return Ok(backend
            .gate_defects()
            .launch_on_empty
            .then_some(Path::SmallSeq));
    }
    Ok(path)
}

/// Chooses the path to run and plans the workspace.
fn prepare(
    backend: &dyn Backend,
    case: &Case,
    opts: &RunOptions,
    dir: Direction,
) -> Result<(Option<Path>, Plan, DevBuf)> {
    case.validate()?;
    let decision = decide(backend, case, opts);
    let computes = (backend.computes_dropout(), backend.computes_bias());
    if let Some(why) = case.config.unsupported_reason(computes) {
        return Err(Error::Unsupported(why));
    }
    let path = chosen_path(backend, &decision, opts)?;
    let plan = workspace::plan(dir, path, &shape(case));
    // The size a framework allocated at trace time, from the environment it saw then.
    let sized = match &opts.trace_env {
        None => plan.total,
        Some(env) => {
            let traced = RunOptions {
                env: env.clone(),
                ..opts.clone()
            };
            let sizing_path = chosen_path(backend, &decide(backend, case, &traced), &traced)?;
            let sizing = workspace::plan(dir, sizing_path, &shape(case));
            if sizing != plan && !backend.gate_defects().carve_unsized {
                return Err(Error::Workspace(format!(
                    "the dispatch environment changed between sizing and launch: the workspace \
                     was sized for {} ({} elements), the launch takes {} ({} elements); \
                     re-plan after changing {}",
                    path_name(sizing_path),
                    sizing.total,
                    path_name(path),
                    plan.total,
                    crate::dispatch::facts::ENV_KEYS.join(" or ")
                )));
            }
            sizing.total
        }
    };
    // A defective wrapper carves `plan` out of `sized` elements: the overrun lands in the
    // trailing guard, where the workspace property sees it.
    let mut ws = DevBuf::with_tail_guard(
        sized,
        f32::from_bits(WS_SENTINEL),
        plan.total.saturating_sub(sized) + crate::backend::GUARD,
    );
    if let Some(r) = plan.region(workspace::names::PROBE) {
        // The runtime probe: max actual lengths, written where a device probe would put them.
        ws.put(r.offset, case.layout.q.max_len() as f32);
        ws.put(r.offset + 1, case.layout.kv.max_len() as f32);
    }
    Ok((path, plan, ws))
}

fn path_name(p: Option<Path>) -> &'static str {
    p.map_or("no launch", |p| p.name())
}

fn report(plan: &Plan, bound: usize, bufs: &[(&str, &DevBuf)]) -> WorkspaceReport {
    let ws = bufs
        .iter()
        .find(|(n, _)| *n == "workspace")
        .map(|(_, b)| *b);
    let used = ws
        .map(|w| {
            w.body()
                .iter()
                .rposition(|x| x.to_bits() != WS_SENTINEL)
                .map_or(0, |i| i + 1)
        })
        .unwrap_or(0);
    WorkspaceReport {
        planned: plan.total,
        used,
        bound,
        corrupted: bufs
            .iter()
            .filter_map(|(n, b)| {
                let bad = b.corrupted_guards();
                (!bad.is_empty()).then(|| format!("{n}[{}]", bad[0]))
            })
            .collect(),
    }
}

/// Output buffer for a `[T, H, D]` tensor: `fill` everywhere, then 0 on don't-care rows.
fn out_buf(valid: &[bool], row: usize, fill: f32, zero: f32, zero_dont_care: bool) -> DevBuf {
    let mut b = DevBuf::new(valid.len() * row, fill);
    if zero_dont_care {
        for (t, _) in valid.iter().enumerate().filter(|(_, v)| !**v) {
            b.body_mut()[t * row..(t + 1) * row].fill(zero);
        }
    }
    b
}

fn fwd_args<'a>(case: &'a Case, plan: &'a Plan) -> FwdArgs<'a> {
    FwdArgs {
        config: &case.config,
        layout: &case.layout,
        q: case.q.view(),
        k: case.k.view(),
        v: case.v.view(),
        plan,
    }
}

fn to3(buf: &DevBuf, shape: [usize; 3]) -> Array3<f32> {
    Array3::from_shape_vec(shape, buf.body().to_vec()).expect("buffer sized from shape")
}

/// The case as its launch sees it. A case that carries JAX-style segment ids
/// ([`segments::META_KEY`]) describing its layout is launched on the offsets converted from
/// those ids, as TE's JAX path converts them, while the judges keep the case's own layout:
/// a conversion bug then shows as outputs in the wrong rows. Stale ids (the layout changed
/// since they were drawn) are left out, so the launch takes the case's layout.
///
/// # Errors
/// Malformed segment metadata, or ids the conversion leaves without a valid layout.
pub fn launched<'a>(backend: &dyn Backend, case: &'a Case) -> Result<Cow<'a, Case>> {
    let Some(text) = case.meta.get(segments::META_KEY) else {
        return Ok(Cow::Borrowed(case));
    };
    let ids = Segmented::from_meta(text)?;
    if !ids.describes(&case.layout) {
        return Ok(Cow::Borrowed(case));
    }
    let mut launch = case.clone();
    launch.layout = ids.launch_layout(&backend.segment_defects())?;
    Ok(Cow::Owned(launch))
}

/// Forward: plan, decide, zero don't-care outputs, launch.
///
/// # Errors
/// Invalid cases, unsupported configs (dropout, bias), forced paths the gate declines, and
/// backend failures.
pub fn fwd(backend: &dyn Backend, case: &Case, opts: &RunOptions) -> Result<FwdResult> {
    let case = &*launched(backend, case)?;
    let (path, plan, workspace) = prepare(backend, case, opts, Direction::Fwd)?;
    let p = &case.config.params;
    let (tq, h, dv) = (case.layout.q.tokens, p.num_heads, p.head_dim_v);
    let valid = case.layout.q.valid_tokens();
    let zero = backend.zeroes_dont_care();
    let mut bufs = FwdBufs {
        o: out_buf(&valid, h * dv, opts.fill, 0.0, zero),
        lse: out_buf(&valid, h, opts.fill, f32::NEG_INFINITY, zero),
        workspace,
    };
    let args = fwd_args(case, &plan);
    match path {
        Some(Path::SmallSeq) => backend.small_seq_fwd(&args, &mut bufs)?,
        Some(Path::Fallback) => backend.fallback_fwd(&args, &mut bufs)?,
        None => {
            // No kernel runs: every output is set here, per `docs/semantics.md` §1.6.
            bufs.o.body_mut().fill(0.0);
            bufs.lse.body_mut().fill(f32::NEG_INFINITY);
        }
    }
    let bound = workspace::trace_time_bound(Direction::Fwd, &shape(case));
    let workspace = report(
        &plan,
        bound,
        &[
            ("o", &bufs.o),
            ("lse", &bufs.lse),
            ("workspace", &bufs.workspace),
        ],
    );
    Ok(FwdResult {
        o: to3(&bufs.o, [tq, h, dv]),
        lse: Array2::from_shape_vec([tq, h], bufs.lse.body().to_vec()).expect("sized"),
        path,
        workspace,
    })
}

/// Backward from a forward's `o` and `lse` (token-major `[Tq, H]`, natural log), which may
/// come from either path.
///
/// # Errors
/// As [`fwd`], and [`Error::Config`] when the case has no `d_o`.
pub fn bwd(
    backend: &dyn Backend,
    case: &Case,
    o: &Array3<f32>,
    lse: &Array2<f32>,
    opts: &RunOptions,
) -> Result<BwdResult> {
    let case = &*launched(backend, case)?;
    let d_o = case
        .d_o
        .as_ref()
        .ok_or_else(|| Error::config("backward needs d_o in the case"))?;
    let (path, plan, workspace) = prepare(backend, case, opts, Direction::Bwd)?;
    let p = &case.config.params;
    let (tq, tk) = (case.layout.q.tokens, case.layout.kv.tokens);
    let (h, hkv, dqk, dv) = (p.num_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_v);
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let zero = backend.zeroes_dont_care();
    let mut bufs = BwdBufs {
        dq: out_buf(&vq, h * dqk, opts.fill, 0.0, zero),
        dk: out_buf(&vk, hkv * dqk, opts.fill, 0.0, zero),
        dv: out_buf(&vk, hkv * dv, opts.fill, 0.0, zero),
        workspace,
        dbias: p.bias.grad_shape().map(|s| {
            let fill = if zero { 0.0 } else { opts.fill };
            DevBuf::new(s.iter().product(), fill)
        }),
    };
    let args = BwdArgs {
        fwd: fwd_args(case, &plan),
        o: o.view(),
        lse: lse.view(),
        d_o: d_o.view(),
    };
    match path {
        Some(Path::SmallSeq) => backend.small_seq_bwd(&args, &mut bufs)?,
        Some(Path::Fallback) => backend.fallback_bwd(&args, &mut bufs)?,
        None => {
            for b in [&mut bufs.dq, &mut bufs.dk, &mut bufs.dv]
                .into_iter()
                .chain(bufs.dbias.as_mut())
            {
                b.body_mut().fill(0.0);
            }
        }
    }
    let bound = workspace::trace_time_bound(Direction::Bwd, &shape(case));
    let workspace = report(
        &plan,
        bound,
        &[
            ("dq", &bufs.dq),
            ("dk", &bufs.dk),
            ("dv", &bufs.dv),
            ("workspace", &bufs.workspace),
        ],
    );
    let dbias = match (&bufs.dbias, p.bias.grad_shape()) {
        (Some(b), Some(s)) => {
            Some(Array4::from_shape_vec(s, b.body().to_vec()).expect("buffer sized from shape"))
        }
        _ => None,
    };
    Ok(BwdResult {
        dbias,
        dq: to3(&bufs.dq, [tq, h, dqk]),
        dk: to3(&bufs.dk, [tk, hkv, dqk]),
        dv: to3(&bufs.dv, [tk, hkv, dv]),
        path,
        workspace,
    })
}
