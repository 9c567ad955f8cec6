//! `crash` and `hang`: verdicts of the worker process, not of the outputs. A fault ends the
//! case (what the worker computed before it is not trusted), so these two are decided around
//! the other properties, by [`super::Checker::check`], rather than among them.

use super::verdict::{fail, skip, CaseRun, Outcome, Prop};
use crate::runner::{Fault, FaultKind};

/// The verdict of a case a worker fault ended: the fault, every other property skipped.
pub(super) fn fault_run(f: Fault) -> CaseRun {
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
    CaseRun::unjudged(outcomes, Some(f))
}

/// A case a worker saw through: both pass, in place of whatever the run put for them (a case
/// in this process has no worker to judge, and leaves them out).
pub(super) fn worker_survived(run: CaseRun) -> CaseRun {
    CaseRun {
        outcomes: run
            .outcomes
            .into_iter()
            .filter(|(p, _)| !matches!(p, Prop::Crash | Prop::Hang))
            .chain([(Prop::Crash, Outcome::Pass), (Prop::Hang, Outcome::Pass)])
            .collect(),
        ..run
    }
}
