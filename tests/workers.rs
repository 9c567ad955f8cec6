//! Worker processes end to end (`docs/worker-protocol.md`): the same report through workers
//! for any `--jobs` and `--devices`; planted crashes, aborts and hangs each cost their case
//! only (capsule, rerun on a fresh worker, exit 1) and the printed repro command faults again;
//! a fault that does not recur on the rerun is called flaky; shards merge into the unsharded
//! report; workers that break the protocol are clear errors.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_smallseq"))
}

fn out_dir(tag: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-workers-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn fuzz(args: &[&str], out: &Path, env: &[(&str, &str)]) -> Output {
    let mut c = bin();
    c.arg("fuzz").args(args).arg("--out").arg(out);
    c.args(["--shrink-time", "0"]);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("smallseq runs")
}

fn report(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("report.json")).expect("report.json");
    serde_json::from_str(&text).expect("report is JSON")
}

/// The parts of a report that must not depend on jobs, workers or shards.
fn verdict(r: &Value) -> Value {
    let failures: Vec<Value> = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            // The stderr tail names process ids.
            let detail = f["detail"]
                .as_str()
                .unwrap()
                .split("; stderr")
                .next()
                .unwrap();
            serde_json::json!([f["case"], f["property"], detail])
        })
        .collect();
    let mut props = r["properties"].clone();
    // Only worker runs can count crashes and hangs.
    for p in ["crash", "hang"] {
        props.as_object_mut().unwrap().remove(p);
    }
    serde_json::json!({
        "cases": r["cases"], "properties": props, "skip_reasons": r["skip_reasons"],
        "coverage": r["coverage"], "paths": r["paths"], "margins": r["margins"],
        "largest_margins": r["largest_margins"], "blind_verdicts": r["blind_verdicts"],
        "indeterminate_verdicts": r["indeterminate_verdicts"], "failures": failures,
    })
}

