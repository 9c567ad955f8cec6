//! Every failure a campaign prints comes with a repro command; executed as printed (from
//! another shell: no `smallseq` on PATH, none of the campaign's dispatch variables set), it
//! must fail again with the same property. One campaign per backend and profile runnable
//! here: the CPU backend with planted bugs, and the TE #625 model under the te625 profile
//! (whose `NVTE_FUSED_ATTN_CK_SMALLSEQ=1` the campaign defaults and the capsule must carry).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dir(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-repro-fidelity-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A shell that has never heard of this build: a PATH without it, no dispatch variables.
fn bare(mut c: Command) -> Command {
    c.env("PATH", "/usr/bin:/bin")
        .env_remove("NVTE_FUSED_ATTN_CK_SMALLSEQ")
        .env_remove("SMALLSEQ_FORCE_FALLBACK")
        .env_remove("SMALLSEQ_KERNEL_DEFINES");
    c
}

/// `(property, repro command)` of every failure line the campaign printed: the progress lines
/// on stderr (the capsule as found) and the summary on stdout (the shrunk capsule where one
/// was written).
fn printed_failures(out: &Output) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for stream in [&out.stdout, &out.stderr] {
        let text = String::from_utf8_lossy(stream);
        let mut property = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("FAIL case ") {
                let p = rest.split('[').nth(1).and_then(|r| r.split(']').next());
                property = p.map(String::from);
            } else if let Some(cmd) = line.trim_start().strip_prefix("repro:") {
                let p = property.take().expect("a repro line follows its FAIL line");
                found.push((p, cmd.trim().to_string()));
            }
        }
    }
    found
}

/// Runs the campaign, replays every printed repro line, and returns the output directory.
fn campaign_reproduces(name: &str, args: &[&str]) -> PathBuf {
    let out_dir = dir(name);
    let mut c = bare(Command::new(env!("CARGO_BIN_EXE_smallseq")));
    c.arg("fuzz").args(args).arg("--out").arg(&out_dir);
    let out = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{name}: the campaign must fail\n{stderr}"
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("report.json")).unwrap()).unwrap();
    let failures = report["failures"].as_array().unwrap();
    let printed = printed_failures(&out);
    let shrunk = failures
        .iter()
        .filter(|f| !f["shrunk_capsule"].is_null())
        .inspect(|f| {
            let size = &f["shrunk_size"];
            assert!(size["slots"].as_u64().unwrap() >= 1, "{f}");
            assert!(size["max_tokens"].is_u64(), "{f}");
        })
        .count();
    assert_eq!(
        printed.len(),
        2 * failures.len(),
        "{name}: one repro line per failure as found and one in the summary\n{stderr}"
    );
    let mut wrong = Vec::new();
    for (property, cmd) in &printed {
        assert!(
            !cmd.starts_with("smallseq "),
            "{name}: `smallseq` is not on PATH, yet the line starts with it: {cmd}"
        );
        let run = bare(Command::new("sh")).args(["-c", cmd]).output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(
            stdout.starts_with("replaying the capsule's inputs: "),
            "{name}: {cmd}\n{stdout}"
        );
        if run.status.code() != Some(1) || !stdout.contains(&format!("{property}: FAIL")) {
            wrong.push(format!(
                "{cmd} (expected {property} to fail; exit {:?})\n{stdout}{}",
                run.status.code(),
                String::from_utf8_lossy(&run.stderr)
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: {} of {} printed repro commands do not reproduce ({} failures, {shrunk} \
         shrunk):\n{}",
        wrong.len(),
        printed.len(),
        failures.len(),
        wrong.join("\n")
    );
    out_dir
}

#[test]
fn cpu_with_planted_bugs_every_printed_repro_reproduces() {
    // Bugs that fail different properties: numbers, the gate, the don't-care outputs.
    for (name, plant) in [
        ("scale", "scale-twice"),
        ("gate", "gate-limit-16"),
        ("dont-care", "dont-care-not-zeroed"),
    ] {
        campaign_reproduces(
            name,
            &[
                "--plant",
                plant,
                "--cases",
                "12",
                "--seed",
                "4",
                "--shrink-time",
                "1s",
            ],
        );
    }
}

/// The TE model under its profile; then `repro --current-env` with the path switched off in
/// this shell runs TE's fallback, which has none of the small-seq defects: a capsule that
/// fails under the replayed environment passes there, so the environment is what was replayed.
#[test]
fn te625_model_every_printed_repro_reproduces_and_current_env_uses_the_shells() {
    let out_dir = campaign_reproduces(
        "te625",
        &[
            "--backend",
            "te625-model",
            "--profile",
            "te625",
            "--cases",
            "16",
            "--seed",
            "3",
            "--shrink-time",
            "1s",
        ],
    );
    let mut capsules: Vec<PathBuf> = std::fs::read_dir(out_dir.join("capsules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_string_lossy().contains("shrunk"))
        .collect();
    capsules.sort();
    let replay = |capsule: &Path, extra: &[&str]| {
        let mut c = bare(Command::new(env!("CARGO_BIN_EXE_smallseq")));
        c.arg("repro")
            .arg(capsule)
            .args(["--backend", "te625-model"]);
        c.args(extra).env("NVTE_FUSED_ATTN_CK_SMALLSEQ", "0");
        c.output().unwrap()
    };
    let mut passed_off = 0;
    for cap in &capsules {
        let replayed = replay(cap, &[]);
        let text = String::from_utf8_lossy(&replayed.stdout);
        assert!(
            text.lines()
                .next()
                .unwrap()
                .contains("env NVTE_FUSED_ATTN_CK_SMALLSEQ=1"),
            "{text}"
        );
        assert_eq!(replayed.status.code(), Some(1), "{}: {text}", cap.display());
        let off = replay(cap, &["--current-env"]);
        let text = String::from_utf8_lossy(&off.stdout);
        assert!(text.contains("(--current-env)"), "{text}");
        passed_off += usize::from(off.status.code() == Some(0));
    }
    assert!(
        passed_off > 0,
        "no capsule passes with the small-seq path switched off in the shell"
    );
}

/// An implementation outside the tree (`--backend exec`): the capsule records the worker
/// command, so the printed line (`--backend exec`, no `--worker`) reruns the case through the
/// same worker; and a crash capsule replayed with no `--backend` at all is rerun where it
/// crashed, failing again, not judged as "nothing stored".
#[test]
fn exec_capsules_rerun_through_the_recorded_worker_as_printed() {
    let bin = env!("CARGO_BIN_EXE_smallseq");
    let worker = format!("env SMALLSEQ_MUTANT_FAULT=panic {bin} worker --backend cpu");
    let out_dir = campaign_reproduces(
        "exec",
        &[
            "--backend",
            "exec",
            "--worker",
            &worker,
            "--cases",
            "60",
            "--seed",
            "5",
            "--jobs",
            "2",
            "--shrink-time",
            "1s",
        ],
    );
    let capsule = std::fs::read_dir(out_dir.join("capsules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("-crash.safetensors"))
        .expect("a crash capsule");
    let plain = bare(Command::new(bin))
        .arg("repro")
        .arg(&capsule)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&plain.stdout);
    assert_eq!(plain.status.code(), Some(1), "{text}");
    assert!(text.contains("rerunning it on --backend exec"), "{text}");
    assert!(text.contains("crash: FAIL"), "{text}");
}
