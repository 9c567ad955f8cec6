//! `smallseq triage` end to end: campaigns with planted bugs (in the CPU backend, and in a
//! Python adapter run as a worker) triaged into groups with verdicts, clauses and standalone
//! scripts that run; a campaign without failures triaged empty; and the verdicts a replay
//! decides (an irreproducible failure is the harness's, a range limit the design's).

#[path = "support/python_kit.rs"]
mod python_kit;
use python_kit::python_kit;

use smallseq::case_file::read_case;
use smallseq::harness::props::Checker;
use smallseq::harness::triage::Signature;
use smallseq::harness::triage_verdict::{judge, Replay, Verdict};
use smallseq::mutants::Mutant;
use smallseq::runner::InProcess;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_smallseq"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-triage-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    eprintln!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The Python that triage writes scripts with (`SMALLSEQ_PYTHON`, else python3).
fn python() -> String {
    smallseq::harness::triage_script::python()
}

fn campaign(out: &Path, extra: &[&str]) {
    let mut cmd = bin();
    cmd.args(["fuzz", "--seed", "1", "--jobs", "1", "--out"])
        .arg(out)
        .args(extra);
    let o = run(&mut cmd);
    assert!(o.status.code().is_some_and(|c| c <= 1), "fuzz: {o:?}");
}

/// A campaign of `cases` cases with scale-twice planted in the CPU backend (several groups),
/// its failures shrunk for `shrink`; the folder and its failure count.
fn planted_campaign(name: &str, cases: &str, shrink: &str) -> (PathBuf, usize) {
    let dir = tmp(name);
    let flags = [
        "--plant",
        "scale-twice",
        "--cases",
        cases,
        "--shrink-time",
        shrink,
    ];
    campaign(&dir, &flags);
    let failures = read_json(&dir.join("report.json"))["failures"]
        .as_array()
        .unwrap()
        .len();
    (dir, failures)
}

