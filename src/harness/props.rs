//! The properties, each named, each returning pass, fail (with the worst element) or skip
//! (with a reason).

use super::conditioning::{allowances, GradAllowance, OrderAllowance};
use super::conformance::{self, CONFORMANCE_TENSORS};
use super::gen::{dont_care_rows, poison};
use super::oracles;
use super::rng::Rng;
use super::subnormal;
use super::tolerance::{judge_all, score_magnitude, Judgement, Worst};
use super::transform::{repeat_kv, select_slots};
use crate::backend::Backend;
use crate::case::{Case, Outputs};
use crate::dispatch::{EnvView, Path, Profile};
use crate::error::{Error, Result};
use crate::runner::{Fault, FaultKind, FaultLatch, InProcess, Runner};
use crate::wrapper::{self, BwdResult, FwdResult, RunOptions};
use serde::Serialize;
use smallseq_reference::{emulate, forward_backward, Dtype};
use std::collections::BTreeMap;
use std::fmt;

/// The named properties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prop {
    Eligibility,
    FallbackEquivalence,
    NumericAgreement,
    DontCare,
    Workspace,
    Determinism,
    Metamorphic,
    EmulationConformance,
    /// Issue 18: deviations from the emulation symmetric in sign (`super::bias`).
    RoundingBias,
    /// The worker process exited, was killed, broke the protocol or lost its device.
    Crash,
    /// The worker process did not answer within the case timeout.
    Hang,
}

impl Prop {
    pub const ALL: [Prop; 11] = [
        Prop::Eligibility,
        Prop::FallbackEquivalence,
        Prop::NumericAgreement,
        Prop::DontCare,
        Prop::Workspace,
        Prop::Determinism,
        Prop::Metamorphic,
        Prop::EmulationConformance,
        Prop::RoundingBias,
        Prop::Crash,
        Prop::Hang,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Prop::Eligibility => "eligibility",
            Prop::FallbackEquivalence => "fallback_equivalence",
            Prop::NumericAgreement => "numeric_agreement",
            Prop::DontCare => "dont_care",
            Prop::Workspace => "workspace",
            Prop::Determinism => "determinism",
            Prop::Metamorphic => "metamorphic",
            Prop::EmulationConformance => "emulation_conformance",
            Prop::RoundingBias => "rounding_bias",
            Prop::Crash => "crash",
            Prop::Hang => "hang",
        }
    }
}

impl fmt::Display for Prop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed property.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    pub prop: Prop,
    pub detail: String,
    pub worst: Option<Worst>,
    /// err / threshold for numeric failures; infinite for exact properties.
    pub margin: f64,
}

/// The outcome of one property on one case.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail(Failure),
    Skip { reason: String },
}

fn fail(prop: Prop, detail: impl Into<String>) -> Outcome {
    Outcome::Fail(Failure {
        prop,
        detail: detail.into(),
        worst: None,
        margin: f64::INFINITY,
    })
}

fn skip(reason: impl Into<String>) -> Outcome {
    Outcome::Skip {
        reason: reason.into(),
    }
}

/// Everything learnt from one case.
#[derive(Clone, Debug)]
pub struct CaseRun {
    pub outcomes: Vec<(Prop, Outcome)>,
    pub judgements: Vec<Judgement>,
    /// The backend's outputs from the main run.
    pub outputs: Outputs,
    pub path_fwd: Option<Path>,
    pub path_bwd: Option<Path>,
    /// The worker fault that ended the case, with the worker's stderr tail.
    pub fault: Option<Fault>,
    /// The numeric regimes the case reaches (empty where it was not judged).
    pub regimes: Vec<&'static str>,
}

impl CaseRun {
    pub fn failures(&self) -> Vec<&Failure> {
        self.outcomes
            .iter()
            .filter_map(|(_, o)| match o {
                Outcome::Fail(f) => Some(f),
                _ => None,
            })
            .collect()
    }
}

/// One forward (+ backward) run.
pub struct Pair {
    pub fwd: FwdResult,
    pub bwd: Option<BwdResult>,
    /// Whether the implementation returned the log-sum-exp (a worker may not).
    pub has_lse: bool,
}

impl Pair {
    /// Whether the forward and the backward ran on the small-seq path.
    pub fn small_seq(&self) -> (bool, bool) {
        (
            self.fwd.path == Some(Path::SmallSeq),
            self.bwd.as_ref().and_then(|b| b.path) == Some(Path::SmallSeq),
        )
    }

    pub fn outputs(&self) -> Outputs {
        Outputs {
            o: Some(self.fwd.o.mapv(f64::from)),
            lse: self.has_lse.then(|| self.fwd.lse.mapv(f64::from)),
            dq: self.bwd.as_ref().map(|b| b.dq.mapv(f64::from)),
            dk: self.bwd.as_ref().map(|b| b.dk.mapv(f64::from)),
            dv: self.bwd.as_ref().map(|b| b.dv.mapv(f64::from)),
        }
    }
}

/// Runs forward, then backward from that forward's outputs when the case has `d_o`.
///
/// # Errors
/// Anything the wrappers return.
pub fn run_pair(be: &dyn Backend, case: &Case, opts: &RunOptions) -> Result<Pair> {
    let fwd = wrapper::fwd(be, case, opts)?;
    let bwd = match case.d_o {
        Some(_) => Some(wrapper::bwd(be, case, &fwd.o, &fwd.lse, opts)?),
        None => None,
    };
    Ok(Pair {
        fwd,
        bwd,
        has_lse: true,
    })
}

/// What a case's outputs are judged by, computed once per case.
pub struct Yardstick {
    /// The f64 reference.
    pub reference: Outputs,
    /// The device-faithful emulation.
    pub emulated: Outputs,
    /// [`score_magnitude`] of the case: the LSE noise floor's scale.
    pub lse_magnitude: f64,
    /// The gradients' per-element rounding allowances ([`allowances`]).
    pub grads: Option<GradAllowance>,
    /// The per-row rule's allowances for another order ([`allowances`]).
    pub order: OrderAllowance,
    /// P's rounding noise in o and dv ([`super::conditioning::PNoise`]).
    pub p_noise: super::conditioning::PNoise,
    /// The emulation's o and dv before their rounding to the dtype.
    pub emulated_acc: (ndarray::Array3<f64>, Option<ndarray::Array3<f64>>),
    /// The numeric regimes the case reaches ([`numeric_regimes`]), for coverage.
    pub regimes: Vec<&'static str>,
}

impl Yardstick {
    /// `actual` judged tensor by tensor; `order` takes the per-row rule's allowance for
    /// another summation order (without it, the rule as the emulation alone would set it).
    pub fn judge(&self, case: &Case, actual: &Outputs, order: bool) -> Vec<Judgement> {
        judge_all(
            actual,
            &self.reference,
            &self.emulated,
            case,
            self.lse_magnitude,
            self.grads.as_ref(),
            order.then_some(&self.order),
        )
    }

    /// The elements whose rounding f32 noise decides, per tensor, for conformance and bias.
    pub fn undecided(&self) -> super::conformance::Undecided<'_> {
        use super::conformance::Noise;
        super::conformance::Undecided {
            o: Some(Noise {
                noise: &self.p_noise.o,
                acc: Some(&self.emulated_acc.0),
            }),
            dq: self.grads.as_ref().map(|g| Noise {
                noise: &g.dq,
                acc: None,
            }),
            dk: self.grads.as_ref().map(|g| Noise {
                noise: &g.dk,
                acc: None,
            }),
            dv: self.p_noise.dv.as_ref().map(|n| Noise {
                noise: n,
                acc: self.emulated_acc.1.as_ref(),
            }),
        }
    }
}

/// The f64 reference and the emulation of a case, as outputs, with the LSE floor's scale.
pub fn oracle(case: &Case) -> Result<Yardstick> {
    let problem = case.problem()?;
    let (f, g) = forward_backward(&problem);
    let allow = allowances(case, &f.o, &f.lse);
    let reference = Outputs {
        o: Some(f.o),
        lse: Some(f.lse),
        dq: g.as_ref().map(|g| g.dq.clone()),
        dk: g.as_ref().map(|g| g.dk.clone()),
        dv: g.map(|g| g.dv),
    };
    let (ef, eg) = emulate::forward_backward(&problem, case.config.dtype);
    let regimes = numeric_regimes(
        case.config.dtype,
        &reference,
        eg.as_ref().map_or(0, |g| g.ds_saturated),
    );
    let emulated = Outputs {
        o: Some(ef.o.mapv(f64::from)),
        lse: Some(ef.lse.mapv(f64::from)),
        dq: eg.as_ref().map(|g| g.dq.mapv(f64::from)),
        dk: eg.as_ref().map(|g| g.dk.mapv(f64::from)),
        dv: eg.as_ref().map(|g| g.dv.mapv(f64::from)),
    };
    Ok(Yardstick {
        reference,
        emulated,
        emulated_acc: (
            ef.o_acc.mapv(f64::from),
            eg.map(|g| g.dv_acc.mapv(f64::from)),
        ),
        lse_magnitude: score_magnitude(case),
        grads: allow.grads,
        order: allow.order,
        p_noise: allow.p_noise,
        regimes,
    })
}

