//! A campaign's report does not depend on how many cases it checks at once: cases are merged
//! in order, so `--jobs` changes the speed, never the verdict, the counts or which failure is
//! reported first.

use smallseq::backend::cpu::CpuBackend;
use smallseq::backend::Backend;
use smallseq::harness::campaign::{Budget, Campaign, Report};
use smallseq::harness::props::Checker;
use smallseq::mutants::{Defects, Mutant};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

fn campaign_json(be: &dyn Backend, jobs: usize, cases: u64, stop_on_failure: bool) -> String {
    let out = std::env::temp_dir().join(format!(
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
    };
    let mut rep: Report = campaign
        .run(&AtomicBool::new(false), &mut |_| {})
        .expect("campaign runs");
    rep.elapsed_s = 0.0;
    rep.cases_per_s = 0.0;
    // Shrinking runs to a time budget: how far it gets depends on the machine's speed.
    for f in &mut rep.failures {
        assert!(f.shrunk_capsule.is_some(), "case {} was not shrunk", f.case);
        f.shrunk_size = None;
    }
    let text = serde_json::to_string(&rep).expect("report serialises");
    let _ = std::fs::remove_dir_all(&out);
    // Capsule paths name the output directory, which differs per run.
    text.replace(&out.display().to_string(), "OUT")
}

#[test]
fn clean_campaign_reports_agree_for_any_jobs() {
    let be = CpuBackend::default();
    let one = campaign_json(&be, 1, 60, false);
    assert!(one.contains(r#""cases":60"#), "{one}");
    for jobs in [2, 3, 8] {
        assert_eq!(campaign_json(&be, jobs, 60, false), one, "jobs {jobs}");
    }
}

#[test]
fn failing_campaign_reports_agree_for_any_jobs() {
    // A bug most cases expose: every failure, its capsule name and shrunk size must match.
    let be = CpuBackend::mutant(Defects::of(&[Mutant::ScaleTwice]));
    let one = campaign_json(&be, 1, 30, false);
    assert!(one.contains(r#""property":"#), "no failure: {one}");
    assert_eq!(campaign_json(&be, 4, 30, false), one);
    // Stopping at the first failure: the same case number and case count.
    let first = campaign_json(&be, 1, 30, true);
    assert_eq!(campaign_json(&be, 4, 30, true), first);
}
