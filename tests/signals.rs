//! A campaign stopped the way CI stops it still leaves a whole report. `timeout` signals the
//! child, then its whole process group: two signals at once; neither may skip the report.
//! SIGKILL cannot be handled: the partial report rewritten every few seconds is what is left.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir()
        .join(format!("smallseq-signals-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()))
}

/// `timeout [-s INT] 3 smallseq fuzz …`, exactly as a CI script would run it.
fn under_timeout(signal: Option<&str>, out: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut c = Command::new("timeout");
    if let Some(s) = signal {
        c.args(["-s", s]);
    }
    c.arg("3")
        .arg(env!("CARGO_BIN_EXE_smallseq"))
        .args(["fuzz", "--time", "300s", "--jobs", "1", "--out"])
        .arg(out)
        .args(extra);
    let o = c.output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn timeout_with_int_or_term_always_leaves_a_complete_interrupted_report() {
    // Four runs per signal, at once; half of them shrinking a planted bug's failure when the
    // signals come (a second signal may cut shrinking short, never the report).
    let runs: Vec<(Option<&str>, usize)> = [Some("INT"), None]
        .into_iter()
        .flat_map(|s| (0..4).map(move |i| (s, i)))
        .collect();
    let handles: Vec<_> = runs
        .into_iter()
        .map(|(signal, i)| {
            std::thread::spawn(move || {
                let out = dir(&format!("{}-{i}", signal.unwrap_or("TERM")));
                let seed = (10 + i).to_string();
                let mut extra = vec!["--seed", seed.as_str()];
                if i % 2 == 1 {
                    extra.extend(["--plant", "scale-twice", "--shrink-time", "60s"]);
                }
                let (code, stderr) = under_timeout(signal, &out, &extra);
                (signal, i, out, code, stderr)
            })
        })
        .collect();
    for h in handles {
        let (signal, i, out, code, stderr) = h.join().unwrap();
        let what = format!("timeout -s {} run {i}", signal.unwrap_or("TERM"));
        // timeout's own status for a command it had to stop.
        assert_eq!(code, Some(124), "{what}\n{stderr}");
        let rep = json(&out.join("report.json"));
        assert_eq!(rep["interrupted"], true, "{what}: {rep}");
        assert_eq!(
            rep["partial"], false,
            "{what}: the final report, not a partial one"
        );
        assert!(rep["cases"].as_u64().unwrap() > 0, "{what}");
        assert!(
            rep["command"]
                .as_str()
                .unwrap()
                .contains(" fuzz --time 300s"),
            "{what}"
        );
        if i % 2 == 1 {
            assert!(!rep["failures"].as_array().unwrap().is_empty(), "{what}");
        }
        let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
        assert!(
            junit.contains("<error message=\"interrupted by a signal"),
            "{what}: {junit}"
        );
        assert!(junit.trim_end().ends_with("</testsuite>"), "{what}");
        let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
        assert!(
            summary.contains("INTERRUPTED") || summary.contains("**FAILED**"),
            "{what}: {summary}"
        );
    }
}

#[test]
fn sigkill_leaves_the_last_partial_report() {
    let out = dir("kill");
    let mut child = Command::new(env!("CARGO_BIN_EXE_smallseq"))
        .args([
            "fuzz", "--time", "300s", "--jobs", "1", "--seed", "6", "--out",
        ])
        .arg(&out)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The first partial report comes with the first case, the next 5 s of campaign time later.
    let start = Instant::now();
    while !out.join("report.json").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no partial report in 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let first = json(&out.join("report.json"))["cases"].as_u64().unwrap();
    std::thread::sleep(Duration::from_secs(7));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let rep = json(&out.join("report.json"));
    assert_eq!(rep["partial"], true, "{rep}");
    assert!(
        rep["cases"].as_u64().unwrap() > first,
        "rewritten as it ran: {rep}"
    );
    let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
    assert!(junit.contains("<error message=\"partial report"), "{junit}");
}