/// The numeric regimes a case reaches, each a value of coverage's `numeric_regime`: a
/// reference output (o, dQ, dK, dV) at or past the dtype's largest finite value
/// (`output_past_limit`), a nonzero one below its smallest normal (`output_subnormal`), a dS
/// past the range that the kernels' design saturates before dQ = dS·K and dK = dSᵀ·Q
/// (`ds_saturated`, from the emulation), or none of these (`in_range`).
pub fn numeric_regimes(
    dtype: Dtype,
    reference: &Outputs,
    ds_saturated: usize,
) -> Vec<&'static str> {
    let max = f64::from(dtype.max_finite());
    let smallest_normal = dtype.smallest_normal();
    let values = || {
        [&reference.o, &reference.dq, &reference.dk, &reference.dv]
            .into_iter()
            .flatten()
            .flat_map(|a| a.iter().copied())
    };
    let mut regimes = Vec::new();
    if values().any(|x| x.abs() >= max) {
        regimes.push("output_past_limit");
    }
    if values().any(|x| x != 0.0 && x.abs() < smallest_normal) {
        regimes.push("output_subnormal");
    }
    if ds_saturated > 0 {
        regimes.push("ds_saturated");
    }
    if regimes.is_empty() {
        regimes.push("in_range");
    }
    regimes
}

/// Judges outputs against the oracle: the `numeric_agreement` outcome and the judgements.
pub fn numeric(case: &Case, actual: &Outputs, y: &Yardstick) -> (Outcome, Vec<Judgement>) {
    let js = y.judge(case, actual, true);
    let worst = js
        .iter()
        .filter(|j| !j.passed())
        .max_by(|a, b| a.margin.total_cmp(&b.margin));
    let outcome = match worst {
        None => Outcome::Pass,
        Some(j) => Outcome::Fail(Failure {
            prop: Prop::NumericAgreement,
            detail: numeric_detail(j),
            worst: j.worst.clone(),
            margin: j.margin,
        }),
    };
    (outcome, js)
}

/// A failed tensor's line: its error against the threshold and the emulation's error, and
/// where the emulation itself is non-finite (its error leaves those elements out) or holds the
/// kernel's value at the worst element, so a limit of the kernel design does not read as a
/// kernel straying from it.
fn numeric_detail(j: &Judgement) -> String {
    let mut s = format!(
        "{}: max error {:.3e} > threshold {:.3e} (emulation error {:.3e}",
        j.tensor, j.err, j.threshold, j.emu_err
    );
    if j.emu_non_finite > 0 {
        s += &format!(
            " over its finite elements; it is non-finite at {} where the reference is finite",
            j.emu_non_finite
        );
    }
    s.push(')');
    if j.worst.as_ref().is_some_and(Worst::design_shares) {
        s += "; the emulation holds the same value at the worst element: the kernel follows \
              its design, and the design loses the value there";
    }
    s
}

/// Don't-care outputs must be exactly 0 (lse -inf). (A NaN among valid outputs is
/// numeric_agreement's: it counts as an infinite error.)
pub fn dont_care_outputs(case: &Case, actual: &Outputs) -> Option<String> {
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let check3 = |name: &str, t: &Option<ndarray::Array3<f64>>, valid: &[bool]| -> Option<String> {
        let t = t.as_ref()?;
        t.indexed_iter().find_map(|((tok, h, d), &x)| {
            (!valid[tok] && x.to_bits() != 0f64.to_bits()).then(|| {
                format!("{name}[{tok}, {h}, {d}] = {x} on a don't-care token (expected 0)")
            })
        })
    };
    check3("o", &actual.o, &vq)
        .or_else(|| {
            actual.lse.as_ref().and_then(|t| {
                t.indexed_iter().find_map(|((tok, h), &x)| {
                    (!vq[tok] && x != f64::NEG_INFINITY).then(|| {
                        format!("lse[{tok}, {h}] = {x} on a don't-care token (expected -inf)")
                    })
                })
            })
        })
        .or_else(|| check3("dq", &actual.dq, &vq))
        .or_else(|| check3("dk", &actual.dk, &vk))
        .or_else(|| check3("dv", &actual.dv, &vk))
}

/// First element where two output sets differ bitwise, restricted to `rows` pairs.
fn bitwise_diff(a: &Outputs, b: &Outputs) -> Option<String> {
    let pairs3 = [
        ("o", &a.o, &b.o),
        ("dq", &a.dq, &b.dq),
        ("dk", &a.dk, &b.dk),
        ("dv", &a.dv, &b.dv),
    ];
    for (name, x, y) in pairs3 {
        if let (Some(x), Some(y)) = (x, y) {
            if let Some(((t, h, d), v)) = x
                .indexed_iter()
                .find(|(i, v)| v.to_bits() != y[*i].to_bits())
            {
                return Some(format!("{name}[{t}, {h}, {d}]: {v} vs {}", y[(t, h, d)]));
            }
        }
    }
    if let (Some(x), Some(y)) = (&a.lse, &b.lse) {
        if let Some(((t, h), v)) = x
            .indexed_iter()
            .find(|(i, v)| v.to_bits() != y[*i].to_bits())
        {
            return Some(format!("lse[{t}, {h}]: {v} vs {}", y[(t, h)]));
        }
    }
    None
}

/// Metamorphic relations run per case (each applicable one on every case: `usize::MAX`).
/// All four on every case cost the CPU campaign 24 % of its throughput (120 cases, seed 42, in
/// the same minutes: 41.2 s against 33.3 s), which would take it below its 55 cases/s floor
/// at idle (55.7 before): so one per case, rotating with the case's salt. Each applicable
/// relation runs on 1/n of the cases it applies to (n ≤ 4), and any n consecutive salts run
/// every one of them (`the_rotation_runs_every_relation_over_n_salts`).
pub const METAMORPHIC_PER_CASE: usize = 1;

/// The metamorphic relations a case of `slots` slots (with GQA or not) runs under `salt`:
/// [`METAMORPHIC_PER_CASE`] of the applicable ones, rotating from the one the salt draws.
fn chosen_relations(slots: usize, gqa: bool, salt: u64) -> Vec<&'static str> {
    let relations: Vec<&str> = [
        (slots >= 2).then_some("permute"),
        (slots >= 2).then_some("split"),
        gqa.then_some("gqa"),
        Some("scale"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let n = relations.len();
    let first = (salt % n as u64) as usize;
    (0..n.min(METAMORPHIC_PER_CASE))
        .map(|i| relations[(first + i) % n])
        .collect()
}

/// Runs the property suite on one case.
pub struct Checker<'a> {
    pub runner: Box<dyn Runner + 'a>,
    pub opts: RunOptions,
}

impl<'a> Checker<'a> {
    /// A checker for `backend` under the native profile with an empty dispatch environment:
    /// independent of the caller's process environment (tests, fuzz targets, proptests).
    pub fn isolated(backend: &'a dyn Backend) -> Self {
        Checker {
            runner: Box::new(InProcess::new(backend)),
            opts: RunOptions {
                env: EnvView::default(),
                ..RunOptions::default()
            },
        }
    }

    /// A later run of a property failed: a failure, except that an external implementation
    /// declining a derived case (a sub-batch, the MHA equivalent) skips the property.
    fn run_failed(&self, prop: Prop, what: &str, e: &Error) -> Outcome {
        match e {
            Error::Unsupported(why) if self.runner.external() => skip(declined(why)),
            e => fail(prop, format!("{what}: {e}")),
        }
    }

    /// `actual` as judged when the implementation declares that a row with no visible key
    /// holds something other than the semantics' zeros (`caps.no_key_row`): those rows of O
    /// and LSE take the semantics' values, and the case's gradients (which such rows feed)
    /// are not judged; `Caps::not_covered` says so in the report. `None`: judged as it is.
    fn no_key_rows_as_declared(&self, case: &Case, actual: &Outputs) -> Option<Outputs> {
        if self.runner.caps().no_key_row == crate::runner::NoKeyRow::Zero {
            return None;
        }
        let rows: Vec<(usize, usize)> = case
            .visible_rows()
            .filter(|r| r.keys.is_empty())
            .map(|r| (r.token, r.head))
            .collect();
        if rows.is_empty() {
            return None;
        }
        let mut o = actual.clone();
        for &(t, h) in &rows {
            if let Some(a) = o.o.as_mut() {
                a.slice_mut(ndarray::s![t, h, ..]).fill(0.0);
            }
            if let Some(l) = o.lse.as_mut() {
                l[(t, h)] = f64::NEG_INFINITY;
            }
        }
        (o.dq, o.dk, o.dv) = (None, None, None);
        Some(o)
    }

    /// A checker of `runner` under `opts`.
    pub fn new(runner: Box<dyn Runner + 'a>, opts: RunOptions) -> Self {
        Checker { runner, opts }
    }

    /// Every property on `case`; a worker fault ends the case with a `crash` or `hang`
    /// verdict instead (see [`FaultLatch`]).
    ///
    /// # Errors
    /// As [`Checker::check_properties`].
    pub fn check(&self, case: &Case, salt: u64) -> Result<CaseRun> {
        let latch = FaultLatch::new(self.runner.as_ref());
        let scoped = Checker {
            runner: Box::new(&latch),
            opts: self.opts.clone(),
        };
        let run = scoped.check_properties(case, salt)?;
        let in_worker = self.runner.worker_command().is_some();
        Ok(match latch.take() {
            Some(f) => fault_run(f),
            None if in_worker => CaseRun {
                outcomes: run
                    .outcomes
                    .into_iter()
                    .filter(|(p, _)| !matches!(p, Prop::Crash | Prop::Hang))
                    .chain([(Prop::Crash, Outcome::Pass), (Prop::Hang, Outcome::Pass)])
                    .collect(),
                ..run
            },
            None => run,
        })
    }

