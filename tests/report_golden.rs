//! Speed-ups keep the verdicts (issue 32): a fixed campaign's report, timings left out and
//! floats rounded to 9 significant digits, equals the one stored in `tests/golden/`. A change
//! meant to change verdicts (a new property, a new generator draw) rewrites the file with
//! `SMALLSEQ_BLESS=1 cargo test --release --test report_golden` and says why in its commit;
//! any other difference is a regression of the judge or of the generator.

use smallseq::backend::cpu::CpuBackend;
use smallseq::harness::campaign::{Budget, Campaign};
use smallseq::harness::props::Checker;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

const GOLDEN: &str = "tests/golden/report-cpu-seed11-150.json";

fn rounded(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            let r: f64 = format!("{x:.8e}").parse().unwrap_or(x);
            serde_json::json!(r)
        }
        Value::Array(a) => Value::Array(a.into_iter().map(rounded).collect()),
        Value::Object(m) => Value::Object(m.into_iter().map(|(k, v)| (k, rounded(v))).collect()),
        other => other,
    }
}

#[test]
fn a_fixed_campaign_reports_what_the_golden_file_holds() {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-golden-{}", std::process::id()));
    let be = CpuBackend::default();
    let campaign = Campaign {
        checker: Checker::isolated(&be),
        seed: 11,
        budget: Budget::Cases(150),
        out: out.clone(),
        shrink_budget: Duration::ZERO,
        stop_on_failure: false,
        jobs: 2,
        shard: Default::default(),
    };
    let rep = campaign
        .run(&AtomicBool::new(false), &mut |_| {})
        .expect("the campaign runs");
    let _ = std::fs::remove_dir_all(&out);
    let mut v = serde_json::to_value(&rep).expect("report serialises");
    let obj = v.as_object_mut().expect("an object");
    for timing in ["elapsed_s", "cases_per_s", "stages", "commit", "jobs"] {
        obj.remove(timing);
    }
    let got = serde_json::to_string_pretty(&rounded(v)).expect("serialises") + "\n";
    if std::env::var_os("SMALLSEQ_BLESS").is_some() {
        std::fs::write(GOLDEN, &got).expect("golden file written");
        eprintln!("SMALLSEQ_BLESS: wrote {GOLDEN}");
        return;
    }
    let want =
        std::fs::read_to_string(GOLDEN).expect("the golden file (SMALLSEQ_BLESS=1 writes it)");
    if got != want {
        let first = got
            .lines()
            .zip(want.lines())
            .enumerate()
            .find(|(_, (g, w))| g != w)
            .map(|(i, (g, w))| format!("line {}: got {g}, golden {w}", i + 1))
            .unwrap_or_else(|| "the lengths differ".into());
        panic!(
            "the report of seed 11, 150 cases differs from {GOLDEN} ({first}); if the change \
             is meant to change verdicts, rerun with SMALLSEQ_BLESS=1 and say why"
        );
    }
}