/// A campaign through the adapter kit's numpy reference with a planted off-by-one in the key
/// length, run as a worker, its failures shrunk for `shrink` by the campaign; `None` (and a
/// SKIP line) without a Python that has numpy and safetensors.
fn planted_exec_campaign(name: &str, cases: &str, shrink: &str) -> Option<PathBuf> {
    if python_kit().is_none() {
        println!("SKIP: no Python with numpy and safetensors (SMALLSEQ_PYTHON)");
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let planted = root.join("adapters/tests/planted.py");
    let worker = format!("{} {} --plant last-key", python(), planted.display());
    let dir = tmp(name);
    let flags = ["--backend", "exec", "--worker", &worker, "--cases", cases];
    campaign(&dir, &[&flags[..], &["--shrink-time", shrink]].concat());
    Some(dir)
}

/// Removes the folders a test wrote.
fn remove(dirs: &[&Path]) {
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Runs a group's standalone script, which must reproduce the failure (exit 1).
fn script_reproduces(script: &str) {
    if python_kit().is_none() {
        println!("SKIP: running {script}: no Python with numpy and safetensors (SMALLSEQ_PYTHON)");
        return;
    }
    let o = run(Command::new(python()).arg(script));
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{script}: {text}");
    assert!(text.contains("REPRODUCED"), "{text}");
}

#[test]
fn a_planted_bug_triages_as_defects_with_their_clause_and_scripts() {
    let dir = tmp("planted");
    // No shrinking in the campaign: triage shrinks the representatives itself.
    campaign(
        &dir,
        &[
            "--plant",
            "scale-twice",
            "--cases",
            "8",
            "--shrink-time",
            "0s",
        ],
    );
    let report = read_json(&dir.join("report.json"));
    let failures = report["failures"].as_array().unwrap().len();
    assert!(failures > 0, "the planted bug must fail some case");
    let o = run(bin().args(["triage", "--shrink-time", "3s"]).arg(&dir));
    assert_eq!(o.status.code(), Some(1), "defects found: exit 1");
    let t = read_json(&dir.join("triage.json"));
    let groups = t["groups"].as_array().unwrap();
    assert!(!groups.is_empty());
    let counted: u64 = groups.iter().map(|g| g["count"].as_u64().unwrap()).sum();
    assert_eq!(counted as usize, failures, "every failure in one group");
    for g in groups {
        assert_eq!(g["finding"]["verdict"], "defect", "{g}");
        let clause = g["finding"]["clause"].as_str().unwrap();
        assert!(clause.starts_with("docs/semantics.md §1."), "{clause}");
        if g["signature"]["tensor"] == "lse" {
            assert!(clause.contains("§1.4 The LSE convention"), "{clause}");
        }
        let evidence = g["finding"]["evidence"].to_string();
        assert!(
            evidence.contains("with scale-twice planted") && evidence.contains("fails again"),
            "{evidence}"
        );
        assert!(Path::new(g["representative"].as_str().unwrap()).is_file());
        assert!(g["repro"].as_str().unwrap().contains(" repro "), "{g}");
    }
    assert!(
        groups.iter().any(|g| g["shrunk_here"] == true),
        "an unshrunk representative is shrunk by triage"
    );
    let md = std::fs::read_to_string(dir.join("triage.md")).unwrap();
    assert!(md.contains("- verdict: **defect**") && md.contains("- breaks: docs/semantics.md"));
    // The scripts need numpy alone; without it, the group says why it has none.
    if python_kit().is_none() {
        let note = groups[0]["script_note"].as_str().unwrap_or_default();
        assert!(
            note.contains("numpy") && note.contains("SMALLSEQ_PYTHON"),
            "{note}"
        );
        println!("SKIP: writing the scripts: no Python with numpy and safetensors");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let script = groups[0]["script"].as_str().unwrap_or_else(|| {
        panic!("no script: {}", groups[0]["script_note"]);
    });
    assert!(Path::new(script).is_file());
    script_reproduces(script);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_campaign_without_failures_triages_to_nothing_and_exits_0() {
    let dir = tmp("clean");
    campaign(&dir, &["--cases", "3"]);
    let report = read_json(&dir.join("report.json"));
    assert!(report["failures"].as_array().unwrap().is_empty());
    // A report writes an infinite margin as null (a TE #625 model campaign's lse of inf):
    // triage reads the failures, not the margins.
    let mut nulls = report.clone();
    for (_, p) in nulls["margins"].as_object_mut().unwrap().iter_mut() {
        for (_, v) in p.as_object_mut().unwrap().iter_mut() {
            *v = serde_json::Value::Null;
        }
    }
    std::fs::write(dir.join("report.json"), nulls.to_string()).unwrap();
    let out = tmp("clean-out");
    let o = run(bin().arg("triage").arg(&dir).arg("--out").arg(&out));
    assert_eq!(o.status.code(), Some(0));
    let t = read_json(&out.join("triage.json"));
    assert!(t["groups"].as_array().unwrap().is_empty());
    let md = std::fs::read_to_string(out.join("triage.md")).unwrap();
    assert!(md.contains("nothing to triage"), "{md}");
    // A folder without a report: a usage error naming the file.
    let o = run(bin().arg("triage").arg(tmp("none")));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("report.json"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&out);
}

/// The replay decides: the same capsule rerun on the CPU backend without its planted bug
/// passes, an irreproducible failure and so a harness error; with the bug it is a defect; and
/// a group listed among the range limits is a design or range limit.
#[test]
fn the_replay_and_the_range_limit_list_decide_the_verdict() {
    let dir = tmp("replay");
    campaign(
        &dir,
        &[
            "--plant",
            "scale-twice",
            "--cases",
            "3",
            "--shrink-time",
            "1s",
        ],
    );
    let report = read_json(&dir.join("report.json"));
    let f = &report["failures"][0];
    let cap = f["shrunk_capsule"]
        .as_str()
        .or(f["capsule"].as_str())
        .unwrap();
    let case = read_case(Path::new(cap)).unwrap();
    let detail = f["detail"].as_str().unwrap();
    let mut sig = Signature {
        implementation: "cpu".into(),
        property: f["property"].as_str().unwrap().into(),
        tensor: smallseq::harness::triage::tensor_of(detail),
        class: smallseq::harness::triage::signature_class(&case),
        pattern: smallseq::harness::triage::pattern(detail),
        range_limit: false,
    };
    let salt = if cap.ends_with("-shrunk.safetensors") {
        0
    } else {
        smallseq::harness::repro::Recorded::of(&case, cap)
            .unwrap()
            .replay
            .unwrap()
            .salt
    };
    let verdict = |planted: &[Mutant], sig: &Signature| {
        let be = smallseq::backend::open_planted("cpu", planted).unwrap();
        let checker = Checker::new(Box::new(InProcess::new(be.as_ref())), Default::default());
        let replay = Replay {
            checker: &checker,
            salt,
            through: "the cpu backend".into(),
        };
        judge(sig, detail, &case, Some(&replay), "")
    };
    let clean = verdict(&[], &sig);
    assert_eq!(clean.verdict, Verdict::HarnessError, "{clean:?}");
    assert!(
        clean.evidence.iter().any(|e| e.contains("irreproducible")),
        "{clean:?}"
    );
    let planted = verdict(&[Mutant::ScaleTwice], &sig);
    assert_eq!(planted.verdict, Verdict::Defect, "{planted:?}");
    sig.range_limit = true;
    assert_eq!(
        verdict(&[], &sig).verdict,
        Verdict::DesignOrRangeLimit,
        "a listed range limit"
    );
    // No replay at hand: the stored outputs, re-judged here, still fail: a defect.
    sig.range_limit = false;
    let stored = judge(&sig, detail, &case, None, "no backend");
    assert_eq!(stored.verdict, Verdict::Defect, "{stored:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An outside implementation (the adapter kit's numpy reference with a planted off-by-one in
/// the key length, run as a worker): replayed through the recorded worker, and its script
/// embeds the adapter and reproduces the failure with numpy alone.
#[test]
fn an_exec_campaign_triages_through_its_worker_and_scripts_its_adapter() {
    let Some(dir) = planted_exec_campaign("exec", "6", "2s") else {
        return;
    };
    let o = run(bin().arg("triage").arg(&dir).arg("--shrink-time").arg("2s"));
    assert_eq!(o.status.code(), Some(1));
    let t = read_json(&dir.join("triage.json"));
    let groups = t["groups"].as_array().unwrap();
    assert!(!groups.is_empty());
    let g = &groups[0];
    assert_eq!(g["finding"]["verdict"], "defect", "{g}");
    assert!(
        g["finding"]["evidence"]
            .to_string()
            .contains("replayed through the worker"),
        "{g}"
    );
    assert!(
        g["repro"].as_str().unwrap().ends_with("--backend exec"),
        "{g}"
    );
    let script = g["script"].as_str().unwrap();
    let text = std::fs::read_to_string(script).unwrap();
    assert!(
        text.contains("SOURCES['planted']"),
        "the adapter is embedded"
    );
    script_reproduces(script);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The groups of a triage.json as (signature, count, verdict, clause), in their order.
fn verdicts(t: &serde_json::Value) -> Vec<String> {
    (t["groups"].as_array().unwrap().iter())
        .map(|g| {
            format!(
                "{} x{} {} {}",
                g["signature"], g["count"], g["finding"]["verdict"], g["finding"]["clause"]
            )
        })
        .collect()
}

/// Cut off by its `--time` (here at once), triage still writes every group: those it finished
/// with their verdicts, the others as not triaged, each failure in one group; and it says it
/// was interrupted.
#[test]
fn a_triage_cut_off_by_its_time_writes_every_group_it_reached_and_names_the_rest() {
    let (dir, failures) = planted_campaign("cut", "8", "0s");
    let out = tmp("cut-out");
    let o = run(bin()
        .arg("triage")
        .arg(&dir)
        .args(["--out"])
        .arg(&out)
        .args(["--jobs", "1", "--time", "0s", "--shrink-time", "5s"]));
    assert_eq!(o.status.code(), Some(130), "interrupted by its time");
    let t = read_json(&out.join("triage.json"));
    let groups = t["groups"].as_array().unwrap();
    assert!(
        groups.len() >= 2,
        "the planted campaign makes several groups"
    );
    let counted: u64 = groups.iter().map(|g| g["count"].as_u64().unwrap()).sum();
    assert_eq!(counted as usize, failures, "every failure in one group");
    let late: Vec<_> = (groups.iter())
        .filter(|g| g["finding"]["verdict"] == "not_triaged")
        .collect();
    assert!(!late.is_empty(), "{t}");
    // What was reached was reached largest first: no triaged group after an untriaged one.
    let first_late = (groups.iter())
        .position(|g| g["finding"]["verdict"] == "not_triaged")
        .unwrap();
    assert!(groups[first_late..]
        .iter()
        .all(|g| g["finding"]["verdict"] == "not_triaged"));
    let md = std::fs::read_to_string(out.join("triage.md")).unwrap();
    assert!(md.contains("not triaged (time)"), "{md}");
    remove(&[&dir, &out]);
}

/// SIGTERM (what `timeout` sends) mid-triage: the groups finished before it keep their
/// verdicts on disk, the rest are named, and the files are whole JSON and Markdown.
#[test]
fn a_signal_mid_triage_keeps_the_finished_groups() {
    let Some(dir) = planted_exec_campaign("signal", "12", "0s") else {
        return;
    };
    let out = tmp("signal-out");
    // One job, long shrinks and a worker slowed to 0.3 s a call: the signal lands mid-group.
    let mut child = bin()
        .env("SMALLSEQ_PLANTED_DELAY", "0.3")
        .arg("triage")
        .arg(&dir)
        .arg("--out")
        .arg(&out)
        .args(["--jobs", "1", "--shrink-time", "60s"])
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(4));
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: signals the child this test started, by its id.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    let t = read_json(&out.join("triage.json"));
    let groups = t["groups"].as_array().unwrap();
    assert!(!groups.is_empty());
    // The group in flight stopped shrinking and was judged; the rest were not reached.
    assert_ne!(groups[0]["finding"]["verdict"], "not_triaged", "{t}");
    assert!(Path::new(groups[0]["representative"].as_str().unwrap()).is_file());
    let md = std::fs::read_to_string(out.join("triage.md")).unwrap();
    assert!(md.starts_with("# Triage of "), "{md}");
    remove(&[&dir, &out]);
}

/// Every group's representative, shrunk by the campaign or by triage, lies in triage's own
/// folder, so the campaigns can stay behind: it still replays with the campaign removed.
#[test]
fn representatives_are_copied_beside_the_triage_and_replay_without_the_campaign() {
    let (dir, _) = planted_campaign("copied", "6", "1s");
    let out = tmp("copied-out");
    let o = run(bin().arg("triage").arg(&dir).arg("--out").arg(&out));
    assert_eq!(o.status.code(), Some(1));
    let t = read_json(&out.join("triage.json"));
    let groups = t["groups"].as_array().unwrap();
    assert!(!groups.is_empty());
    assert!(
        groups.iter().any(|g| g["shrunk_here"] == false),
        "a representative the campaign shrank is copied, not shrunk again: {t}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    for g in groups {
        let rep = PathBuf::from(g["representative"].as_str().unwrap());
        assert!(rep.starts_with(out.join("triage")), "{}", rep.display());
        if g["shrunk_here"] == false {
            let src = g["source"].as_str().unwrap();
            assert!(src.starts_with(dir.to_str().unwrap()), "{src}");
        }
        assert!(g["repro"].as_str().unwrap().contains(rep.to_str().unwrap()));
        // Re-judged from its stored outputs alone: the failure is still there.
        let o = run(bin().arg("repro").arg(&rep));
        assert_eq!(o.status.code(), Some(1), "{}", rep.display());
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Groups triaged side by side (sharing one worker pool per implementation) get the same
/// groups, in the same order, with the same verdicts as one at a time.
#[test]
fn concurrent_triage_gives_the_verdicts_of_one_job() {
    let (dir, _) = planted_campaign("jobs", "8", "0s");
    let mut dirs = vec![dir.clone()];
    // Through a worker too, where there is a Python: its groups share one pool.
    dirs.extend(planted_exec_campaign("jobs-exec", "6", "0s"));
    let triage = |jobs: &str| {
        let out = tmp(&format!("jobs-out-{jobs}"));
        let o = run(bin()
            .arg("triage")
            .args(&dirs)
            .arg("--out")
            .arg(&out)
            .args(["--jobs", jobs, "--shrink-time", "0s"]));
        assert_eq!(o.status.code(), Some(1));
        let t = read_json(&out.join("triage.json"));
        let _ = std::fs::remove_dir_all(&out);
        t
    };
    let one = verdicts(&triage("1"));
    assert!(one.len() >= 2, "{one:?}");
    assert_eq!(verdicts(&triage("4")), one);
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A hang's representative is replayed under the case timeout its capsule records (2 s here),
/// as `repro` reruns it, not under the default of its size (30 s and more): the replay hangs
/// again and the group is a defect, in a fraction of the default.
#[test]
fn a_hang_replays_under_its_recorded_case_timeout() {
    let dir = tmp("hang");
    let mut cmd = bin();
    cmd.args([
        "fuzz",
        "--isolate",
        "--cases",
        "4",
        "--seed",
        "3",
        "--jobs",
        "1",
    ])
    .args(["--case-timeout", "2s", "--shrink-time", "0s", "--out"])
    .arg(&dir)
    .env("SMALLSEQ_MUTANT_FAULT", "hang");
    let o = run(&mut cmd);
    assert_eq!(o.status.code(), Some(1), "the campaign met its hangs");
    let started = std::time::Instant::now();
    let out = tmp("hang-triage");
    let o = run(bin()
        .args(["triage", "--jobs", "1", "--shrink-time", "0s", "--out"])
        .arg(&out)
        .arg(&dir)
        .env_remove("SMALLSEQ_MUTANT_FAULT"));
    let took = started.elapsed();
    assert_eq!(
        o.status.code(),
        Some(1),
        "a hang that hangs again is a defect"
    );
    let t = read_json(&out.join("triage.json"));
    let hang = t["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["signature"]["property"] == "hang")
        .expect("a hang group");
    assert_eq!(hang["finding"]["verdict"], "defect", "{hang}");
    assert!(
        hang["finding"]["evidence"].to_string().contains("2.0 s"),
        "rerun with the recorded timeout: {hang}"
    );
    assert!(took.as_secs() < 25, "triage took {took:?}");
    remove(&[&dir, &out]);
}

/// A wrong LSE that is the reference's with one key's visibility flipped names the key: the
/// varlen FlashAttention capsule (H100, torch 2.11, seed 29 group 22; window (4, −1) hides no
/// key of its 7 × 5 slot) stores query 0's LSE as the log-sum-exp without one of keys 1, 3
/// and 4 (equal scores), and triage's verdict then cites §1.5 with that line. The reference's
/// own LSE names nothing, and a key the window hides, let in, is named as such.
#[test]
fn a_wrong_lse_one_key_off_names_the_key() {
    use smallseq::harness::props::oracle;
    use smallseq::harness::triage_keys::one_key_off;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/capsules/stored");
    let case =
        read_case(&dir.join("varlen-flash-bf16-window-row0-key-dropped.safetensors")).unwrap();
    let line = one_key_off(&case, 0, 0).expect("row 0 is one key off");
    assert!(
        line.contains("with key 1 or 3 or 4 of the slot left out") && line.contains("2.1180"),
        "{line}"
    );
    for t in 1..7 {
        assert_eq!(one_key_off(&case, t, 0), None, "row {t} is right");
    }
    let detail = "lse: max error 1.341e-1 > threshold 3.679e-6 (emulation error 4.877e-7)";
    let sig = Signature {
        implementation: "torch-varlen-flash".into(),
        property: "numeric_agreement".into(),
        tensor: "lse".into(),
        class: smallseq::harness::triage::signature_class(&case),
        pattern: smallseq::harness::triage::pattern(detail),
        range_limit: false,
    };
    let f = judge(&sig, detail, &case, None, "no worker here");
    assert_eq!(f.verdict, Verdict::Defect);
    assert!(
        f.clause.as_deref().unwrap_or("").contains("§1.5") && f.evidence.contains(&line),
        "{:?}",
        f.evidence
    );
    // The right LSE names nothing.
    let mut right = case.clone();
    right.outputs.lse = oracle(&case).unwrap().reference.lse;
    assert_eq!(one_key_off(&right, 0, 0), None);
    // Under window (1, −1) query 6 sees keys 3 and 4 only; its LSE under (2, −1), which also
    // sees key 2, is that key let in.
    let with_window = |left: i64| {
        let mut c = case.clone();
        c.config.params.window.left = left;
        c
    };
    let mut tight = with_window(1);
    let wider = oracle(&with_window(2)).unwrap().reference.lse.unwrap();
    tight.outputs.lse.as_mut().unwrap()[(6, 0)] = wider[(6, 0)];
    let line = one_key_off(&tight, 6, 0).expect("row 6 has one key too many");
    assert!(line.contains("with key 2 of the slot let in"), "{line}");
}