    /// Every property on `case`. `salt` varies the metamorphic relation and re-poisoning.
    ///
    /// # Errors
    /// Only infrastructure errors (an invalid case); backend failures on a case are recorded
    /// as property failures.
    fn check_properties(&self, case: &Case, salt: u64) -> Result<CaseRun> {
        let mut outcomes = vec![(Prop::Eligibility, self.eligibility(case))];
        if let Some(why) = case.config.unsupported_reason() {
            let o = match self.runner.run_pair(case, &self.opts) {
                Err(Error::Unsupported(_)) => skip(format!("unsupported: {why}")),
                Err(e) => fail(
                    Prop::NumericAgreement,
                    format!("expected an unsupported error, got: {e}"),
                ),
                Ok(_) => fail(
                    Prop::NumericAgreement,
                    format!("{why}, yet the backend ran it"),
                ),
            };
            // Crash and hang verdicts are the worker's, added by `check`.
            for p in Prop::ALL
                .into_iter()
                .skip(1)
                .filter(|p| !matches!(p, Prop::Crash | Prop::Hang))
            {
                let o = if p == Prop::NumericAgreement {
                    o.clone()
                } else {
                    skip(format!("unsupported: {why}"))
                };
                outcomes.push((p, o));
            }
            return Ok(CaseRun {
                outcomes,
                judgements: Vec::new(),
                outputs: Outputs::default(),
                path_fwd: None,
                path_bwd: None,
                fault: None,
                regimes: Vec::new(),
            });
        }
        let base = match self.runner.run_pair(case, &self.opts) {
            Ok(p) => p,
            Err(Error::Unsupported(why)) if self.runner.external() => {
                // An implementation that is not ours may decline what its capabilities could
                // not say it lacks (a length limit, causal with Lq != Lk): a skip, with its
                // words, never a failure.
                let reason = declined(&why);
                for p in Prop::ALL.into_iter().skip(1) {
                    outcomes.push((p, skip(reason.clone())));
                }
                return Ok(CaseRun {
                    outcomes,
                    judgements: Vec::new(),
                    outputs: Outputs::default(),
                    path_fwd: None,
                    path_bwd: None,
                    fault: None,
                    regimes: Vec::new(),
                });
            }
            Err(e) => {
                outcomes.push((
                    Prop::NumericAgreement,
                    fail(Prop::NumericAgreement, format!("backend error: {e}")),
                ));
                return Ok(CaseRun {
                    outcomes,
                    judgements: Vec::new(),
                    outputs: Outputs::default(),
                    path_fwd: None,
                    path_bwd: None,
                    fault: None,
                    regimes: Vec::new(),
                });
            }
        };
        let actual = base.outputs();
        let mut y = oracle(case)?;
        y.order.design = super::conditioning::Design::of_backend(self.runner.name());
        let declared = self.no_key_rows_as_declared(case, &actual);
        let (num, judgements) = numeric(case, declared.as_ref().unwrap_or(&actual), &y);
        outcomes.push((Prop::NumericAgreement, num));
        outcomes.push((
            Prop::EmulationConformance,
            self.emulation_conformance(case, &base, &actual, &y.emulated, y.undecided()),
        ));
        outcomes.push((Prop::RoundingBias, {
            let bias = |t: &str| super::bias::bias_budget_of(self.runner.name(), t);
            match base.fwd.path {
                Some(Path::SmallSeq) => super::bias::judge(
                    &super::bias::signs(
                        case,
                        base.small_seq(),
                        &actual,
                        &y.emulated,
                        y.undecided(),
                    ),
                    bias,
                ),
                _ => skip("not on the small-seq path"),
            }
        }));
        outcomes.push((Prop::Workspace, self.workspace(case, &base)));
        outcomes.push((Prop::DontCare, self.dont_care(case, &actual, salt)));
        outcomes.push((Prop::Determinism, self.determinism(case, &actual)));
        outcomes.push((
            Prop::FallbackEquivalence,
            self.fallback_equivalence(case, &base, &actual, &y, &judgements),
        ));
        outcomes.push((
            Prop::Metamorphic,
            self.metamorphic(case, &base, &actual, &judgements, &y, salt),
        ));
        Ok(CaseRun {
            outcomes,
            judgements,
            path_fwd: base.fwd.path,
            path_bwd: base.bwd.as_ref().and_then(|b| b.path),
            outputs: actual,
            fault: None,
            regimes: y.regimes.clone(),
        })
    }

    fn eligibility(&self, case: &Case) -> Outcome {
        let Some(d) = self.runner.dispatcher(&self.opts) else {
            return skip("the implementation's dispatch cannot be predicted (no path reported)");
        };
        match oracles::dispatch_agrees(&d, &case.config, &case.layout) {
            Ok(_) => Outcome::Pass,
            Err(why) => fail(Prop::Eligibility, why),
        }
    }

    /// See [`conformance`]: outputs off the emulation by more than an ulp, counted against
    /// the backend's rate budgets.
    fn emulation_conformance(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
        emulated: &Outputs,
        undecided: conformance::Undecided<'_>,
    ) -> Outcome {
        if CONFORMANCE_TENSORS
            .iter()
            .all(|t| self.runner.rounding_budget(t).is_none())
        {
            return skip("backend roundings not calibrated against the emulation");
        }
        if base.fwd.path != Some(Path::SmallSeq) {
            return skip("not on the small-seq path");
        }
        let counts = conformance::counts(case, base.small_seq(), actual, emulated, undecided);
        conformance::judge(&counts, |t| self.runner.rounding_budget(t))
    }

    /// Guards intact, usage within the plan, the plan within the trace-time bound; and the
    /// same when the dispatch environment flips between sizing and launch (a framework that
    /// traced with the variable set and runs without it): the wrapper must re-plan or refuse,
    /// never carve past what was allocated.
    fn workspace(&self, case: &Case, base: &Pair) -> Outcome {
        let caps = self.runner.caps();
        if !caps.reports_workspace || !caps.harness_options {
            return skip("the implementation does not report its workspace");
        }
        if let Some(f) = workspace_failure(base, "") {
            return f;
        }
        if base.fwd.path.is_none() {
            return Outcome::Pass;
        }
        let opts = RunOptions {
            trace_env: Some(toggled_env(self.opts.profile, &self.opts.env)),
            ..self.opts.clone()
        };
        match self.runner.run_pair(case, &opts) {
            Err(Error::Workspace(_)) => Outcome::Pass,
            Err(e) => fail(
                Prop::Workspace,
                format!("environment flipped between sizing and launch: unexpected error: {e}"),
            ),
            Ok(p) => workspace_failure(&p, "environment flipped between sizing and launch: ")
                .unwrap_or(Outcome::Pass),
        }
    }

    fn dont_care(&self, case: &Case, actual: &Outputs, salt: u64) -> Outcome {
        let (rq, rk) = dont_care_rows(case);
        if let Some(msg) = dont_care_outputs(case, actual) {
            return fail(Prop::DontCare, msg);
        }
        if rq.is_empty() && rk.is_empty() {
            return skip("no don't-care tokens");
        }
        let mut repoisoned = case.clone();
        poison(&mut repoisoned, &mut Rng::new(salt ^ 0xd0_c0de));
        match self.runner.run_pair(&repoisoned, &self.opts) {
            Err(e) => self.run_failed(Prop::DontCare, "re-poisoned run failed", &e),
            Ok(p) => {
                let mut other = p.outputs();
                // Only valid outputs must be unchanged; don't-care outputs were checked above.
                mask_dont_care(case, &mut other, actual);
                match bitwise_diff(actual, &other) {
                    None => Outcome::Pass,
                    Some(d) => fail(
                        Prop::DontCare,
                        format!("valid output changed when don't-care inputs changed: {d}"),
                    ),
                }
            }
        }
    }

    fn determinism(&self, case: &Case, actual: &Outputs) -> Outcome {
        let opts = RunOptions {
            fill: f32::NAN,
            ..self.opts.clone()
        };
        match self.runner.run_pair(case, &opts) {
            Err(e) => self.run_failed(Prop::Determinism, "rerun failed", &e),
            Ok(p) => match bitwise_diff(actual, &p.outputs()) {
                None => Outcome::Pass,
                Some(d) => fail(
                    Prop::Determinism,
                    format!("rerun into poisoned outputs differs: {d}"),
                ),
            },
        }
    }

