//! A campaign's report does not depend on how many cases it checks at once: cases are merged
//! in order, so `--jobs` changes the speed, never the verdict, the counts or which failure is
//! reported first.

use smallseq::backend::cpu::CpuBackend;
use smallseq::backend::{BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use smallseq::dispatch::Arch;
use smallseq::harness::campaign::{Budget, Campaign};
use smallseq::harness::props::Checker;
use smallseq::mutants::{Defects, Mutant};

#[path = "support/campaign_json.rs"]
mod campaign_json;
use campaign_json::campaign_json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

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

/// The CPU backend, but every small-seq forward after the first `after` panics.
struct PanicsAfter {
    cpu: CpuBackend,
    after: usize,
    calls: AtomicUsize,
}

impl BackendInfo for PanicsAfter {
    fn name(&self) -> &str {
        "panics-after"
    }
    fn arch(&self) -> Arch {
        self.cpu.arch()
    }
    fn has_small_seq(&self) -> bool {
        true
    }
    fn concurrent_cases(&self) -> bool {
        true
    }
}

impl MutationHooks for PanicsAfter {}

impl Compute for PanicsAfter {
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> smallseq::Result<()> {
        if self.calls.fetch_add(1, Ordering::SeqCst) >= self.after {
            panic!("planted panic");
        }
        self.cpu.small_seq_fwd(args, out)
    }
    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> smallseq::Result<()> {
        self.cpu.fallback_fwd(args, out)
    }
    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> smallseq::Result<()> {
        self.cpu.small_seq_bwd(args, out)
    }
    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> smallseq::Result<()> {
        self.cpu.fallback_bwd(args, out)
    }
}

/// A worker's panic is its case's error: the campaign ends with it, and does not hang with
/// the other workers waiting on a case that will never be merged.
#[test]
fn a_panicking_case_ends_a_parallel_campaign_with_its_error() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let be = PanicsAfter {
            cpu: CpuBackend::default(),
            after: 5,
            calls: AtomicUsize::new(0),
        };
        let campaign = Campaign {
            checker: Checker::isolated(&be),
            seed: 3,
            budget: Budget::Cases(100_000),
            out: std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("smallseq-panics-{}", std::process::id())),
            shrink_budget: Duration::ZERO,
            stop_on_failure: false,
            jobs: 3,
            shard: Default::default(),
        };
        let r = campaign.run(&AtomicBool::new(false), &mut |_| {});
        let _ = tx.send(r.map(|rep| rep.cases).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Err(e)) => assert!(e.contains("panicked: planted panic"), "{e}"),
        Ok(Ok(cases)) => panic!("the campaign ended cleanly after {cases} cases"),
        Err(_) => panic!("the campaign hung after a worker's panic"),
    }
}

/// Range limits (issue 31) are listed apart from failures: a report holding one is not failed,
/// its summary says what it is, and the shard merge keeps it.
#[test]
fn range_limits_are_listed_apart_and_do_not_fail_the_report() {
    let be = CpuBackend::default();
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-range-limit-{}", std::process::id()));
    let campaign = Campaign {
        checker: Checker::isolated(&be),
        seed: 5,
        budget: Budget::Cases(3),
        out: out.clone(),
        shrink_budget: Duration::ZERO,
        stop_on_failure: false,
        jobs: 1,
        shard: Default::default(),
    };
    let mut rep = campaign
        .run(&AtomicBool::new(false), &mut |_| {})
        .expect("campaign runs");
    let _ = std::fs::remove_dir_all(&out);
    rep.range_limits
        .push(smallseq::harness::campaign::FailureEntry {
            case: 2,
            property: "numeric_agreement".into(),
            detail: "range limit of a 16-bit design, not a defect: dq at 4 element(s)".into(),
            capsule: "capsules/case-000002-range_limit.safetensors".into(),
            shrunk_capsule: None,
            shrunk_size: None,
            repro: String::new(),
        });
    assert!(!rep.failed());
    let md = smallseq::harness::report_io::markdown(&rep);
    assert!(
        md.contains("Range limits of a 16-bit design, not defects (1 case(s)"),
        "{md}"
    );
    assert!(md.contains("| 2 | range limit of a 16-bit design"), "{md}");
    let json = serde_json::to_value(&rep).unwrap();
    assert_eq!(json["range_limits"][0]["case"], 2);
}
