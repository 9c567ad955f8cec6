//! The report pages: `report.html` beside every report (passing and failing campaigns, each
//! mutant's), its failure count and pictures, the error picture's worst cell, and
//! `smallseq report` over several runs.

use smallseq::case_file::read_case;
use smallseq::report::heatmap::error_grid;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_smallseq"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-report-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn page(dir: &Path) -> String {
    let p = dir.join("report.html");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn failures_in_json(dir: &Path) -> usize {
    let text = std::fs::read_to_string(dir.join("report.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["failures"].as_array().unwrap().len()
}

fn shown_failures(html: &str) -> usize {
    let at = html.find("id=\"failure-count\">").expect("a failure count") + 19;
    html[at..].split('<').next().unwrap().parse().unwrap()
}

/// Runs the planted bug `mutant` on the CPU; returns its run directory.
fn mutant_run(mutant: &str) -> PathBuf {
    let out = tmp(&format!("mutants-{mutant}"));
    let st = bin()
        .args([
            "mutants", "--cases", "150", "--seed", "1", "--only", mutant, "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    out.join(mutant)
}

#[test]
fn a_passing_campaign_gets_a_self_contained_page_with_a_histogram_per_tensor() {
    let out = tmp("pass");
    let st = bin()
        .args([
            "fuzz", "--cases", "40", "--seed", "5", "--jobs", "2", "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(
        st.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let html = page(&out);
    assert_eq!(shown_failures(&html), 0);
    assert_eq!(failures_in_json(&out), 0);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let hists = json["margin_histograms"].as_object().unwrap();
    for t in ["o", "lse", "dq", "dk", "dv"] {
        let h = &hists[t];
        let counted: u64 = h["counts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .sum::<u64>()
            + h["under"].as_u64().unwrap()
            + h["over"].as_u64().unwrap();
        assert_eq!(
            counted,
            json["margins"][t]["n"].as_u64().unwrap(),
            "{t}: every margin binned"
        );
        assert!(
            html.contains(&format!("{t}: {counted} margins")),
            "{t}: a histogram"
        );
    }
    // Properties with skip reasons, coverage; no script and nothing fetched from outside.
    assert!(html.contains("Why cases were skipped") && html.contains("Coverage per class"));
    assert!(
        !html.contains("<script") && !html.contains("src=\"http") && !html.contains("href=\"http")
    );
    assert!(
        html.matches("<svg").count() >= 7,
        "properties, coverage and five histograms"
    );
}

#[test]
fn a_failure_gets_its_repro_line_next_to_an_error_picture_whose_worst_cell_is_the_verdicts() {
    let dir = mutant_run("kv-head-modulo");
    let html = page(&dir);
    // A mutant run counts every failing case (issue 21), so the page shows what the report
    // holds, at least one.
    assert!(failures_in_json(&dir) >= 1);
    assert_eq!(shown_failures(&html), failures_in_json(&dir));
    // The first failure whose worst tensor is a plain one (o, lse): their errors are raw
    // |actual - reference|, as the tolerance rule measures them (dq, dk lose an allowance).
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let worst_tensor = |p: &Path| {
        let case = read_case(p).unwrap();
        let v: serde_json::Value = serde_json::from_str(&case.meta["smallseq.verdict"]).unwrap();
        v["worst"]["tensor"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let capsule = report["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| PathBuf::from(f["capsule"].as_str().unwrap()))
        .find(|p| ["o", "lse"].contains(&worst_tensor(p).as_str()))
        .expect("a failure whose worst tensor is o or lse");
    assert!(html.contains(&format!("smallseq repro {}", capsule.display())));
    let g = error_grid(&capsule).unwrap();
    let case = read_case(&capsule).unwrap();
    let verdict: serde_json::Value = serde_json::from_str(&case.meta["smallseq.verdict"]).unwrap();
    let w = &verdict["worst"];
    // Plain tensors' errors are raw |actual - reference|, as the tolerance rule measures them.
    assert!(["o", "lse"].contains(&w["tensor"].as_str().unwrap()), "{w}");
    assert_eq!(g.tensor, w["tensor"].as_str().unwrap());
    let (_, token, head) = g.worst().unwrap();
    assert_eq!(
        (token as u64, head as u64),
        (w["token"].as_u64().unwrap(), w["head"].as_u64().unwrap())
    );
    assert!(html.contains(&format!("at token {token}, head {head}")));
    assert_eq!(
        (g.tokens, g.heads),
        (case.layout.q.tokens, case.config.params.num_heads)
    );
}

#[test]
fn report_renders_several_runs_and_refuses_a_missing_one() {
    let a = mutant_run("scale-twice");
    let b = mutant_run("neighbour-slot-read");
    let out = tmp("trend.html");
    let st = bin()
        .arg("report")
        .args([&a, &b])
        .args(["--order", "name", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let html = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        shown_failures(&html),
        failures_in_json(&a) + failures_in_json(&b)
    );
    assert!(html.contains("cases per second") && html.contains("margin percentiles"));
    let (ia, ib) = (
        html.find("<summary>neighbour-slot-read").unwrap(),
        html.find("<summary>scale-twice").unwrap(),
    );
    assert!(ia < ib, "ordered by name");
    let missing = tmp("no-such-run");
    let st = bin()
        .arg("report")
        .arg(&missing)
        .arg("--out")
        .arg(tmp("x.html"))
        .output()
        .unwrap();
    assert_eq!(st.status.code(), Some(2));
    let err = String::from_utf8_lossy(&st.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no-such-run"), "{err}");
}
