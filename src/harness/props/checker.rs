//! The property suite on one case: the main run, its yardstick, then each property in a fixed
//! order. The order is part of the verdict: a case's first failure names its capsule and its
//! report entry, so a new property goes where its place in that order is meant.

use super::fault;
use super::numeric::numeric;
use super::verdict::{fail, skip, CaseRun, Outcome, Prop};
use super::yardstick::{oracle_for, Yardstick};
use crate::backend::Backend;
use crate::case::{Case, Outputs};
use crate::config::Bias;
use crate::design::Design;
use crate::dispatch::EnvView;
use crate::error::{Error, Result};
use crate::harness::tolerance::Judgement;
use crate::runner::{FaultLatch, InProcess, NoKeyRow, Pair, Runner};
use crate::stages::{timed, Stage};
use crate::wrapper::RunOptions;

/// Runs the property suite on one case.
pub struct Checker<'a> {
    pub runner: Box<dyn Runner + 'a>,
    pub opts: RunOptions,
    /// The design to judge against in place of the one the runner declares (`--design`, and
    /// a capsule's recorded design when it is replayed).
    pub design: Option<Design>,
}

/// One case after its main run: what the properties that rerun or compare it start from.
pub struct CaseContext<'c> {
    pub case: &'c Case,
    /// The main run.
    pub base: &'c Pair,
    /// Its outputs.
    pub actual: &'c Outputs,
    pub y: &'c Yardstick,
    /// `numeric_agreement`'s judgements of `actual`: the thresholds a comparison owes.
    pub judgements: &'c [Judgement],
    /// Varies the metamorphic relation and the re-poisoning from case to case.
    pub salt: u64,
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
            design: None,
        }
    }

    /// A checker of `runner` under `opts`.
    pub fn new(runner: Box<dyn Runner + 'a>, opts: RunOptions) -> Self {
        Checker {
            runner,
            opts,
            design: None,
        }
    }

    /// The design the outputs are judged against: `design`, else the runner's declared one,
    /// else the envelope.
    pub fn design(&self) -> Design {
        self.design
            .unwrap_or_else(|| self.runner.caps().judged_design())
    }

    /// A later run of a property failed: a failure, except that an external implementation
    /// declining a derived case (a sub-batch, the MHA equivalent) skips the property.
    pub(super) fn run_failed(&self, prop: Prop, what: &str, e: &Error) -> Outcome {
        match e {
            Error::Unsupported(why) if self.runner.external() => skip(declined(why)),
            e => fail(prop, format!("{what}: {e}")),
        }
    }

    /// The yardstick of `base`'s outputs (the checker's design, following the path its
    /// backward took: [`Yardstick::for_backward`]) and their `numeric_agreement` verdict.
    pub(super) fn judge_base(
        &self,
        case: &Case,
        base: &Pair,
        actual: &Outputs,
    ) -> Result<(Yardstick, Outcome, Vec<Judgement>)> {
        let y = oracle_for(case, self.design())?;
        let followed = match y.for_backward(case, base.fallback().1)? {
            std::borrow::Cow::Owned(o) => Some(o),
            std::borrow::Cow::Borrowed(_) => None,
        };
        let y = followed.unwrap_or(y);
        let declared = self.no_key_rows_as_declared(case, actual);
        let (num, judgements) = numeric(case, declared.as_ref().unwrap_or(actual), &y);
        Ok((y, num, judgements))
    }

    /// `actual` as judged when the implementation declares that a row with no visible key
    /// holds something other than the semantics' zeros (`caps.no_key_row`): those rows of O
    /// and LSE take the semantics' values, and the case's gradients (which such rows feed)
    /// are not judged; `Caps::not_covered` says so in the report. `None`: judged as it is.
    pub(super) fn no_key_rows_as_declared(&self, case: &Case, actual: &Outputs) -> Option<Outputs> {
        if self.runner.caps().no_key_row == NoKeyRow::Zero {
            return None;
        }
        let rows = case.no_key_rows();
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
            design: self.design,
        };
        let run = scoped.check_properties(case, salt)?;
        let in_worker = self.runner.worker_command().is_some();
        Ok(match latch.take() {
            Some(f) => fault::fault_run(f),
            None if in_worker => fault::worker_survived(run),
            None => run,
        })
    }

    /// Every property on `case`. `salt` varies the metamorphic relation and re-poisoning.
    ///
    /// # Errors
    /// Only infrastructure errors (an invalid case); backend failures on a case are recorded
    /// as property failures.
    fn check_properties(&self, case: &Case, salt: u64) -> Result<CaseRun> {
        let mut outcomes = vec![(
            Prop::Eligibility,
            prop_timed(Prop::Eligibility, || self.eligibility(case)),
        )];
        let caps = self.runner.caps();
        if let Some(why) = case.config.unsupported_reason((caps.dropout, caps.bias)) {
            // A dropout or bias the runner does not declare is not run at all: an
            // implementation that computes one without saying so would otherwise fail the
            // case for answering.
            let undeclared = (case.config.params.dropout.is_active() && !caps.dropout)
                || (matches!(case.config.bias, Bias::PostScale(_) | Bias::Alibi) && !caps.bias);
            let run = (!undeclared).then(|| self.runner.run_pair(case, &self.opts));
            let o = match run {
                None => skip(unsupported(&why)),
                Some(Err(Error::Unsupported(said))) => skip(format!(
                    "{}; the implementation: {}",
                    unsupported(&why),
                    said.replace(':', " -")
                )),
                Some(Err(e)) => fail(
                    Prop::NumericAgreement,
                    format!("expected an unsupported error, got: {e}"),
                ),
                Some(Ok(_)) => fail(
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
                    skip(unsupported(&why))
                };
                outcomes.push((p, o));
            }
            return Ok(CaseRun::unjudged(outcomes, None));
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
                return Ok(CaseRun::unjudged(outcomes, None));
            }
            Err(e) => {
                outcomes.push((
                    Prop::NumericAgreement,
                    fail(Prop::NumericAgreement, format!("backend error: {e}")),
                ));
                return Ok(CaseRun::unjudged(outcomes, None));
            }
        };
        let actual = base.outputs();
        let (y, num, judgements) = self.judge_base(case, &base, &actual)?;
        outcomes.push((Prop::NumericAgreement, num));
        let cx = CaseContext {
            case,
            base: &base,
            actual: &actual,
            y: &y,
            judgements: &judgements,
            salt,
        };
        outcomes.push((
            Prop::EmulationConformance,
            prop_timed(Prop::EmulationConformance, || {
                self.emulation_conformance(&cx)
            }),
        ));
        outcomes.push((
            Prop::RoundingBias,
            prop_timed(Prop::RoundingBias, || self.rounding_bias(&cx)),
        ));
        outcomes.push((
            Prop::Workspace,
            prop_timed(Prop::Workspace, || self.workspace(&cx)),
        ));
        outcomes.push((
            Prop::DontCare,
            prop_timed(Prop::DontCare, || self.dont_care(&cx)),
        ));
        outcomes.push((
            Prop::Determinism,
            prop_timed(Prop::Determinism, || self.determinism(&cx)),
        ));
        outcomes.push((
            Prop::FallbackEquivalence,
            prop_timed(Prop::FallbackEquivalence, || self.fallback_equivalence(&cx)),
        ));
        outcomes.push((
            Prop::Metamorphic,
            prop_timed(Prop::Metamorphic, || self.metamorphic(&cx)),
        ));
        Ok(CaseRun {
            outcomes,
            path_fwd: base.fwd.path,
            path_bwd: base.bwd.as_ref().and_then(|b| b.path),
            regimes: y.regimes.clone(),
            judgements,
            outputs: actual,
            fault: None,
        })
    }
}