    fn fallback_equivalence(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
        y: &Yardstick,
        judgements: &[Judgement],
    ) -> Outcome {
        if !self.runner.caps().harness_options {
            return skip("the implementation cannot be forced onto its fallback");
        }
        if base.fwd.path != Some(Path::SmallSeq) {
            return skip("not eligible for small-seq");
        }
        let opts = RunOptions {
            force: Some(Path::Fallback),
            ..self.opts.clone()
        };
        let fb = match self.runner.run_pair(case, &opts) {
            Ok(p) => p,
            Err(e) => {
                return fail(
                    Prop::FallbackEquivalence,
                    format!("fallback run failed: {e}"),
                )
            }
        };
        let fb_out = fb.outputs();
        // The forced-fallback run is judged against the reference like the base run: its own
        // verdict is the sharpest this property has (a failure of it is a failure).
        let (fb_num, fb_js) = numeric(case, &fb_out, y);
        if let Outcome::Fail(mut f) = fb_num {
            f.prop = Prop::FallbackEquivalence;
            f.detail = format!("forced fallback against the reference: {}", f.detail);
            return Outcome::Fail(f);
        }
        // Distances between the two paths, one per tensor, in the same order as the judgements.
        // Where the reference lies within a path's threshold of the dtype's limit, each path
        // was judged against it (overflow rules included: there an overflow is excused); one
        // path overflowing there while the other, rounding dS with saturation like its
        // emulation, stays finite is no disagreement.
        let limit = f64::from(case.config.dtype.max_finite());
        let headroom: BTreeMap<&str, f64> = judgements
            .iter()
            .zip(&fb_js)
            .map(|(a, b)| (a.tensor.as_str(), a.threshold.max(b.threshold)))
            .collect();
        let headroom = |t: &str| headroom.get(t).copied().unwrap_or(0.0);
        let (ss_cmp, fb_cmp) = near_limit_agreed(actual, &fb_out, &y.reference, limit, headroom);
        let between = y.grads.as_ref().map(GradAllowance::between_two_outputs);
        let between_js = judge_all(
            &ss_cmp,
            &fb_cmp,
            &y.emulated,
            case,
            y.lse_magnitude,
            between.as_ref(),
            None,
        );
        for ((a, b), between) in judgements.iter().zip(&fb_js).zip(&between_js) {
            let between = between.err;
            let limit = a.threshold + b.threshold;
            if between > limit {
                return Outcome::Fail(Failure {
                    prop: Prop::FallbackEquivalence,
                    detail: format!(
                        "{}: small-seq and fallback differ by {between:.3e} > {limit:.3e}",
                        a.tensor
                    ),
                    worst: None,
                    margin: between / limit,
                });
            }
        }
        // Forward and backward on different paths must still agree: backward on the
        // fallback from the small-seq forward's LSE.
        if case.d_o.is_some() {
            match self
                .runner
                .run_bwd_from(case, &base.fwd.o, &base.fwd.lse, &opts)
            {
                Err(e) => {
                    return fail(
                        Prop::FallbackEquivalence,
                        format!("mixed-path backward failed: {e}"),
                    )
                }
                Ok(b) => {
                    let mixed = Outputs {
                        dq: Some(b.dq.mapv(f64::from)),
                        dk: Some(b.dk.mapv(f64::from)),
                        dv: Some(b.dv.mapv(f64::from)),
                        ..Outputs::default()
                    };
                    if let (Outcome::Fail(mut f), _) = numeric(case, &mixed, y) {
                        f.prop = Prop::FallbackEquivalence;
                        f.detail = format!("small-seq forward + fallback backward: {}", f.detail);
                        return Outcome::Fail(f);
                    }
                }
            }
        }
        Outcome::Pass
    }

    fn metamorphic(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
        js: &[Judgement],
        y: &Yardstick,
        salt: u64,
    ) -> Outcome {
        let b = case.layout.slots();
        let gqa = case.config.params.num_heads != case.config.params.num_kv_heads;
        // The first failure is the verdict; a skip only where every relation run skipped.
        let run = chosen_relations(b, gqa, salt);
        let relation_count = run.len();
        let mut skipped = Vec::new();
        for rel in run {
            let outcome = match rel {
                "permute" => {
                    let order: Vec<usize> = (0..b).rev().collect();
                    let parts = [order];
                    self.slot_relation(case, base, actual, js, y, &parts, "reversing the slots")
                }
                "split" => {
                    let cut = b / 2;
                    let parts = [(0..cut).collect(), (cut..b).collect()];
                    let what = "splitting the batch in two launches";
                    self.slot_relation(case, base, actual, js, y, &parts, what)
                }
                "gqa" => self.gqa_relation(case, base, actual, js, y),
                _ => self.scale_relation(case, actual, js, y),
            };
            match outcome {
                Outcome::Fail(f) => return Outcome::Fail(f),
                Outcome::Skip { reason } => skipped.push(reason),
                Outcome::Pass => {}
            }
        }
        if skipped.len() == relation_count {
            skip(skipped.join("; "))
        } else {
            Outcome::Pass
        }
    }

    /// Runs `parts` (slot subsets) as separate launches; their outputs must equal the
    /// corresponding rows of the base run bitwise when the path (and the fallback kernel) is
    /// unchanged, and be within the sum of two thresholds of it otherwise (each path is
    /// within one threshold of the reference).
    #[allow(clippy::too_many_arguments)]
    fn slot_relation(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
        js: &[Judgement],
        y: &Yardstick,
        parts: &[Vec<usize>],
        what: &str,
    ) -> Outcome {
        // Rows the implementation declares to hold something other than the semantics' zeros
        // carry no promise, and may depend on the launch's batch (JAX XLA averages V over
        // the whole padded key length there): compared as declared, on both sides.
        let declared = self.no_key_rows_as_declared(case, actual);
        let actual = declared.as_ref().unwrap_or(actual);
        for order in parts {
            let (sub, rows_q, rows_k) = select_slots(case, order, true);
            let p = match self.runner.run_pair(&sub, &self.opts) {
                Ok(p) => p,
                Err(e) => {
                    return self.run_failed(Prop::Metamorphic, &format!("{what}: run failed"), &e)
                }
            };
            let kernel = |c: &Case| self.runner.fallback_fwd_kernel(&c.config, &c.layout);
            let bwd_path = |p: &Pair| p.bwd.as_ref().map(|b| b.path);
            let changed = if p.fwd.path != base.fwd.path || bwd_path(&p) != bwd_path(base) {
                Some("the path")
            } else if (p.fwd.path == Some(Path::Fallback)
                || bwd_path(&p) == Some(Some(Path::Fallback)))
                && kernel(&sub) != kernel(case)
            {
                Some("the fallback kernel")
            } else if self.runner.external() {
                // A framework may pick another kernel or GEMM blocking for another batch
                // (PyTorch's math path sums in another order): bitwise equality is ours alone.
                Some("the batch an external implementation sees")
            } else {
                None
            };
            let pick3 = |t: &Option<ndarray::Array3<f64>>, rows: &[usize]| {
                t.as_ref().map(|t| t.select(ndarray::Axis(0), rows))
            };
            let want = Outputs {
                o: pick3(&actual.o, &rows_q),
                lse: actual
                    .lse
                    .as_ref()
                    .map(|t| t.select(ndarray::Axis(0), &rows_q)),
                dq: pick3(&actual.dq, &rows_q),
                dk: pick3(&actual.dk, &rows_k),
                dv: pick3(&actual.dv, &rows_k),
            };
            let mut got = p.outputs();
            if let Some(d) = self.no_key_rows_as_declared(&sub, &got) {
                got = d;
            }
            mask_dont_care(&sub, &mut got, &want);
            if let Some(changed) = changed {
                let full = scatter_rows(actual, &got, &rows_q, &rows_k);
                let o = within_tolerance(
                    case,
                    actual,
                    &full,
                    js,
                    y,
                    |_| 2.0,
                    |t, e, l| {
                        format!(
                        "{what} changed {changed}, and {t} of the launches differs from the base \
                         run by {e:.3e} > {l:.3e} (two thresholds)"
                    )
                    },
                );
                if matches!(o, Outcome::Fail(_)) {
                    return o;
                }
            } else if let Some(d) = bitwise_diff(&want, &got) {
                return fail(
                    Prop::Metamorphic,
                    format!("{what} changed a valid output: {d}"),
                );
            }
        }
        Outcome::Pass
    }

    fn gqa_relation(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
        js: &[Judgement],
        y: &Yardstick,
    ) -> Outcome {
        let mha = repeat_kv(case);
        let p = match self.runner.run_pair(&mha, &self.opts) {
            Ok(p) => p,
            Err(e) => return self.run_failed(Prop::Metamorphic, "MHA equivalent failed", &e),
        };
        let m = p.outputs();
        let g = case.config.params.group_size();
        let sum_group = |t: &Option<ndarray::Array3<f64>>| {
            t.as_ref().map(|t| {
                let (tk, h, d) = t.dim();
                ndarray::Array3::from_shape_fn((tk, h / g, d), |(x, y, z)| {
                    (0..g).map(|j| t[(x, y * g + j, z)]).sum()
                })
            })
        };
        let summed = Outputs {
            o: m.o.clone(),
            lse: m.lse.clone(),
            dq: m.dq.clone(),
            dk: sum_group(&m.dk),
            dv: sum_group(&m.dv),
        };
        // Summing the group before or after rounding decides whether a value next to the
        // dtype's limit overflows; such cases say nothing about the relation.
        let limit = f64::from(case.config.dtype.max_finite()) / 2.0;
        let near_overflow = |o: &Outputs| {
            [&o.dk, &o.dv]
                .into_iter()
                .flatten()
                .any(|t| t.iter().any(|x| x.abs() > limit))
        };
        if near_overflow(actual) || near_overflow(&summed) {
            return skip("dK/dV next to the dtype's overflow");
        }
        // Both sides are within tolerance of the reference; summing dK/dV over the group adds
        // at most g roundings of the MHA side. o, lse and dq are never summed: on the same
        // path they owe one threshold (the same arithmetic per row), on another path two
        // (each within one of the reference).
        let same_path = p.fwd.path == base.fwd.path
            && p.bwd.as_ref().map(|b| b.path) == base.bwd.as_ref().map(|b| b.path);
        let factor = |t: &str| match t {
            "dk" | "dv" => 1.0 + g as f64,
            _ if same_path => 1.0,
            _ => 2.0,
        };
        within_tolerance(case, actual, &summed, js, y, factor, |t, e, l| {
            format!("GQA vs MHA with repeated K/V: {t} differs by {e:.3e} > {l:.3e}")
        })
    }