#[test]
fn workers_judge_like_the_process_for_any_jobs() {
    let inproc = out_dir("inproc");
    let o = fuzz(
        &["--cases", "24", "--seed", "11", "--jobs", "1"],
        &inproc,
        &[],
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let want = verdict(&report(&inproc));
    assert!(report(&inproc)["protocol_overhead_us"].is_null());
    for jobs in ["1", "3"] {
        let dir = out_dir(&format!("iso{jobs}"));
        let o = fuzz(
            &["--isolate", "--cases", "24", "--seed", "11", "--jobs", jobs],
            &dir,
            &[],
        );
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let r = report(&dir);
        assert_eq!(verdict(&r), want, "jobs {jobs}");
        assert_eq!(r["properties"]["crash"]["pass"], 24);
        assert!(r["worker"]
            .as_str()
            .unwrap()
            .contains("worker --backend cpu"));
        // every answered request: at least one per case (its forward and backward)
        let overhead = &r["protocol_overhead_us"];
        assert!(overhead["n"].as_u64().unwrap() >= 24, "{overhead}");
        assert!(overhead["p50"].as_f64().unwrap() >= 0.0, "{overhead}");
        assert!(
            std::fs::read_to_string(dir.join("summary.md"))
                .unwrap()
                .contains("Protocol overhead per worker request"),
            "jobs {jobs}"
        );
    }
}

/// `verdict` with the crash and hang counts, for comparing worker campaigns with each other.
fn worker_verdict(r: &Value) -> Value {
    serde_json::json!([
        verdict(r),
        r["properties"]["crash"],
        r["properties"]["hang"]
    ])
}

/// `--devices` spreads the workers round-robin over the devices (a CPU worker takes
/// `--device N` and has one device to run on): which worker judged a case must change no
/// verdict and no case's place in the report.
#[test]
fn spreading_workers_over_devices_changes_no_verdict() {
    // A planted panic puts crashes, their reruns and their case order into what is compared.
    let env = [("SMALLSEQ_MUTANT_FAULT", "panic")];
    let run = |tag: &str, extra: &[&str]| {
        let dir = out_dir(tag);
        let mut args = vec!["--isolate", "--cases", "24", "--seed", "3"];
        args.extend(extra);
        let o = fuzz(&args, &dir, &env);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{tag}: {stderr}");
        (report(&dir), stderr)
    };
    let (want, stderr) = run("nodevices", &["--jobs", "3"]);
    assert!(stderr.contains("on device(s) 0,0,0;"), "{stderr}");
    assert!(
        !want["failures"].as_array().unwrap().is_empty(),
        "the planted panic fires in these cases: {want}"
    );
    for (devices, jobs, placed) in [("0,1", "3", "0,1,0"), ("1,0", "2", "1,0")] {
        let (r, stderr) = run(
            &format!("devices{}", devices.replace(',', "")),
            &["--devices", devices, "--jobs", jobs],
        );
        // The placement is what was asked for, so the comparison below is not vacuous.
        assert!(
            stderr.contains(&format!("on device(s) {placed};")),
            "--devices {devices}: {stderr}"
        );
        assert_eq!(
            worker_verdict(&r),
            worker_verdict(&want),
            "--devices {devices} --jobs {jobs}"
        );
        // The report names the first worker's command: a CPU worker told `--device 1` ran.
        let first = devices.split(',').next().unwrap();
        assert!(
            r["worker"]
                .as_str()
                .unwrap()
                .contains(&format!("--device {first} ")),
            "{}",
            r["worker"]
        );
    }
}

/// A campaign with a planted worker fault: exit 1, one failure per triggering case with its
/// capsule, each called `how` (`deterministic` or `flaky`) by its rerun on a fresh worker,
/// every other case judged, and the printed repro line, replaying the fault the capsule
/// records, faults again. Returns the report.
fn planted_fault(mode: &str, prop: &str, how: &str) -> Value {
    let dir = out_dir(mode);
    let env = [("SMALLSEQ_MUTANT_FAULT", mode)];
    let args = [
        "--isolate",
        "--cases",
        "20",
        "--seed",
        "3",
        "--jobs",
        "2",
        "--case-timeout",
        "2s",
    ];
    let o = fuzz(&args, &dir, &env);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let r = report(&dir);
    let failures = r["failures"].as_array().unwrap();
    assert!(!failures.is_empty(), "{stderr}");
    for f in failures {
        assert_eq!(f["property"], prop, "{f}");
        assert!(
            f["detail"].as_str().unwrap().contains(&format!("({how}: ")),
            "the rerun on a fresh worker calls it {how}: {f}"
        );
        assert!(Path::new(f["capsule"].as_str().unwrap()).is_file());
    }
    let n = failures.len() as u64;
    let judged = &r["properties"]["numeric_agreement"];
    assert_eq!(
        judged["pass"].as_u64().unwrap()
            + judged["fail"].as_u64().unwrap()
            + judged["skip"].as_u64().unwrap(),
        20,
        "every case is counted"
    );
    assert_eq!(r["properties"][prop]["fail"].as_u64().unwrap(), n);
    assert_eq!(r["properties"][prop]["pass"].as_u64().unwrap(), 20 - n);
    // The printed command, run exactly as printed (without the variable: the capsule records
    // it, and a hang's capsule its 2 s case timeout, which the rerun waits and no longer than
    // the default's 30 s).
    let line = failures[0]["repro"].as_str().unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert!(
        words[0].ends_with("smallseq") && words[1] == "repro",
        "{line}"
    );
    let mut c = Command::new(words[0]);
    c.args(&words[1..]);
    c.env_remove("SMALLSEQ_MUTANT_FAULT");
    let started = std::time::Instant::now();
    let o = c.output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    if prop == "hang" {
        assert!(
            text.contains("with its case timeout of 2.0 s"),
            "the rerun takes the recorded timeout: {text}"
        );
        assert!(started.elapsed().as_secs() < 25, "{:?}", started.elapsed());
    }
    assert!(
        text.contains(&format!("SMALLSEQ_MUTANT_FAULT={mode}\n")),
        "the capsule records the fault as it was planted: {text}"
    );
    assert!(text.contains(&format!("{prop}: FAIL")), "{text}");
    r
}

#[test]
fn a_panicking_worker_costs_its_cases_only() {
    planted_fault("panic", "crash", "deterministic");
}

#[test]
fn an_aborting_worker_costs_its_cases_only() {
    planted_fault("abort", "crash", "deterministic");
}

#[test]
fn a_hanging_worker_is_killed_and_costs_its_cases_only() {
    planted_fault("hang", "hang", "deterministic");
}

/// A fault on the first attempt at a case only (`panic-once`): the rerun on a fresh worker
/// completes, so each triggering case is a flaky crash, with its capsule, and the campaign
/// still exits 1. Every case that triggers is one of them: the rerun's runs derived from the
/// case do not fault either.
#[test]
fn a_fault_that_does_not_recur_on_a_fresh_worker_is_flaky() {
    let flaky = planted_fault("panic-once", "crash", "flaky");
    // The same campaign with the fault on every attempt (planted_fault's arguments).
    let dir = out_dir("panic-always");
    let args = ["--isolate", "--cases", "20", "--seed", "3", "--jobs", "2"];
    let o = fuzz(&args, &dir, &[("SMALLSEQ_MUTANT_FAULT", "panic")]);
    assert_eq!(o.status.code(), Some(1));
    let cases = |r: &Value| -> Vec<Value> {
        let f = r["failures"].as_array().unwrap();
        f.iter().map(|f| f["case"].clone()).collect()
    };
    assert_eq!(cases(&flaky), cases(&report(&dir)));
}

#[test]
fn shards_merge_into_the_unsharded_report() {
    let env = [("SMALLSEQ_MUTANT_FAULT", "panic")];
    let whole = out_dir("whole");
    let base = ["--isolate", "--cases", "30", "--seed", "3", "--jobs", "2"];
    let o = fuzz(&base, &whole, &env);
    assert_eq!(o.status.code(), Some(1));
    let mut dirs = Vec::new();
    for i in 0..3 {
        let d = out_dir(&format!("shard{i}"));
        let shard = format!("{i}/3");
        let mut args = base.to_vec();
        args.extend(["--shard", &shard]);
        let o = fuzz(&args, &d, &env);
        assert!(o.status.code() == Some(0) || o.status.code() == Some(1));
        dirs.push(d);
    }
    let merged = out_dir("merged");
    let o = bin()
        .arg("merge")
        .args(&dirs)
        .arg("--out")
        .arg(&merged)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (a, b) = (report(&whole), report(&merged));
    assert_eq!(verdict(&a), verdict(&b));
    for f in b["failures"].as_array().unwrap() {
        let cap = f["capsule"].as_str().unwrap();
        assert!(cap.starts_with(&merged.display().to_string()) && Path::new(cap).is_file());
        assert!(f["repro"].as_str().unwrap().contains(cap));
    }
    // A shard missing is refused, naming it.
    let o = bin()
        .arg("merge")
        .args(&dirs[..2])
        .arg("--out")
        .arg(out_dir("partial"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("2/3"));
}

/// A worker command running `script` with sh, from a file (no quoting to get wrong).
fn sh_worker(tag: &str, script: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-fake-{tag}-{}.sh", std::process::id()));
    std::fs::write(&p, script).unwrap();
    format!("sh {}", p.display())
}

#[test]
fn workers_that_break_the_protocol_are_clear_errors() {
    let cases = [
        ("garbage", "echo hello; sleep 5", "not a handshake"),
        (
            "version",
            r#"echo '{"protocol": "smallseq-worker/9", "name": "x"}'; sleep 5"#,
            "smallseq-worker/9",
        ),
        ("exits", "exit 3", "exited with status 3"),
    ];
    for (tag, script, says) in cases {
        let dir = out_dir("bad");
        let worker = sh_worker(tag, script);
        let o = fuzz(
            &["--backend", "exec", "--worker", &worker, "--cases", "3"],
            &dir,
            &[],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{script}: {err}");
        assert!(err.contains(says), "{script}: {err}");
        assert_eq!(
            err.lines().filter(|l| l.starts_with("smallseq:")).count(),
            1,
            "{err}"
        );
    }
    // A worker answering another request id crashes the case, never hangs the campaign.
    let dir = out_dir("badid");
    let hs = r#"{"protocol":"smallseq-worker/1","name":"liar","caps":{"dtypes":["f32"],"layouts":["thd"],"masks":["padding"]}}"#;
    let script =
        format!("echo '{hs}'\nwhile read l; do echo '{{\"id\": 999, \"ok\": true}}'; done\n");
    let worker = sh_worker("liar", &script);
    let o = fuzz(
        &[
            "--backend",
            "exec",
            "--worker",
            &worker,
            "--cases",
            "2",
            "--jobs",
            "1",
        ],
        &dir,
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let r = report(&dir);
    assert_eq!(r["failures"][0]["property"], "crash", "{r}");
    assert!(
        r["failures"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("while 1 was in flight"),
        "{r}"
    );
    let nc = r["not_covered"].as_array().unwrap();
    assert!(
        nc.iter().any(|l| l.as_str().unwrap().contains("backward")),
        "{r}"
    );
}

/// The runs of a case that share its inputs name one case file, which the worker reads once:
/// the same verdicts, judgements and outputs as a fresh file per run, with fewer files.
#[test]
fn reused_case_files_judge_like_fresh_ones() {
    use smallseq::dispatch::{EnvView, Profile};
    use smallseq::harness::campaign::case_seed;
    use smallseq::harness::fit::fit_to_caps;
    use smallseq::harness::gen::{build, draw_geometry_for};
    use smallseq::harness::props::Checker;
    use smallseq::harness::rng::Rng;
    use smallseq::runner::Runner;
    use smallseq::worker::{Pool, PoolConfig, SpawnFor};
    use smallseq::wrapper::RunOptions;
    use std::time::Duration;

    let open = |reuse_inputs| {
        Pool::open(PoolConfig {
            spawn: SpawnFor::InTree {
                exe: env!("CARGO_BIN_EXE_smallseq").into(),
                backend: "cpu".into(),
                profile: "native".into(),
                env: Vec::new(),
            },
            jobs: 1,
            devices: None,
            case_timeout: None,
            start_timeout: Duration::from_secs(120),
            in_tree: Some("cpu".into()),
            reuse_inputs,
        })
        .expect("a CPU worker starts")
    };
    let opts = RunOptions {
        env: EnvView::default(),
        ..RunOptions::default()
    };
    let (fresh, reused) = (open(false), open(true));
    let (a, b) = (
        Checker::new(Box::new(&fresh), opts.clone()),
        Checker::new(Box::new(&reused), opts),
    );
    let seed = 11;
    println!("seed {seed}");
    let (mut judged, mut on_small_seq) = (0, 0);
    for i in 0..16 {
        let cs = case_seed(seed, i);
        let mut rng = Rng::new(cs);
        let mut g = draw_geometry_for(&mut rng, Profile::Native);
        fit_to_caps(&mut g, fresh.caps(), &mut rng).unwrap();
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let (x, y) = (a.check(&case, cs).unwrap(), b.check(&case, cs).unwrap());
        assert_eq!(x.outcomes, y.outcomes, "case {i}");
        assert_eq!(
            serde_json::to_value(&x.judgements).unwrap(),
            serde_json::to_value(&y.judgements).unwrap(),
            "case {i}"
        );
        assert!(x.outputs.bitwise_eq(&y.outputs), "case {i}");
        judged += 1;
        on_small_seq += usize::from(x.path_fwd.is_some_and(|p| p.name() == "small_seq"));
    }
    assert_eq!(judged, 16);
    assert!(on_small_seq > 0, "no case ran the runs that share inputs");
    let (f, r) = (fresh.case_files_written(), reused.case_files_written());
    assert!(r < f, "reused {r} case files, fresh {f}");
    println!("case files: {f} fresh, {r} reused");
}

/// Issue 37's planted fault on one device only (`ci/fault-on-device.sh`), through CPU workers
/// told their device: the faulting device's cases crash, the other device's are judged, and
/// the same wrapper naming a device the campaign does not use changes nothing.
#[test]
fn a_fault_planted_on_one_device_costs_its_cases_not_the_other_devices() {
    let wrapper = concat!(env!("CARGO_MANIFEST_DIR"), "/ci/fault-on-device.sh");
    let exe = env!("CARGO_BIN_EXE_smallseq");
    let run = |tag: &str, device: &str| {
        let dir = out_dir(tag);
        let worker = format!(
            "{wrapper} {device} SMALLSEQ_MUTANT_FAULT=panic-always {exe} worker --backend cpu"
        );
        let args = [
            "--backend",
            "exec",
            "--worker",
            &worker,
            "--devices",
            "0,1",
            "--jobs",
            "2",
            "--cases",
            "40",
            "--seed",
            "3",
        ];
        let o = fuzz(&args, &dir, &[]);
        (
            o.status.code(),
            report(&dir),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, r, err) = run("fault-dev1", "1");
    assert_eq!(code, Some(1), "{err}");
    let failures = r["failures"].as_array().unwrap();
    assert!(!failures.is_empty(), "{r}");
    assert!(failures.iter().all(|f| f["property"] == "crash"), "{r}");
    assert!(
        r["properties"]["numeric_agreement"]["pass"]
            .as_u64()
            .unwrap()
            > 0,
        "{r}"
    );
    let (code, r, err) = run("fault-dev5", "5");
    assert_eq!(code, Some(0), "{err}");
    assert!(r["failures"].as_array().unwrap().is_empty(), "{r}");
}