/// The skip reason of a case outside the semantics (`AttnConfig::unsupported_reason`): the
/// report's key names the feature (`unsupported dropout`), the detail after the colon.
fn unsupported(why: &str) -> String {
    let feature = why.split_whitespace().next().unwrap_or("feature");
    format!("unsupported {feature}: {why}")
}

/// `f`, the work of property `p`, timed as its stage.
fn prop_timed(p: Prop, f: impl FnOnce() -> Outcome) -> Outcome {
    timed(Stage::Property(p.name()), f)
}

/// The skip reason of a case an external implementation declined; report keys end at the
/// first colon, so the implementation's words keep theirs out.
fn declined(why: &str) -> String {
    format!(
        "declined by the implementation ({})",
        why.replace(':', " -")
    )
}

#[cfg(test)]
mod tests {
    use super::super::test_backends::bf16_case;
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::config::AttnConfig;
    use smallseq_reference::{Dtype, Layout, Mask};

    /// The skips of every property but eligibility and the worker's crash and hang.
    fn skips(run: &CaseRun) -> Vec<(Prop, String)> {
        run.outcomes
            .iter()
            .filter(|(p, _)| !matches!(p, Prop::Eligibility | Prop::Crash | Prop::Hang))
            .map(|(p, o)| match o {
                Outcome::Skip { reason } => (*p, reason.clone()),
                other => panic!("{p}: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_case_outside_the_semantics_is_skipped_under_the_feature_it_uses() {
        let mut cfg = AttnConfig::new(Dtype::Bf16, 1, 32, Mask::Padding);
        cfg.bias = crate::config::Bias::Other("pre_scale_bias".into());
        let case = bf16_case(cfg, Layout::packed(&[(3, 4)]), 1);
        let be = CpuBackend::default();
        let run = Checker::isolated(&be).check(&case, 0).unwrap();
        for (p, reason) in skips(&run) {
            assert!(
                reason.starts_with("unsupported bias: bias = pre_scale_bias is outside"),
                "{p}: {reason}"
            );
        }
    }

    /// The CPU backend computes dropout, so its dropout cases are judged; a backend that does
    /// not declare it has them skipped under `unsupported dropout` without a run.
    #[test]
    fn dropout_is_judged_where_the_runner_computes_it_and_skipped_elsewhere() {
        let mut cfg = AttnConfig::new(Dtype::Bf16, 2, 32, Mask::Padding);
        cfg.params.dropout = smallseq_reference::Dropout {
            p: 0.5,
            seed: 42,
            offset: 7,
        };
        let case = bf16_case(cfg, Layout::packed(&[(3, 4), (5, 5)]), 1);
        let be = CpuBackend::default();
        let run = Checker::isolated(&be).check(&case, 0).unwrap();
        let numeric = run
            .outcomes
            .iter()
            .find(|(p, _)| *p == Prop::NumericAgreement)
            .map(|(_, o)| o.clone());
        assert_eq!(numeric, Some(Outcome::Pass));
        assert!(run
            .outcomes
            .iter()
            .all(|(_, o)| !matches!(o, Outcome::Fail(_))));
        let hooked = super::super::test_backends::HookedCpu::new();
        // Run anyway, a backend that does not compute dropout refuses it with a typed error.
        match crate::runner::run_pair(&hooked, &case, &RunOptions::default()) {
            Err(Error::Unsupported(why)) => assert!(why.contains("dropout = 0.5"), "{why}"),
            other => panic!("expected unsupported, got {:?}", other.map(|_| ())),
        }
        let run = Checker::isolated(&hooked).check(&case, 0).unwrap();
        for (p, reason) in skips(&run) {
            assert!(
                reason.starts_with(
                    "unsupported dropout: dropout = 0.5: this implementation does not compute"
                ),
                "{p}: {reason}"
            );
        }
    }
}
