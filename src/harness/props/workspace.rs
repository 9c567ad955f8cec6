//! `workspace`: what a launch did with its scratch buffer. A write past the plan lands in
//! whatever the framework put next to the buffer, which no output comparison sees, so the
//! guard bands and the recorded use are checked directly, on the main run and on a run whose
//! dispatch environment changed after the buffer was sized.

use super::checker::{CaseContext, Checker};
use super::verdict::{fail, skip, Outcome, Prop};
use crate::dispatch::{EnvView, Profile};
use crate::error::Error;
use crate::runner::Pair;
use crate::wrapper::{RunOptions, WorkspaceReport};

impl Checker<'_> {
    /// Guards intact, usage within the plan, the plan within the trace-time bound; and the
    /// same when the dispatch environment flips between sizing and launch (a framework that
    /// traced with the variable set and runs without it): the wrapper must re-plan or refuse,
    /// never carve past what was allocated.
    pub(super) fn workspace(&self, cx: &CaseContext<'_>) -> Outcome {
        let (case, base) = (cx.case, cx.base);
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
fn workspace_defect(w: &WorkspaceReport) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_past_the_plan_inside_a_larger_allocation_fails() {
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
}