    fn scale_relation(
        &self,
        case: &Case,
        actual: &Outputs,
        js: &[Judgement],
        y: &Yardstick,
    ) -> Outcome {
        let dt = case.config.dtype;
        let limit = f64::from(dt.max_finite()) / 4.0;
        let big =
            |t: Option<&ndarray::Array3<f64>>| t.is_some_and(|t| t.iter().any(|x| x.abs() > limit));
        if actual.rows3().into_iter().any(|(_, t)| big(t)) {
            return skip("scaling by 2 could overflow");
        }
        let mut scaled = case.clone();
        // Only valid rows are scaled: don't-care rows may hold the dtype's largest value.
        let double_rows = |t: &mut ndarray::Array3<f32>, valid: &[bool]| {
            for (r, _) in valid.iter().enumerate().filter(|(_, v)| **v) {
                t.slice_mut(ndarray::s![r, .., ..])
                    .mapv_inplace(|x| x * 2.0);
            }
        };
        double_rows(&mut scaled.v, &case.layout.kv.valid_tokens());
        let with_grad = dt != Dtype::F16;
        if let Some(d) = scaled.d_o.as_mut() {
            if with_grad {
                double_rows(d, &case.layout.q.valid_tokens());
            }
        }
        let p = match self.runner.run_pair(&scaled, &self.opts) {
            Ok(p) => p,
            Err(e) => return self.run_failed(Prop::Metamorphic, "scaled run failed", &e),
        };
        let got = p.outputs();
        // Power-of-two scaling commutes with rounding except in the subnormal range, where
        // the quantum is absolute. An output rounded there gets one quantum (f16: 2^-24; bf16
        // and f32, subnormal below 2^-126, are let go under 2^-100); intermediates that get
        // there are `subnormal::may_go_subnormal`'s, below.
        let (tiny, quantum) = match dt {
            Dtype::F16 => (2f64.powi(-13), 2f64.powi(-24)),
            Dtype::Bf16 | Dtype::F32 => (2f64.powi(-100), 2f64.powi(-100)),
        };
        let check = |name: &str,
                     a: Option<&ndarray::Array3<f64>>,
                     b: Option<&ndarray::Array3<f64>>,
                     f: f64|
         -> Option<String> {
            let (a, b) = (a?, b?);
            a.indexed_iter().find_map(|((t, h, d), &x)| {
                let y = b[(t, h, d)];
                let want = x * f;
                let ok = want.to_bits() == y.to_bits()
                    || (want.abs() <= tiny && (want - y).abs() <= 2.0 * quantum * f);
                (!ok).then(|| {
                    format!("{name}[{t}, {h}, {d}] = {y}, expected exactly {f} x {x} = {want}")
                })
            })
        };
        let lse_changed = match (&actual.lse, &got.lse) {
            (Some(a), Some(b)) => a
                .iter()
                .zip(b.iter())
                .position(|(x, y)| x.to_bits() != y.to_bits()),
            _ => None,
        };
        if let Some(i) = lse_changed {
            return fail(
                Prop::Metamorphic,
                format!("scaling v (and d_o) by 2: lse element {i} changed when v was scaled"),
            );
        }
        // v doubled: o by 2. With d_o doubled too, dP and D scale by 4, so dq and dk by 4,
        // and dv = P·dO by 2.
        let factor = |name: &str| match name {
            "o" => Some(2.0),
            "dq" | "dk" if with_grad => Some(4.0),
            "dv" if with_grad => Some(2.0),
            _ => None,
        };
        let exposed = y
            .reference
            .lse
            .as_ref()
            .is_some_and(|lse| subnormal::may_go_subnormal(case, lse, actual.o.as_ref()));
        if exposed {
            // A subnormal f32 term rounds differently at twice the scale and can flip a later
            // tie, so exactness is not owed; both runs must still be as accurate as the
            // reference demands.
            let mut back = Outputs {
                lse: got.lse.clone(),
                ..Outputs::default()
            };
            for ((name, dst), (_, src)) in back.rows3_mut().into_iter().zip(got.rows3()) {
                if let (Some(f), Some(t)) = (factor(name), src) {
                    *dst = Some(t.mapv(|x| x / f));
                }
            }
            // As strict as numeric_agreement: one threshold, not two.
            return within_tolerance(
                case,
                actual,
                &back,
                js,
                y,
                |_| 1.0,
                |t, e, l| {
                    format!(
                        "scaling v (and d_o) by 2, f32 intermediates near the subnormal range: \
                     {t} differs from the scaled base by {e:.3e} > {l:.3e}"
                    )
                },
            );
        }
        let broken = actual
            .rows3()
            .into_iter()
            .zip(got.rows3())
            .find_map(|((name, a), (_, b))| factor(name).and_then(|f| check(name, a, b, f)));
        match broken {
            None => Outcome::Pass,
            Some(m) => fail(Prop::Metamorphic, format!("scaling v (and d_o) by 2: {m}")),
        }
    }
}

/// The skip reason of a case an external implementation declined; report keys end at the
/// first colon, so the implementation's words keep theirs out.
fn declined(why: &str) -> String {
    format!(
        "declined by the implementation ({})",
        why.replace(':', " -")
    )
}

/// The verdict of a case a worker fault ended: the fault, every other property skipped.
fn fault_run(f: Fault) -> CaseRun {
    let prop = match f.kind {
        FaultKind::Crash => Prop::Crash,
        FaultKind::Hang => Prop::Hang,
    };
    let outcomes = Prop::ALL
        .into_iter()
        .map(|p| {
            let o = if p == prop {
                fail(prop, f.detail.clone())
            } else {
                skip(format!("the worker {} on this case", f.kind.past()))
            };
            (p, o)
        })
        .collect();
    CaseRun {
        outcomes,
        judgements: Vec::new(),
        outputs: Outputs::default(),
        path_fwd: None,
        path_bwd: None,
        fault: Some(f),
        regimes: Vec::new(),
    }
}

/// `actual` with the rows `rows_q` (o, lse, dq) and `rows_k` (dk, dv) replaced by the rows of
/// `part`, the outputs of a launch of those rows alone.
fn scatter_rows(actual: &Outputs, part: &Outputs, rows_q: &[usize], rows_k: &[usize]) -> Outputs {
    let mut full = actual.clone();
    let put3 = |dst: &mut Option<ndarray::Array3<f64>>,
                src: &Option<ndarray::Array3<f64>>,
                rows: &[usize]| {
        if let (Some(d), Some(s)) = (dst.as_mut(), src.as_ref()) {
            for (i, &r) in rows.iter().enumerate() {
                d.slice_mut(ndarray::s![r, .., ..])
                    .assign(&s.slice(ndarray::s![i, .., ..]));
            }
        }
    };
    put3(&mut full.o, &part.o, rows_q);
    put3(&mut full.dq, &part.dq, rows_q);
    put3(&mut full.dk, &part.dk, rows_k);
    put3(&mut full.dv, &part.dv, rows_k);
    if let (Some(d), Some(s)) = (full.lse.as_mut(), part.lse.as_ref()) {
        for (i, &r) in rows_q.iter().enumerate() {
            d.row_mut(r).assign(&s.row(i));
        }
    }
    full
}

/// Compares `other` with `actual` to `factor(tensor)` times each tensor's threshold in `js`
/// (both are within one threshold of the reference when the relation holds); `detail(tensor,
/// err, limit)` words a failure.
fn within_tolerance(
    case: &Case,
    actual: &Outputs,
    other: &Outputs,
    js: &[Judgement],
    y: &Yardstick,
    factor: impl Fn(&str) -> f64,
    detail: impl Fn(&str, f64, f64) -> String,
) -> Outcome {
    // Where the reference lies within the allowed distance of the dtype's limit, one launch
    // overflowing there while the other, on another path that rounds dS with saturation, stays
    // finite is no disagreement (CPU fuzz seed 2061, case 4612: f16 dQ -inf on the fallback,
    // -64,736 on the small-seq path of a split launch); a NaN or a finite value far off is.
    let limit = f64::from(case.config.dtype.max_finite());
    let headroom = |t: &str| {
        js.iter()
            .find(|j| j.tensor == t)
            .map_or(0.0, |j| factor(t) * j.threshold)
    };
    let (mut actual, mut other) = near_limit_agreed(actual, other, &y.reference, limit, headroom);
    // A stored infinity says "at or past the limit in this direction", as the tolerance rule
    // reads it against the reference: here the other run stands in for the reference, and an
    // infinity there would make any finite value infinitely far (CPU fuzz seed 2071, case
    // 5916: an f16 dK whose rounding allowance exceeds its 812,541, -inf on the split
    // launch's small-seq path, +inf on the base run's fallback: each within its allowance of
    // the reference). NaN stays, and fails.
    for out in [&mut actual, &mut other] {
        for (_, t) in out.rows3_mut() {
            if let Some(t) = t.as_mut() {
                t.mapv_inplace(|v| {
                    if v.is_infinite() {
                        v.signum() * limit
                    } else {
                        v
                    }
                });
            }
        }
    }
    let between = y.grads.as_ref().map(GradAllowance::between_two_outputs);
    let diffs = judge_all(
        &actual,
        &other,
        &actual,
        case,
        y.lse_magnitude,
        between.as_ref(),
        None,
    );
    for d in &diffs {
        let Some(j) = js.iter().find(|j| j.tensor == d.tensor) else {
            continue;
        };
        let limit = factor(&d.tensor) * j.threshold;
        if d.err > limit {
            return Outcome::Fail(Failure {
                prop: Prop::Metamorphic,
                detail: detail(&d.tensor, d.err, limit),
                worst: d.worst.clone(),
                margin: d.err / limit,
            });
        }
    }
    Outcome::Pass
}

