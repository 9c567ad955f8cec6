//! A campaign's report as JSON text with what depends on the machine taken out (timings, the
//! jobs it ran with, how far shrinking got, the output directory), so that two runs of one
//! seed compare equal exactly when their verdicts, counts and failures are the same.

use smallseq::backend::Backend;
use smallseq::harness::campaign::{Budget, Campaign, Report};
use smallseq::harness::props::Checker;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Campaign of `cases` cases of seed 17 on `be` with `jobs` at once.
pub fn campaign_json(be: &dyn Backend, jobs: usize, cases: u64, stop_on_failure: bool) -> String {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "smallseq-campaign-{}-{jobs}-{stop_on_failure}-{}",
        be.name(),
        std::process::id()
    ));
    let campaign = Campaign {
        checker: Checker::isolated(be),
        seed: 17,
        budget: Budget::Cases(cases),
        out: out.clone(),
        shrink_budget: Duration::from_secs(1),
        stop_on_failure,
        jobs,
        shard: Default::default(),
    };
    let mut rep: Report = campaign
        .run(&AtomicBool::new(false), &mut |_| {})
        .expect("campaign runs");
    // The stage profile (issue 32) covers the stages every judged case passes through, and
    // its shares add up to the whole; it is timing, so it leaves the comparison.
    for stage in ["generation", "backend", "reference", "emulation", "judging"] {
        assert!(
            rep.stages.contains_key(stage),
            "no stage {stage}: {:?}",
            rep.stages.keys()
        );
    }
    let total: f64 = rep.stages.values().map(|s| s.share).sum();
    assert!((total - 1.0).abs() < 1e-9, "shares add to {total}");
    rep.stages.clear();
    rep.elapsed_s = 0.0;
    rep.cases_per_s = 0.0;
    // The report records the jobs it ran with; everything else must not depend on them.
    rep.jobs = 0;
    // Shrinking runs to a time budget: how far it gets depends on the machine's speed.
    for f in &mut rep.failures {
        f.shrunk_size = None;
        f.shrunk_capsule = None;
        f.repro.clear();
    }
    let text = serde_json::to_string(&rep).expect("report serialises");
    let _ = std::fs::remove_dir_all(&out);
    // Capsule paths name the output directory, which differs per run.
    text.replace(&out.display().to_string(), "OUT")
}
