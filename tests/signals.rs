//! A campaign stopped the way CI stops it still leaves a whole report. `timeout` signals the
//! child, then its whole process group: two signals at once; neither may skip the report.
//! Through workers (`--isolate`) the signal reaches the campaign only (each worker leads its
//! own process group): the report is as whole, every capsule it names readable, and no worker
//! outlives the campaign. SIGKILL cannot be handled: the partial report rewritten every few
//! seconds is what is left.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn dir(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-signals-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()))
}

/// `timeout [-s INT] 3 smallseq fuzz …`, exactly as a CI script would run it: one job, in
/// this process.
fn under_timeout(signal: Option<&str>, out: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["--jobs", "1"];
    args.extend(extra);
    under_timeout_with(signal, 3, out, &args, &[])
}

/// `under_timeout` with the arguments after `--out DIR` all given, and variables added.
fn under_timeout_with(
    signal: Option<&str>,
    secs: u32,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let mut c = Command::new("timeout");
    c.envs(env.iter().copied());
    if let Some(s) = signal {
        c.args(["-s", s]);
    }
    c.arg(secs.to_string())
        .arg(env!("CARGO_BIN_EXE_smallseq"))
        .args(["fuzz", "--time", "300s", "--out"])
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
    // Rewritten as it runs: wait for a later partial report (every 5 s of campaign time; on a
    // loaded machine a fixed 7 s sleep sometimes saw none), then SIGKILL the campaign.
    let cases = || {
        std::fs::read_to_string(out.join("report.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|r| r["cases"].as_u64())
    };
    let start = Instant::now();
    while cases().is_none_or(|n| n <= first) {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "the partial report was not rewritten in 90 s (still {first} cases)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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

/// A variable set on a campaign only to find its processes again: its workers inherit the
/// campaign's environment, and `/proc/PID/environ` shows it whatever the process is called.
#[cfg(target_os = "linux")]
const TAG_VAR: &str = "SMALLSEQ_SIGNALS_TEST_TAG";

/// A tag no other test, run or user shares.
#[cfg(target_os = "linux")]
fn tag(name: &str) -> String {
    format!("{}-{name}", std::process::id())
}

/// Processes alive with `TAG_VAR=tag` in their environment, as "pid command" lines. Zombies
/// (exited, their parent has not reaped them yet) are not counted.
#[cfg(target_os = "linux")]
fn tagged(tag: &str) -> Vec<String> {
    let want = format!("{TAG_VAR}={tag}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc")
        .expect("/proc lists the processes")
        .flatten()
    {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // Unreadable: gone since the listing, or another user's.
        let Ok(environ) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if !environ.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // The state is the first field after the command name's closing parenthesis.
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next());
        if matches!(state, None | Some("Z" | "X")) {
            continue;
        }
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        found.push(format!("{pid} {}", cmd.trim_end()));
    }
    found
}

/// `smallseq repro CAPSULE` without a backend re-judges what the capsule stores: 0 or 1 for
/// a case file it could read, 2 for one it could not.
#[cfg(target_os = "linux")]
fn assert_readable_capsule(path: &Path, what: &str) {
    assert!(path.is_file(), "{what}: {} is missing", path.display());
    let o = Command::new(env!("CARGO_BIN_EXE_smallseq"))
        .arg("repro")
        .arg(path)
        .output()
        .unwrap();
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "{what}: {}: {:?}\n{}",
        path.display(),
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

#[cfg(target_os = "linux")]
#[test]
fn timeout_through_workers_leaves_a_complete_report_and_no_worker() {
    // Each signal with no fault and with a planted panic (crashes, capsules and the shrinking
    // of a crash, which starts workers, when the signals come); and a planted hang, whose
    // worker is in a case the campaign must still time out and kill before it ends.
    // The seeds of the faulting runs have a 7-token query in their first case, so a fault
    // comes before the signals however loaded the machine is.
    let runs: Vec<(Option<&str>, Option<&str>, &str)> = vec![
        (Some("INT"), None, "10"),
        (None, None, "11"),
        (Some("INT"), Some("panic"), "27"),
        (None, Some("panic"), "31"),
        (None, Some("hang"), "51"),
    ];
    let handles: Vec<_> = runs
        .into_iter()
        .map(|(signal, fault, seed)| {
            std::thread::spawn(move || {
                let name = format!(
                    "iso-{}-{}",
                    signal.unwrap_or("TERM"),
                    fault.unwrap_or("none")
                );
                let (out, tag) = (dir(&name), tag(&name));
                let mut extra = vec!["--isolate", "--jobs", "2", "--seed", seed];
                let mut env = vec![(TAG_VAR, tag.as_str())];
                if let Some(f) = fault {
                    extra.extend(["--shrink-time", "60s", "--case-timeout", "2s"]);
                    env.push(("SMALLSEQ_MUTANT_FAULT", f));
                }
                // 6 s: the workers start (the first alone) and the hang run's case 0 takes its
                // 2 s timeout before the signal, even with the whole test suite on two cores
                // (at 3 s a loaded run had not started a case yet: a report of 0 cases).
                let (code, stderr) = under_timeout_with(signal, 6, &out, &extra, &env);
                // Looked for at once: a worker the campaign did not stop before it exited is
                // still there (one reading a closed stdin may be about to exit, but a hung
                // one never will).
                let left = tagged(&tag);
                (name, fault, out, code, stderr, left)
            })
        })
        .collect();
    for h in handles {
        let (what, fault, out, code, stderr, left) = h.join().unwrap();
        assert_eq!(code, Some(124), "{what}\n{stderr}");
        assert!(
            left.is_empty(),
            "{what}: still running: {left:#?}\n{stderr}"
        );
        let rep = json(&out.join("report.json"));
        assert_eq!(rep["interrupted"], true, "{what}: {rep}");
        assert_eq!(rep["partial"], false, "{what}: the final report: {rep}");
        assert!(rep["cases"].as_u64().unwrap() > 0, "{what}");
        assert!(
            rep["worker"]
                .as_str()
                .is_some_and(|w| w.contains(" worker --backend cpu")),
            "{what}: {rep}"
        );
        let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
        assert!(
            junit.contains("<error message=\"interrupted by a signal"),
            "{what}: {junit}"
        );
        assert!(junit.trim_end().ends_with("</testsuite>"), "{what}");
        let failures = rep["failures"].as_array().unwrap();
        match fault {
            None => assert!(failures.is_empty(), "{what}: {rep}"),
            // Case 0 hangs for its 2 s timeout, then again on its rerun: it is in flight when
            // the signals come at 3 s, and what it met must still be reported.
            Some("hang") => assert!(
                failures
                    .iter()
                    .any(|f| f["case"] == 0 && f["property"] == "hang"),
                "{what}: {rep}\n{stderr}"
            ),
            Some(_) => assert!(!failures.is_empty(), "{what}: {rep}\n{stderr}"),
        }
        let mut named = Vec::new();
        for f in failures {
            for key in ["capsule", "shrunk_capsule"] {
                if let Some(p) = f[key].as_str() {
                    assert_readable_capsule(Path::new(p), &what);
                    named.push(PathBuf::from(p));
                }
            }
        }
        // Nothing else in capsules/ either: no capsule half written or left unreported.
        let mut on_disk: Vec<PathBuf> = std::fs::read_dir(out.join("capsules"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        on_disk.sort();
        named.sort();
        assert_eq!(on_disk, named, "{what}");
    }
}

/// The campaign's own status once a signal stops it on workers (130, the shell's for an
/// interrupted command; `timeout` above reports its own 124 instead), and its workers stopped
/// and reaped by it before it exits. This test process is made the subreaper of what it
/// starts, so a worker the campaign left behind becomes this process's child and stays here
/// (running, or a zombie no one reaps): its `/proc` entry outlives the campaign. A worker that
/// would only exit once the campaign's exit closed its stdin is caught too.
#[cfg(target_os = "linux")]
#[test]
fn a_signalled_campaign_on_workers_exits_interrupted_and_reaps_them() {
    // SAFETY: prctl(2) sets a flag of this process; no memory is touched.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let (out, tag) = (dir("iso-direct"), tag("iso-direct"));
    let child = Command::new(env!("CARGO_BIN_EXE_smallseq"))
        .args(["fuzz", "--isolate", "--time", "300s", "--jobs", "2"])
        .args(["--seed", "8", "--out"])
        .arg(&out)
        .env(TAG_VAR, &tag)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let workers = || -> Vec<String> {
        let w = tagged(&tag).into_iter();
        w.filter(|p| p.contains(" worker --backend cpu")).collect()
    };
    // Both workers up, and a first case merged (the first partial report). No case faults
    // (no planted fault), so these two are all the workers it starts.
    while workers().len() < 2 || !out.join("report.json").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no two workers and first report in 60 s: {:#?}",
            tagged(&tag)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pids: Vec<String> = workers()
        .iter()
        .map(|p| p.split(' ').next().unwrap().to_string())
        .collect();
    assert_eq!(pids.len(), 2, "{:#?}", tagged(&tag));
    // SAFETY: kill(2) on the child this test started and has not reaped; no memory is touched.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{stderr}");
    for pid in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
        assert!(
            stat.is_err(),
            "worker {pid} outlived its campaign: {stat:?}\n{stderr}"
        );
    }
    let rep = json(&out.join("report.json"));
    assert_eq!(rep["interrupted"], true, "{rep}");
    assert_eq!(rep["partial"], false, "{rep}");
}