/// The first workspace defect of a run, if any; `context` prefixes the detail.
fn workspace_failure(p: &Pair, context: &str) -> Option<Outcome> {
    let mut reports = vec![("forward", &p.fwd.workspace)];
    if let Some(b) = &p.bwd {
        reports.push(("backward", &b.workspace));
    }
    reports.into_iter().find_map(|(dir, w)| {
        workspace_defect(w).map(|d| fail(Prop::Workspace, format!("{context}{dir}: {d}")))
    })
}

/// What is wrong with one launch's workspace, if anything. A write past the allocation lands
/// in the guard band; `used > planned` is a write past the plan that stays inside the
/// allocation, which happens where the buffer was sized for more than the launch planned (a
/// trace-time environment that took the other path, `WorkspaceReport::used` scans the whole
/// allocation).
fn workspace_defect(w: &crate::wrapper::WorkspaceReport) -> Option<String> {
    if !w.corrupted.is_empty() {
        return Some(format!(
            "guard band overwritten at {}",
            w.corrupted.join(", ")
        ));
    }
    (w.used > w.planned || w.planned > w.bound).then(|| {
        format!(
            "used {} planned {} trace-time bound {} (elements)",
            w.used, w.planned, w.bound
        )
    })
}

/// The environment with the profile's small-seq switch flipped.
fn toggled_env(profile: Profile, env: &EnvView) -> EnvView {
    let mut e = env.clone();
    let (key, on) = match profile {
        Profile::Native => (
            "SMALLSEQ_FORCE_FALLBACK",
            env.get("SMALLSEQ_FORCE_FALLBACK").is_some_and(|v| v != "0"),
        ),
        Profile::Te625 => (
            "NVTE_FUSED_ATTN_CK_SMALLSEQ",
            env.get("NVTE_FUSED_ATTN_CK_SMALLSEQ") == Some("1"),
        ),
    };
    e.set(key, if on { None } else { Some("1") });
    e
}

/// Copies `reference`'s don't-care entries into `out`, so comparisons see only valid rows.
fn mask_dont_care(case: &Case, out: &mut Outputs, reference: &Outputs) {
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let fix3 =
        |o: &mut Option<ndarray::Array3<f64>>, r: &Option<ndarray::Array3<f64>>, valid: &[bool]| {
            if let (Some(o), Some(r)) = (o.as_mut(), r.as_ref()) {
                for (t, v) in valid.iter().enumerate() {
                    if !v && t < o.dim().0 && t < r.dim().0 {
                        o.slice_mut(ndarray::s![t, .., ..])
                            .assign(&r.slice(ndarray::s![t, .., ..]));
                    }
                }
            }
        };
    fix3(&mut out.o, &reference.o, &vq);
    fix3(&mut out.dq, &reference.dq, &vq);
    fix3(&mut out.dk, &reference.dk, &vk);
    fix3(&mut out.dv, &reference.dv, &vk);
    if let (Some(o), Some(r)) = (out.lse.as_mut(), reference.lse.as_ref()) {
        for (t, v) in vq.iter().enumerate() {
            if !v && t < o.dim().0 && t < r.dim().0 {
                o.row_mut(t).assign(&r.row(t));
            }
        }
    }
}

/// Both paths' outputs with the reference in place of each element where that path says what
/// the reference says about the dtype's `limit`: past it, an infinity of the reference's sign
/// or the saturated value (anything else, NaN or a finite value, stays and is compared);
/// within `headroom(tensor)` of it, where one path overflows to the reference's sign and the
/// other is not NaN, both (the finite one is judged against the reference by its own
/// verdict). An infinity left then stands for the saturated value of its sign (as in the
/// tolerance rule); other pairs are compared as they are.
fn near_limit_agreed(
    a: &Outputs,
    b: &Outputs,
    reference: &Outputs,
    limit: f64,
    headroom: impl Fn(&str) -> f64,
) -> (Outputs, Outputs) {
    let (mut a, mut b) = (a.clone(), b.clone());
    let tensors = a
        .rows3_mut()
        .into_iter()
        .zip(b.rows3_mut())
        .zip(reference.rows3());
    for (((name, x), (_, y)), (_, r)) in tensors {
        let (Some(x), Some(y), Some(r)) = (x.as_mut(), y.as_mut(), r) else {
            continue;
        };
        let room = headroom(name).max(0.0);
        let band = limit - room;
        ndarray::Zip::from(x).and(y).and(r).for_each(|x, y, &rv| {
            // Past the limit in the reference, a path may overflow or, its error within its
            // threshold, round to a finite value below the limit (an H200 f16 dK of 65,899
            // rounded to 65,504 by the tiled fallback, to inf by the small-seq kernel: fuzz
            // seed 2093, case 99834): both agree with the reference.
            let past = |v: f64| {
                (v.abs() >= limit && rv.abs() >= limit && v.signum() == rv.signum())
                    || (v.is_finite() && (v - rv).abs() <= room)
            };
            let overflowed = |v: f64| v.is_infinite() && v.signum() == rv.signum();
            if rv.abs() > limit {
                for v in [&mut *x, &mut *y] {
                    if past(*v) {
                        *v = rv;
                    }
                }
            } else if rv.abs() >= band
                && (overflowed(*x) || overflowed(*y))
                && !x.is_nan()
                && !y.is_nan()
            {
                (*x, *y) = (rv, rv);
            }
            // An infinity left says "at or past the limit in its direction", as the tolerance
            // rule reads it: the saturated value of its sign. Each path passed that rule, so the
            // two are then within the sum of their thresholds. The comparison measures one path
            // against the other, and an infinity on the measuring side made the difference
            // infinite (an H200 f16 dK whose threshold of 2.2e6 reached past both limits, both
            // paths passing: "differ by inf", fuzz seed 2095, case 49153).
            if rv.is_finite() {
                for v in [&mut *x, &mut *y] {
                    if v.is_infinite() {
                        *v = v.signum() * limit;
                    }
                }
            }
        });
    }
    (a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{BwdArgs, BwdBufs, FwdArgs, FwdBufs};
    use crate::config::AttnConfig;
    use crate::dispatch::gate::Dispatcher;
    use crate::dispatch::Arch;
    use crate::runner::{Caps, NoKeyRow};
    use ndarray::Array3;
    use smallseq_reference::{Layout, Mask};

    #[test]
    fn numeric_regimes_name_what_the_reference_and_the_emulation_reach() {
        let out = |v: f64| Outputs {
            o: Some(Array3::from_elem((1, 1, 2), v)),
            ..Outputs::default()
        };
        assert_eq!(numeric_regimes(Dtype::F16, &out(1.0), 0), ["in_range"]);
        assert_eq!(numeric_regimes(Dtype::F16, &out(0.0), 0), ["in_range"]);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(70000.0), 2),
            ["output_past_limit", "ds_saturated"]
        );
        // 2^-15 is subnormal in f16 and normal in bf16.
        let tiny = 2f64.powi(-15);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(tiny), 0),
            ["output_subnormal"]
        );
        assert_eq!(numeric_regimes(Dtype::Bf16, &out(tiny), 0), ["in_range"]);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(f64::NEG_INFINITY), 0),
            ["output_past_limit"]
        );
    }

    type FwdHook = Box<dyn Fn(&FwdArgs, &mut FwdBufs) + Send + Sync>;
    type BwdHook = Box<dyn Fn(&BwdArgs, &mut BwdBufs) + Send + Sync>;

    /// The CPU backend with its fallback launches' outputs edited afterwards, and optionally
    /// naming fallback forward kernels: a stand-in for a device backend's quirks.
    struct HookedCpu {
        cpu: CpuBackend,
        kernel_name: Option<fn(&Layout) -> String>,
        after_fwd: FwdHook,
        after_bwd: BwdHook,
    }

    impl HookedCpu {
        fn new() -> Self {
            HookedCpu {
                cpu: CpuBackend::default(),
                kernel_name: None,
                after_fwd: Box::new(|_, _| {}),
                after_bwd: Box::new(|_, _| {}),
            }
        }
    }

    impl Backend for HookedCpu {
        fn name(&self) -> &str {
            "hooked-cpu"
        }
        fn arch(&self) -> Arch {
            self.cpu.arch()
        }
        fn has_small_seq(&self) -> bool {
            true
        }
        fn fallback_fwd_kernel(&self, _: &AttnConfig, layout: &Layout) -> Option<String> {
            self.kernel_name.map(|f| f(layout))
        }
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

    /// A second fallback forward kernel, as CUDA and HIP have: launches whose longest query
    /// side reaches 3 take it, and it rounds `o` differently; `names_kernel`: whether the
    /// backend says which kernel a launch takes.
    fn two_fallback_kernels(names_kernel: bool) -> HookedCpu {
        let mut be = HookedCpu::new();
        if names_kernel {
            be.kernel_name = Some(|l| {
                if l.q.max_len() >= 3 {
                    "tiled"
                } else {
                    "scalar"
                }
                .into()
            });
        }
        be.after_fwd = Box::new(|args, out| {
            if args.layout.q.max_len() >= 3 {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * (1.0 + 1.0 / 64.0));
                }
            }
        });
        be
    }

    /// The second backward launch moves dq's first element by `ulps` f32 ulps: the scaled run
    /// of the scale relation, after the base run.
    fn nudged_second_backward(ulps: u32) -> HookedCpu {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let mut be = HookedCpu::new();
        be.after_bwd = Box::new(move |_, out| {
            if calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 1 {
                let x = &mut out.dq.body_mut()[0];
                *x = f32::from_bits(x.to_bits() + ulps);
            }
        });
        be
    }

    /// The scale relation of an f32 fallback case whose second key scores `second_score`
    /// against the first's 0, on a backend whose scaled run is `ulps` off in one dq element.
    fn scale_relation_with(second_score: f32, ulps: u32) -> Outcome {
        let layout = Layout::packed(&[(2, 2)]);
        let mut cfg = AttnConfig::new(Dtype::F32, 1, 8, Mask::Padding);
        cfg.params.scale = 1.0;
        let mut rng = Rng::new(11);
        let mut t = |n| Array3::from_shape_simple_fn((n, 1, 8), || rng.normal() as f32);
        let (v, d_o) = (t(2), t(2));
        let q = Array3::from_shape_fn((2, 1, 8), |(_, _, d)| if d == 0 { 1.0 } else { 0.5 });
        let k = Array3::from_shape_fn((2, 1, 8), |(c, _, d)| match (c, d) {
            (1, 0) => second_score,
            _ => 0.0,
        });
        let case = Case::new(cfg, layout, q, k, v, Some(d_o)).unwrap();
        let be = nudged_second_backward(ulps);
        let checker = Checker::isolated(&be);
        let base = run_pair(&be, &case, &checker.opts).unwrap();
        assert_eq!(base.fwd.path, Some(Path::Fallback));
        let actual = base.outputs();
        let y = oracle(&case).unwrap();
        let (num, js) = numeric(&case, &actual, &y);
        assert!(matches!(num, Outcome::Pass), "{num:?}");
        checker.scale_relation(&case, &actual, &js, &y)
    }

    #[test]
    fn the_scale_relation_is_exact_unless_an_f32_intermediate_can_go_subnormal() {
        // Scores 0 and -1: nothing small, so one ulp is a failure.
        match scale_relation_with(-1.0, 1) {
            Outcome::Fail(f) => assert!(f.detail.contains("expected exactly"), "{}", f.detail),
            other => panic!("expected a failure, got {other:?}"),
        }
        assert!(matches!(scale_relation_with(-1.0, 0), Outcome::Pass));
        // Scores 0 and -103: P = e^-103 is one f32 quantum, and the subnormal terms it makes
        // may round differently at twice the scale (CUDA fuzz seed 2030, case 13007): one
        // ulp passes, a large change still fails, to tolerance.
        let r = scale_relation_with(-103.0, 1);
        assert!(matches!(r, Outcome::Pass), "{r:?}");
        match scale_relation_with(-103.0, 1 << 16) {
            Outcome::Fail(f) => assert!(f.detail.contains("subnormal range"), "{}", f.detail),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn slot_relations_compare_only_launches_of_one_fallback_kernel() {
        // Head dim 32: the fallback path. The first half has 5 queries (the "tiled" kernel),
        // the second 1 (the "scalar" one), the whole batch 5.
        let layout = Layout::packed(&[(5, 5), (1, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 32, Mask::Padding);
        let mut rng = Rng::new(7);
        let mut t =
            |n| Array3::from_shape_simple_fn((n, 1, 32), || Dtype::Bf16.round(rng.normal() as f32));
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        let (q, k, v) = (t(tq), t(tk), t(tk));
        let case = Case::new(cfg, layout, q, k, v, None).unwrap();
        let split = |names_kernel| {
            let be = two_fallback_kernels(names_kernel);
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::Fallback));
            let parts = [vec![0], vec![1]];
            let actual = base.outputs();
            let y = oracle(&case).unwrap();
            let (_, js) = numeric(&case, &actual, &y);
            checker.slot_relation(&case, &base, &actual, &js, &y, &parts, "splitting")
        };
        // Unnamed, the second launch's other kernel reads as a changed output; named, the
        // launch is compared to tolerance (two thresholds) instead of bitwise.
        assert!(matches!(split(false), Outcome::Fail(_)));
        assert_eq!(split(true), Outcome::Pass);
    }

    /// An external implementation that declares `no_key_row: other` and writes, in a row with
    /// no visible key, 1 / (the launch's longest key side): like JAX XLA, whose such rows
    /// average V over the whole padded key length, so they change when a batch is split.
    struct LaunchDependentNoKeyRows<'a> {
        inner: InProcess<'a>,
        caps: Caps,
    }

    impl Runner for LaunchDependentNoKeyRows<'_> {
        fn name(&self) -> &str {
            "launch-dependent"
        }
        fn caps(&self) -> &Caps {
            &self.caps
        }
        fn provenance(&self) -> BTreeMap<String, String> {
            BTreeMap::new()
        }
        fn dispatcher(&self, _: &RunOptions) -> Option<Dispatcher> {
            None
        }
        fn rounding_budget(&self, _: &str) -> Option<f64> {
            None
        }
        fn fallback_fwd_kernel(&self, _: &AttnConfig, _: &Layout) -> Option<String> {
            None
        }
        fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
            let mut p = self.inner.run_pair(case, opts)?;
            let fill = 1.0 / case.layout.kv.max_len() as f32;
            for r in case.visible_rows().filter(|r| r.keys.is_empty()) {
                p.fwd
                    .o
                    .slice_mut(ndarray::s![r.token, r.head, ..])
                    .fill(fill);
            }
            Ok(p)
        }
        fn run_bwd_from(
            &self,
            case: &Case,
            o: &Array3<f32>,
            lse: &ndarray::Array2<f32>,
            opts: &RunOptions,
        ) -> Result<BwdResult> {
            self.inner.run_bwd_from(case, o, lse, opts)
        }
        fn external(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_split_compares_rows_without_keys_as_the_implementation_declares_them() {
        // Slot 0: 3 queries, 1 key, bottom-right causal: rows 0 and 1 see no key. The whole
        // batch's longest key side is 6, the first half's 1 (JAX XLA seed 17, cases 31, 42:
        // `o[0, 0, 0]` exactly 2x off after a split).
        let layout = Layout::packed(&[(3, 1), (4, 6)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 8, Mask::CausalBottomRight);
        let mut rng = Rng::new(5);
        let mut t =
            |n| Array3::from_shape_simple_fn((n, 1, 8), || Dtype::Bf16.round(rng.normal() as f32));
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        let (q, k, v) = (t(tq), t(tk), t(tk));
        let case = Case::new(cfg, layout, q, k, v, None).unwrap();
        let cpu = CpuBackend::default();
        let split = |declared: NoKeyRow| {
            let inner = InProcess::new(&cpu);
            let mut caps = inner.caps().clone();
            caps.no_key_row = declared;
            let checker = Checker::new(
                Box::new(LaunchDependentNoKeyRows { inner, caps }),
                Checker::isolated(&cpu).opts,
            );
            let base = checker.runner.run_pair(&case, &checker.opts).unwrap();
            let actual = base.outputs();
            let y = oracle(&case).unwrap();
            let (_, js) = numeric(&case, &actual, &y);
            let parts = [vec![0], vec![1]];
            checker.slot_relation(&case, &base, &actual, &js, &y, &parts, "splitting")
        };
        assert_eq!(split(NoKeyRow::Other), Outcome::Pass);
        // Declared as zeros, the same rows are wrong values, and the split shows it.
        assert!(matches!(split(NoKeyRow::Zero), Outcome::Fail(_)));
    }

    #[test]
    fn a_launch_on_another_kernel_is_compared_to_tolerance_not_skipped() {
        // The tiled kernel 25 % off: the base run (5 queries) and the one-slot launch of 5
        // queries carry it, the launch of 1 query does not; the difference is far beyond two
        // thresholds.
        let layout = Layout::packed(&[(5, 5), (1, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 32, Mask::Padding);
        let mut rng = Rng::new(7);
        let mut t =
            |n| Array3::from_shape_simple_fn((n, 1, 32), || Dtype::Bf16.round(rng.normal() as f32));
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        let (q, k, v) = (t(tq), t(tk), t(tk));
        let case = Case::new(cfg, layout, q, k, v, None).unwrap();
        let mut be = two_fallback_kernels(true);
        be.after_fwd = Box::new(|args, out| {
            if args.layout.q.max_len() >= 3 {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * 1.25);
                }
            }
        });
        let checker = Checker::isolated(&be);
        let base = run_pair(&be, &case, &checker.opts).unwrap();
        let actual = base.outputs();
        let y = oracle(&case).unwrap();
        let (_, js) = numeric(&case, &actual, &y);
        let parts = [vec![0], vec![1]];
        match checker.slot_relation(&case, &base, &actual, &js, &y, &parts, "splitting") {
            Outcome::Fail(f) => assert!(f.detail.contains("fallback kernel"), "{}", f.detail),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn near_limit_overflows_drop_out_of_a_path_comparison_and_wrong_values_do_not() {
        let t = |v: [f64; 4]| Some(Array3::from_shape_vec((1, 1, 4), v.to_vec()).unwrap());
        let dq = |o: &Outputs| o.dq.as_ref().unwrap().as_slice().unwrap().to_vec();
        let reference = Outputs {
            dq: t([1.0, 70000.0, -9e4, -63389.0]),
            ..Outputs::default()
        };
        let ss = Outputs {
            dq: t([1.5, 45440.0, -65504.0, -47072.0]),
            ..Outputs::default()
        };
        let fb = Outputs {
            dq: t([1.25, 60000.0, f64::NEG_INFINITY, f64::NEG_INFINITY]),
            ..Outputs::default()
        };
        // Past the limit the saturated value and the right infinity get the reference; 45,440
        // and 60,000 where the reference is 70,000 stay, and are compared.
        let (a, b) = near_limit_agreed(&ss, &fb, &reference, 65504.0, |_| 0.0);
        assert_eq!(dq(&a), [1.5, 45440.0, -9e4, -47072.0]);
        assert_eq!(dq(&b), [1.25, 60000.0, -9e4, -65504.0]);
        // Within the tensor's headroom of the limit (a path's overflow is excused there) too.
        let headroom = |t: &str| if t == "dq" { 2500.0 } else { 0.0 };
        let (a, b) = near_limit_agreed(&ss, &fb, &reference, 65504.0, headroom);
        assert_eq!(dq(&a), [1.5, 45440.0, -9e4, -63389.0]);
        assert_eq!(dq(&b), [1.25, 60000.0, -9e4, -63389.0]);
        // Finite on both sides within the headroom: compared as they are.
        let (a, _) = near_limit_agreed(&ss, &ss, &reference, 65504.0, headroom);
        assert_eq!(dq(&a), [1.5, 45440.0, -9e4, -47072.0]);
        assert!(a.o.is_none() && b.o.is_none());
        // NaN where the reference overflows is not an overflow.
        let nan = Outputs {
            dq: t([1.0, f64::NAN, f64::NAN, f64::NAN]),
            ..Outputs::default()
        };
        let (a, _) = near_limit_agreed(&nan, &fb, &reference, 65504.0, headroom);
        assert!(dq(&a)[1..].iter().all(|x| x.is_nan()), "{:?}", dq(&a));
        // Past the limit, one path overflowing and the other finite within the headroom (an
        // H200 f16 dK of 65,899: inf on the small-seq path, 65,504 on the tiled fallback,
        // headroom 4.2e5; fuzz seed 2093, case 99834): both agree with the reference.
        let one = |x: f64| Outputs {
            dq: t([1.0, x, 1.0, 1.0]),
            ..Outputs::default()
        };
        let reference = one(65899.0);
        let (a, b) = near_limit_agreed(
            &one(f64::INFINITY),
            &one(65504.0),
            &reference,
            65504.0,
            |_| 4.2e5,
        );
        assert_eq!((dq(&a)[1], dq(&b)[1]), (65899.0, 65899.0));
        // Not where the finite value is farther than the headroom from the reference.
        let (_, b) = near_limit_agreed(
            &one(f64::INFINITY),
            &one(-65504.0),
            &reference,
            65504.0,
            |_| 4.2e4,
        );
        assert_eq!(dq(&b)[1], -65504.0);
        // An infinity of either sign where the finite reference lies far inside the limit is the
        // saturated value: wrong by the distance to the limit, not by an infinity that no
        // threshold covers (the tolerance rule reads it so, and passes +inf for -15,822 under
        // a threshold of 1e5).
        let (a, b) = near_limit_agreed(
            &one(f64::INFINITY),
            &one(-15800.0),
            &one(-15822.0),
            65504.0,
            |_| 1e5,
        );
        assert_eq!((dq(&a)[1], dq(&b)[1]), (65504.0, -15800.0));
        let (a, _) = near_limit_agreed(
            &one(f64::NEG_INFINITY),
            &one(1.0),
            &one(1.0),
            65504.0,
            |_| 1e-3,
        );
        assert_eq!(dq(&a)[1], -65504.0);
        // And the comparison fails where 45,440 stands for 70,000: against the reference and
        // against the other path alike.
        let f16 = |actual: Vec<f64>, reference: Vec<f64>| {
            let arr = |v: Vec<f64>| Array3::from_shape_vec((1, 1, 4), v).unwrap().into_dyn();
            super::super::tolerance::judge(&super::super::tolerance::Triple {
                name: "dq",
                actual: arr(actual),
                reference: arr(reference.clone()),
                emulated: arr(reference),
                valid: &[true],
                unit: Dtype::F16.unit_roundoff(),
                min_magnitude: 0.0,
                max_finite: 65504.0,
                min_spacing: Dtype::F16.smallest_subnormal(),
                spacings: super::super::tolerance::FLOOR,
                allowance: None,
                order: None,
            })
        };
        let (a, b) = near_limit_agreed(&ss, &fb, &reference, 65504.0, |_| 0.0);
        assert!(!f16(dq(&a), dq(&reference)).passed());
        assert!(!f16(dq(&a), dq(&b)).passed());
    }

    #[test]
    fn the_rotation_runs_every_relation_over_n_salts() {
        for (slots, gqa, n) in [(3, true, 4), (2, false, 3), (1, true, 2), (1, false, 1)] {
            let mut seen: Vec<&str> = (0..n as u64)
                .flat_map(|salt| chosen_relations(slots, gqa, salt))
                .collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), n, "{slots} slots, gqa {gqa}: {seen:?}");
            assert_eq!(
                chosen_relations(slots, gqa, 7).len(),
                METAMORPHIC_PER_CASE.min(n)
            );
        }
    }

    #[test]
    fn a_write_past_the_plan_inside_a_larger_allocation_fails() {
        use crate::wrapper::WorkspaceReport;
        let w = |used, planned, bound| WorkspaceReport {
            planned,
            used,
            bound,
            corrupted: Vec::new(),
        };
        assert_eq!(workspace_defect(&w(10, 10, 20)), None);
        let d = workspace_defect(&w(12, 10, 20)).unwrap();
        assert!(d.contains("used 12 planned 10"), "{d}");
        assert!(workspace_defect(&w(10, 30, 20)).is_some());
        let mut bad = w(0, 10, 20);
        bad.corrupted.push("workspace[0]".into());
        assert!(workspace_defect(&bad).unwrap().contains("guard band"));
    }

    #[test]
    fn the_forced_fallbacks_own_verdict_fails_fallback_equivalence() {
        // bf16, one slot of 4: small-seq eligible; the fallback's O is 3 % off, within the
        // sum of both paths' thresholds of the small-seq run only if the small-seq path's
        // threshold is large, never within its own.
        let layout = Layout::packed(&[(4, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 64, Mask::Padding);
        let mut rng = Rng::new(3);
        let mut t =
            |n| Array3::from_shape_simple_fn((n, 1, 64), || Dtype::Bf16.round(rng.normal() as f32));
        let (q, k, v) = (t(4), t(4), t(4));
        let case = Case::new(cfg, layout, q, k, v, None).unwrap();
        let verdict = |off: f32| {
            let mut be = HookedCpu::new();
            be.after_fwd = Box::new(move |_, out| {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * (1.0 + off));
                }
            });
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::SmallSeq));
            let actual = base.outputs();
            let y = oracle(&case).unwrap();
            let (_, js) = numeric(&case, &actual, &y);
            checker.fallback_equivalence(&case, &base, &actual, &y, &js)
        };
        assert_eq!(verdict(0.0), Outcome::Pass);
        match verdict(0.03) {
            Outcome::Fail(f) => assert!(
                f.detail.contains("forced fallback against the reference"),
                "{}",
                f.detail
            ),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn the_gqa_relation_allows_the_group_sum_only_on_summed_tensors() {
        // H = 2 on one kv head (g = 2), head dim 32: every run on the fallback path. The MHA
        // equivalent's O is `off` high; O is never summed over the group, so it owes one
        // threshold, not 1 + g.
        let layout = Layout::packed(&[(3, 3)]);
        let mut cfg = AttnConfig::new(Dtype::Bf16, 2, 32, Mask::Padding);
        cfg.params.num_kv_heads = 1;
        let mut rng = Rng::new(5);
        let mut t = |n, h| {
            Array3::from_shape_simple_fn((n, h, 32), || Dtype::Bf16.round(rng.normal() as f32))
        };
        let (q, k, v) = (t(3, 2), t(3, 1), t(3, 1));
        let case = Case::new(cfg, layout, q, k, v, None).unwrap();
        let verdict = |off: f32| {
            let mut be = HookedCpu::new();
            be.after_fwd = Box::new(move |args, out| {
                let p = &args.config.params;
                if p.num_heads == p.num_kv_heads {
                    for x in out.o.body_mut() {
                        *x = Dtype::Bf16.round(*x * (1.0 + off));
                    }
                }
            });
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::Fallback));
            let actual = base.outputs();
            let y = oracle(&case).unwrap();
            let (_, js) = numeric(&case, &actual, &y);
            checker.gqa_relation(&case, &base, &actual, &js, &y)
        };
        assert_eq!(verdict(0.0), Outcome::Pass);
        // About 1.5 thresholds off: within the (1 + g) = 3 once allowed, beyond the one owed.
        match verdict(0.05) {
            Outcome::Fail(f) => {
                assert!(f.detail.contains("o differs"), "{}", f.detail);
                assert!(
                    f.margin < 3.0,
                    "margin {} (the old rule passed it)",
                    f.margin
                );
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
}
