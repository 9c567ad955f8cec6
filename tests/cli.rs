//! The `smallseq` command end to end: run, explain, repro, and malformed case files.

use smallseq::case_file::{read_case, write_case, OutputPrecision};
use smallseq::harness::gen::{build, draw_geometry};
use smallseq::harness::rng::Rng;
use smallseq::reference::{Dtype, Layout, Mask};
use smallseq::{AttnConfig, Case};
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_smallseq"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn small_case(lens: &[(usize, usize)], h: usize, d: usize) -> Case {
    let layout = Layout::packed(lens);
    let cfg = AttnConfig::new(Dtype::Bf16, h, d, Mask::Padding);
    let mut rng = Rng::new(3);
    let mut t = |n| {
        ndarray::Array3::from_shape_simple_fn((n, h, d), || Dtype::Bf16.round(rng.normal() as f32))
    };
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let (q, k, v, d_o) = (t(tq), t(tk), t(tk), t(tq));
    Case::new(cfg, layout, q, k, v, Some(d_o)).unwrap()
}

fn write(c: &Case, name: &str) -> PathBuf {
    let p = tmp(name);
    write_case(c, &p, OutputPrecision::Device).unwrap();
    p
}

#[test]
fn explain_json_is_one_object_with_reasons() {
    let p = write(&small_case(&[(18, 3)], 16, 128), "explain.safetensors");
    let out = bin()
        .args(["explain", "--case"])
        .arg(&p)
        .args(["--json", "--env", "SMALLSEQ_FORCE_FALLBACK=1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["path"], "fallback");
    assert_eq!(v["profile"], "native");
    let codes: Vec<&str> = v["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["env", "seqlen_q"]);
    let out = bin()
        .args(["explain", "--case"])
        .arg(&p)
        .args([
            "--json",
            "--profile",
            "te625",
            "--arch",
            "gfx942",
            "--env",
            "NVTE_FUSED_ATTN_CK_SMALLSEQ=1",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["reasons"][0]["code"], "seqlen_q");
}

#[test]
fn run_reference_writes_f64_outputs_matching_the_naive_implementation() {
    let mut rng = Rng::new(11);
    for i in 0..12 {
        let g = draw_geometry(&mut rng);
        let Ok(case) = build(&g, 100 + i) else {
            continue;
        };
        let inp = write(&case, &format!("ref-in-{i}.safetensors"));
        let outp = tmp(&format!("ref-out-{i}.safetensors"));
        let st = bin()
            .args(["run", "--backend", "reference", "--case"])
            .arg(&inp)
            .arg("--out")
            .arg(&outp)
            .status()
            .unwrap();
        assert!(st.success());
        let got = read_case(&outp).unwrap();
        let (f, gr) = smallseq::reference::naive::forward_backward(&case.problem().unwrap());
        // Two f64 summation orders differ by a few units of the terms' magnitude, which reaches
        // the tensor's largest value: an element that cancels is off by 1e-12 of that, not of
        // itself (a bias case of the generator: |dq| up to 1.7e5, an element of 1e-3 off by
        // 8e-12).
        let close = |a: &ndarray::ArrayD<f64>, b: &ndarray::ArrayD<f64>| {
            let scale = b.iter().fold(1.0f64, |m, y| m.max(y.abs()));
            a.iter().zip(b.iter()).all(|(x, y)| {
                x == y
                    || (x - y).abs() <= 1e-9 * y.abs().max(1e-300)
                    || (x - y).abs() < 1e-12 * scale
            })
        };
        assert!(
            close(&got.outputs.o.clone().unwrap().into_dyn(), &f.o.into_dyn()),
            "o, case {i}"
        );
        assert!(
            close(
                &got.outputs.lse.clone().unwrap().into_dyn(),
                &f.lse.into_dyn()
            ),
            "lse, case {i}"
        );
        if let Some(gr) = gr {
            assert!(
                close(
                    &got.outputs.dq.clone().unwrap().into_dyn(),
                    &gr.dq.into_dyn()
                ),
                "dq, case {i}"
            );
            assert!(
                close(
                    &got.outputs.dk.clone().unwrap().into_dyn(),
                    &gr.dk.into_dyn()
                ),
                "dk, case {i}"
            );
            assert!(
                close(
                    &got.outputs.dv.clone().unwrap().into_dyn(),
                    &gr.dv.into_dyn()
                ),
                "dv, case {i}"
            );
        }
    }
}

fn exit_and_stderr(args: &[&str], path: &Path) -> (i32, String) {
    let out = bin().args(args).arg(path).output().unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn malformed_cases_exit_2_with_one_line() {
    let good = small_case(&[(3, 4), (2, 2)], 2, 64);
    let bytes = smallseq::case_file::case_bytes(&good, OutputPrecision::Device).unwrap();
    let mut bad_cases: Vec<(Vec<u8>, &str)> =
        vec![(bytes[..bytes.len() / 2].to_vec(), "not a valid safetensors")];
    let mut c = good.clone();
    c.layout.q.cu = vec![0, 4, 3];
    bad_cases.push((raw(&c), "cu_seqlens_q[2] = 3"));
    let mut c = good.clone();
    c.layout.kv.padded = Some(vec![0, 3, 9]);
    bad_cases.push((raw(&c), "cu_seqlens_kv_padded"));
    let mut c = good.clone();
    c.layout.q.padded = Some(vec![0, 2, 5]);
    bad_cases.push((raw(&c), "span 2"));
    let mut c = good.clone();
    c.config.params.num_kv_heads = 3;
    bad_cases.push((raw(&c), "num_gqa_groups"));
    let text = replace_bytes(&bytes, br#"\"bias\":\"none\""#, br#"\"bias\":12345678"#);
    bad_cases.push((text, "key 'bias'"));
    let text = replace_bytes(&bytes, br#"\"layout\":\"thd\""#, br#"\"colour\":\"thd\""#);
    bad_cases.push((text, "unknown key 'colour'"));
    for (i, (b, needle)) in bad_cases.iter().enumerate() {
        let p = tmp(&format!("bad-{i}.safetensors"));
        std::fs::write(&p, b).unwrap();
        for cmd in [&["explain", "--case"][..], &["repro"][..]] {
            let (code, err) = exit_and_stderr(cmd, &p);
            assert_eq!(code, 2, "{cmd:?} on bad case {i}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{err}");
            assert!(
                err.contains(needle),
                "bad case {i}: {err:?} lacks {needle:?}"
            );
        }
    }
}

/// Replaces the first occurrence of `from` (same length as `to`) in the header.
fn replace_bytes(b: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = b
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in header");
    let mut out = b.to_vec();
    out[at..at + to.len()].copy_from_slice(to);
    out
}

/// Serialises a case without validating it (to build malformed files).
fn raw(c: &Case) -> Vec<u8> {
    smallseq::case_file::case_bytes(c, OutputPrecision::Device).unwrap()
}

#[test]
fn repro_names_a_corrupted_element() {
    let case = small_case(&[(3, 4), (5, 2)], 2, 64);
    let inp = write(&case, "rep-in.safetensors");
    let cap = tmp("rep-cap.safetensors");
    assert!(bin()
        .args(["run", "--backend", "cpu", "--case"])
        .arg(&inp)
        .arg("--out")
        .arg(&cap)
        .status()
        .unwrap()
        .success());
    let out = bin().arg("repro").arg(&cap).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let mut c = read_case(&cap).unwrap();
    c.outputs.dk.as_mut().unwrap()[(4, 1, 7)] += 0.5;
    let bad = tmp("rep-bad.safetensors");
    write_case(&c, &bad, OutputPrecision::Device).unwrap();
    let out = bin().arg("repro").arg(&bad).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("tensor dk, token 4, head 1, dim 7"), "{text}");
    let out = bin()
        .arg("repro")
        .arg(&cap)
        .args(["--backend", "cpu"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("bitwise equal") && !text.contains("NOT"),
        "{text}"
    );
}

/// A capsule that failed a relation between runs (here a batch split, CPU fuzz seed 2071)
/// whose stored outputs pass: plain `repro` cannot replay the relation, so it neither passes
/// (0) nor reproduces (1) but refuses, saying to rerun; the same capsule with a verdict of
/// numeric_agreement only passes.
#[test]
fn repro_of_stored_outputs_refuses_a_relation_it_cannot_replay() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/capsules/stored");
    let rel = dir.join("cpu-f16-split-launch-dq-overflow-one-path.safetensors");
    let out = bin().arg("repro").arg(&rel).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("the capsule failed metamorphic, which compares runs")
            && text.contains("--backend"),
        "{text}"
    );
    let mut c = read_case(&rel).unwrap();
    let numeric = r#"{"failures": [{"property": "numeric_agreement", "detail": "dq: max error"}]}"#;
    c.meta.insert("smallseq.verdict".into(), numeric.into());
    let plain = tmp("rel-as-numeric.safetensors");
    write_case(&c, &plain, OutputPrecision::Device).unwrap();
    let out = bin().arg("repro").arg(&plain).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("stored outputs pass every property they allow"),
        "{text}"
    );
}

/// Outputs carry the device and build they came from; a rerun says whether its own match.
#[test]
fn repro_compares_the_capsules_provenance_with_the_rerun() {
    let case = small_case(&[(2, 3)], 1, 64);
    let inp = write(&case, "prov-in.safetensors");
    let cap = tmp("prov-cap.safetensors");
    let run = bin()
        .args(["run", "--backend", "cpu", "--case"])
        .arg(&inp)
        .arg("--out")
        .arg(&cap)
        .status()
        .unwrap();
    assert!(run.success());
    let stdout = |args: &[&str], file: &std::path::Path| {
        let out = bin().arg("repro").arg(file).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = stdout(&[], &cap);
    assert!(text.contains("produced on: build smallseq "), "{text}");
    let text = stdout(&["--backend", "cpu"], &cap);
    assert!(text.contains("provenance: as the capsule's"), "{text}");
    // The same outputs, said to come from another build: the rerun names the difference.
    let mut c = read_case(&cap).unwrap();
    c.meta.insert(
        "smallseq.provenance".into(),
        r#"{"build":"smallseq 0.0.1","target":"elsewhere"}"#.into(),
    );
    let moved = tmp("prov-moved.safetensors");
    write_case(&c, &moved, OutputPrecision::Device).unwrap();
    let text = stdout(&["--backend", "cpu"], &moved);
    assert!(
        text.contains("provenance differs: build: capsule smallseq 0.0.1, now smallseq "),
        "{text}"
    );
    assert!(text.contains("bitwise equal"), "{text}");
}

#[test]
fn fuzz_refuses_zero_jobs() {
    let out = bin()
        .args(["fuzz", "--cases", "1", "--jobs", "0", "--out"])
        .arg(tmp("jobs0"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--jobs 0"));
}

#[test]
fn in_process_is_for_gpu_backends_and_says_so() {
    for (backend, words) in [
        ("cpu", "in this process already"),
        ("exec", "another process"),
    ] {
        let out = bin()
            .args(["fuzz", "--cases", "1", "--in-process", "--backend", backend])
            .args(
                ["--worker", "python3 x.py"]
                    .iter()
                    .filter(|_| backend == "exec"),
            )
            .arg("--out")
            .arg(tmp(&format!("in-process-{backend}")))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{backend}: {err}");
        assert!(
            err.contains("--in-process is for the GPU backends") && err.contains(words),
            "{err}"
        );
    }
    let out = bin()
        .args(["fuzz", "--cases", "1", "--in-process", "--isolate"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "--in-process beside --isolate is refused"
    );
}

#[test]
fn fuzz_writes_reports_and_hits_classes() {
    let dir = tmp("fuzz-out");
    let st = bin()
        .args(["fuzz", "--cases", "60", "--seed", "5", "--out"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    let rep = read_json(&dir.join("report.json"));
    assert_eq!(rep["cases"], 60);
    assert_eq!(rep["seed"], 5);
    for p in [
        "eligibility",
        "fallback_equivalence",
        "numeric_agreement",
        "dont_care",
        "workspace",
        "determinism",
        "metamorphic",
        "emulation_conformance",
    ] {
        assert!(rep["properties"][p]["pass"].as_u64().unwrap() > 0, "{p}");
    }
    assert!(std::fs::read_to_string(dir.join("junit.xml"))
        .unwrap()
        .contains("<testsuite"));
    let summary = std::fs::read_to_string(dir.join("summary.md")).unwrap();
    assert!(summary.contains("| numeric_agreement |"));
    // How it was run, and why properties were skipped.
    assert!(summary.contains("Command: `") && summary.contains("fuzz --cases 60 --seed 5"));
    assert!(summary.contains("budget 60 cases"), "{summary}");
    assert!(
        summary.contains("| skipped (property: reason) | cases |"),
        "{summary}"
    );
    assert!(rep["command"]
        .as_str()
        .unwrap()
        .ends_with(&format!("fuzz --cases 60 --seed 5 --out {}", dir.display())));
    assert_eq!(rep["budget"]["cases"], 60);
    assert!(rep["jobs"].as_u64().unwrap() >= 1);
    assert!(rep.get("commit").is_some());
    assert_eq!(rep["partial"], false);
    let no_gpu = bin()
        .args(["fuzz", "--backend", "cuda", "--cases", "1"])
        .output()
        .unwrap();
    assert_eq!(no_gpu.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&no_gpu.stderr)
            .trim()
            .lines()
            .count(),
        1
    );
}

/// Runs `smallseq args`, waits for its first stderr line (its signal handler is set by then),
/// sends it SIGTERM `after_s` seconds later, and waits up to `limit_s` for it to exit (killing
/// it and panicking past that).
#[cfg(unix)]
fn exit_after_sigterm(args: &[&str], after_s: u64, limit_s: u64) -> std::process::ExitStatus {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let mut child = bin()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Drained on a thread, so a chatty child never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let _ = tx.send(line);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(60));
    assert!(first.is_ok(), "smallseq {args:?} printed nothing in 60 s");
    std::thread::sleep(Duration::from_secs(after_s));
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed().as_secs() >= limit_s {
            child.kill().unwrap();
            panic!("smallseq {args:?} did not stop within {limit_s} s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A campaign that CI's time limit stops (SIGTERM, as `timeout` sends) still writes its
/// report, marked interrupted, with the cases it ran, and exits 130 (tests/signals.rs: the
/// exact `timeout` behaviour, and SIGKILL).
#[cfg(unix)]
#[test]
fn fuzz_stopped_by_sigterm_writes_an_interrupted_report() {
    let dir = tmp("fuzz-term");
    let out = dir.to_str().unwrap();
    let args = ["fuzz", "--time", "300s", "--seed", "8", "--out", out];
    let status = exit_after_sigterm(&args, 3, 120);
    assert_eq!(status.code(), Some(130), "a clean campaign, stopped early");
    let rep = read_json(&dir.join("report.json"));
    assert_eq!(rep["interrupted"], true);
    assert!(rep["cases"].as_u64().unwrap() > 0);
}

/// A mutation run that CI's time limit stops writes `mutants.json` with the mutants it did not
/// finish marked interrupted (not survivors) and exits 130, not 0 or 1.
#[cfg(unix)]
#[test]
fn mutants_stopped_by_sigterm_mark_unfinished_mutants_interrupted() {
    let dir = tmp("mutants-term");
    let out = dir.to_str().unwrap();
    let args = ["mutants", "--time", "300s", "--seed", "4", "--out", out];
    let status = exit_after_sigterm(&args, 0, 60);
    assert_eq!(status.code(), Some(130));
    let rows = read_json(&dir.join("mutants.json"));
    let rows = rows.as_array().unwrap();
    assert!(rows.len() > 20, "every selected mutant has a row");
    let interrupted = rows.iter().filter(|r| r["interrupted"] == true).count();
    assert!(interrupted > 0);
    for r in rows {
        assert!(
            r["killed"] == true || r["interrupted"] == true,
            "a mutant neither killed nor interrupted is a survivor: {r}"
        );
    }
}

/// Commands without a report to save exit on the first SIGTERM, as without a handler: a CI
/// time limit still stops them.
#[cfg(unix)]
#[test]
fn other_commands_exit_on_the_first_sigterm() {
    let status = exit_after_sigterm(&["calibrate", "--cases", "1000000", "--seed", "2"], 2, 20);
    assert!(!status.success());
}

#[test]
fn te625_campaign_names_every_modelled_defect() {
    let dir = tmp("te625-out");
    let out = bin()
        .args(["fuzz", "--backend", "te625-model", "--profile", "te625"])
        .args([
            "--cases",
            "150",
            "--seed",
            "3",
            "--shrink-time",
            "0s",
            "--out",
        ])
        .arg(&dir)
        .env_remove("NVTE_FUSED_ATTN_CK_SMALLSEQ")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "the model must fail");
    let findings = read_json(&dir.join("te625.json"));
    let names: Vec<(String, u64)> = findings
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["defect"].as_str().unwrap().to_string(),
                f["count"].as_u64().unwrap(),
            )
        })
        .collect();
    for defect in [
        "lse-permuted",
        "causal-ignored",
        "window-ignored",
        "nan-on-empty-kv",
        "workspace-env-mismatch",
        "padded-span-gate",
    ] {
        let n = names.iter().find(|(d, _)| d == defect).map(|(_, n)| *n);
        assert!(n.unwrap_or(0) > 0, "{defect} not found: {names:?}");
    }
    let summary = std::fs::read_to_string(dir.join("summary.md")).unwrap();
    assert!(summary.contains("TE #625 defects"));
    // The minutes of attribution after the report show progress (stderr is no terminal
    // here: lines), and the gate's example prints offsets as lists, not Rust's Option.
    let err = stderr_of(&out);
    for phase in [
        "TE #625 attribution: replaying failures",
        "TE #625 attribution: scanning cases for the padded-span gate 150/150",
    ] {
        assert!(err.contains(phase), "{phase} not in {err}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(" padded ") && !stdout.contains("Some("),
        "{stdout}"
    );
}

#[test]
fn calibrate_reports_rates_per_dtype_dim_and_tensor() {
    let out = tmp("calibrate.json");
    let run = bin()
        .args(["calibrate", "--cases", "120", "--seed", "3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}");
    assert!(stdout.contains("dtype d tensor"), "{stdout}");
    assert!(stdout.contains("current budgets: o 1.00 %"), "{stdout}");
    // The CPU backend performs the emulation's roundings: its rates are ~0, far under 1 %.
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let rows = json.as_object().unwrap();
    assert!(!rows.is_empty(), "no small-seq tensor judged in 120 cases");
    for (key, r) in rows {
        assert!(key.split(' ').count() == 3, "{key}");
        assert!(r["tensors"].as_u64().unwrap() > 0);
        assert!(r["max_rate"].as_f64().unwrap() < 0.01, "{key}: {r}");
        assert!(r["max_margin"].as_f64().unwrap() <= 1.0, "{key}: {r}");
    }
    assert!(stdout.contains("largest margin 0."), "{stdout}");
    // The rounding-bias columns (`rounding_bias`) with the budget each tensor has now, the
    // figures `bias::bias_budget_of` is set from.
    assert!(stdout.contains("rounding bias (sign test"), "{stdout}");
    assert!(
        stdout.contains("largest excess per tensor: o ") && stdout.contains("(budget 0.00)"),
        "{stdout}"
    );
    for (key, r) in rows {
        let b = &r["bias"];
        if b["tensors"].as_u64().unwrap() > 0 {
            assert!(b["max_excess"].as_f64().unwrap() <= 0.5, "{key}: {r}");
            assert!(b["max_margin"].as_f64().unwrap() <= 1.0, "{key}: {r}");
        }
    }
}

#[test]
fn calibrate_without_a_gpu_exits_2_with_one_line() {
    let run = bin()
        .args(["calibrate", "--backend", "cuda", "--cases", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    match run.status.code() {
        Some(2) => assert_eq!(err.trim().lines().count(), 1, "{err}"),
        // Built with the cuda feature on a machine with a GPU.
        code => assert_eq!(code, Some(0), "{err}"),
    }
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `run` says what it wrote, never overwrites its input, and never passes on the input's
/// verdict or provenance as if they described the new outputs.
#[test]
fn run_prints_what_it_wrote_refuses_its_input_as_output_and_drops_old_verdicts() {
    let mut case = small_case(&[(3, 4)], 2, 64);
    case.meta.insert(
        "smallseq.verdict".into(),
        r#"{"property":"dont_care"}"#.into(),
    );
    case.meta
        .insert("smallseq.provenance".into(), r#"{"device":"H200"}"#.into());
    let inp = write(&case, "run-in.safetensors");
    let outp = tmp("run-out.safetensors");
    let out = bin()
        .args(["run", "--backend", "cpu", "--case"])
        .arg(&inp)
        .arg("--out")
        .arg(&outp)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        text.starts_with(&format!("wrote {}:", outp.display()))
            && text.contains("outputs o, lse, dq, dk, dv from backend cpu"),
        "{text}"
    );
    let got = read_case(&outp).unwrap();
    assert!(!got.meta.contains_key("smallseq.verdict"), "{:?}", got.meta);
    assert!(!got.meta["smallseq.provenance"].contains("H200"));
    // The same file, spelled differently, is refused before anything is written.
    let before = std::fs::read(&inp).unwrap();
    let same = inp
        .parent()
        .unwrap()
        .join(".")
        .join(inp.file_name().unwrap());
    let out = bin()
        .args(["run", "--case"])
        .arg(&inp)
        .arg("--out")
        .arg(&same)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("is the input case file"),
        "{}",
        stderr_of(&out)
    );
    assert_eq!(std::fs::read(&inp).unwrap(), before);
}

/// A `--out` holding a previous report is refused (exit 2, naming the folder and `--force`)
/// and left as it was; with `--force` the previous reports and capsules go, other files stay.
#[test]
fn fuzz_refuses_a_previous_report_in_its_out_directory_without_force() {
    let dir = tmp("reused-out");
    std::fs::create_dir_all(dir.join("capsules")).unwrap();
    let stale = dir.join("capsules/case-000003-numeric_agreement.safetensors");
    std::fs::write(&stale, b"old").unwrap();
    std::fs::write(dir.join("te625.json"), b"[]").unwrap();
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    let fuzz = |force: bool| {
        let mut c = bin();
        c.args(["fuzz", "--cases", "3", "--seed", "1", "--out"])
            .arg(&dir);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    let out = fuzz(false);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{} holds the report of a previous run",
            dir.display()
        )) && err.contains("--force"),
        "{err}"
    );
    assert!(stale.exists() && !dir.join("report.json").exists());
    let out = fuzz(true);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(!stale.exists() && !dir.join("te625.json").exists());
    assert!(dir.join("notes.txt").exists() && dir.join("report.json").exists());
    assert!(
        stderr_of(&out).contains("removed 2 file(s) a previous run wrote"),
        "{}",
        stderr_of(&out)
    );
    // A folder with only other files is not a report: used without --force.
    let other = tmp("other-files-out");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"mine").unwrap();
    let out = bin()
        .args(["fuzz", "--cases", "2", "--seed", "1", "--out"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
}

/// `explain` on a capsule asks the gate what the campaign asked it: the replay record's
/// profile, arch and environment, as `repro` replays them (flags still override).
#[test]
fn explain_replays_the_capsules_dispatch_inputs() {
    use smallseq::harness::capsule::{Replay, REPLAY};
    let mut c = small_case(&[(3, 4), (2, 2)], 16, 128);
    let replay = Replay {
        backend: "te625-model".into(),
        profile: "te625".into(),
        arch: "gfx942".into(),
        env: [("NVTE_FUSED_ATTN_CK_SMALLSEQ".to_string(), "1".to_string())].into(),
        salt: 7,
        ..Replay::default()
    };
    c.meta
        .insert(REPLAY.into(), serde_json::to_string(&replay).unwrap());
    let p = write(&c, "explain-capsule.safetensors");
    let explain = |extra: &[&str]| {
        let out = bin()
            .args(["explain", "--json", "--case"])
            .arg(&p)
            .args(extra)
            .env_remove("NVTE_FUSED_ATTN_CK_SMALLSEQ")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let v = explain(&[]);
    assert_eq!(
        (&v["path"], &v["profile"]),
        (&"small_seq".into(), &"te625".into()),
        "{v}"
    );
    // The shell's environment (the variable unset) is what the capsule's record replaces.
    let v = explain(&["--env", "NVTE_FUSED_ATTN_CK_SMALLSEQ=0"]);
    assert_eq!(v["path"], "fallback", "{v}");
    let v = explain(&["--arch", "cpu"]);
    assert_eq!(v["path"], "fallback", "{v}");
    let out = bin().args(["explain", "--case"]).arg(&p).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("profile te625, arch gfx942, env NVTE_FUSED_ATTN_CK_SMALLSEQ=1"),
        "{text}"
    );
}

/// The safetensors crate's variant names (`HeaderTooSmall`) become a sentence naming the file;
/// an unknown backend's list names exec.
#[test]
fn unreadable_files_and_unknown_backends_read_as_sentences() {
    let p = tmp("five-bytes.safetensors");
    std::fs::write(&p, b"12345").unwrap();
    let (code, err) = exit_and_stderr(&["repro"], &p);
    assert_eq!(code, 2);
    assert!(
        err.contains(&p.display().to_string()) && err.contains("shorter than the 8-byte header"),
        "{err}"
    );
    assert!(!err.contains("HeaderTooSmall"), "{err}");
    let case = write(&small_case(&[(2, 2)], 1, 64), "nope-backend.safetensors");
    let case = case.to_str().unwrap();
    for cmd in [
        &["fuzz", "--cases", "1", "--backend", "nope"][..],
        &["repro", case, "--backend", "nope"][..],
    ] {
        let out = bin().args(cmd).output().unwrap();
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("'nope'") && err.contains("exec"), "{err}");
    }
}

/// The recorded verdict reads as sentences with rounded margins, the dq/dk allowance named.
#[test]
fn repro_prints_the_recorded_verdict_as_lines() {
    let mut case = small_case(&[(3, 4)], 2, 64);
    case.meta.insert(
        "smallseq.verdict".into(),
        r#"{"property":"numeric_agreement","detail":"o: max error 1 > threshold 0.5","failures":[{"property":"numeric_agreement","detail":"o: max error 1 > threshold 0.5","margin":2.0000001}],"margins":{"o":2.0000001,"dq":0.123456}}"#.into(),
    );
    let inp = write(&case, "verdict-in.safetensors");
    let cap = tmp("verdict-cap.safetensors");
    let run = bin()
        .args(["run", "--backend", "reference", "--case"])
        .arg(&inp)
        .arg("--out")
        .arg(&cap)
        .output()
        .unwrap();
    assert!(run.status.success());
    // `run` drops the verdict; put it back as a capsule would have it.
    let mut c = read_case(&cap).unwrap();
    c.meta.insert(
        "smallseq.verdict".into(),
        case.meta["smallseq.verdict"].clone(),
    );
    write_case(&c, &cap, OutputPrecision::Reference).unwrap();
    let out = bin().arg("repro").arg(&cap).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("recorded verdict: numeric_agreement failed: o: max error 1 > threshold 0.5"),
        "{text}"
    );
    assert!(text.contains("dq 0.12, o 2.00"), "{text}");
    assert!(
        text.contains("dq and dk after their rounding allowance"),
        "{text}"
    );
    assert!(
        text.contains("dq: max error beyond the rounding allowance"),
        "{text}"
    );
    assert!(!text.contains("{\""), "JSON in the output: {text}");
}

/// Usage errors: one line, no Rust Debug text, valid names listed, how to get a missing
/// feature; OS errors once, naming the path given.
#[test]
fn usage_errors_are_plain_words() {
    for cmd in ["fuzz", "mutants"] {
        let out = bin().args([cmd, "--cases", "0"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{cmd} --cases 0");
        assert!(
            stderr_of(&out).contains("at least 1 case"),
            "{}",
            stderr_of(&out)
        );
    }
    let out = bin()
        .args(["mutants", "--only", "scale-thrice"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_of(&out);
    assert!(
        err.contains("unknown mutant 'scale-thrice'") && err.contains("scale-twice"),
        "{err}"
    );
    let out = bin()
        .args(["repro", "no-such-capsule.safetensors"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
    assert!(err.contains("no-such-capsule.safetensors"), "{err}");
    let out = bin()
        .args(["fuzz", "--cases", "1", "--out", "/proc/smallseq-cannot"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(err.matches("os error").count(), 1, "{err}");
    assert!(
        err.contains("cannot create the output folder /proc/smallseq-cannot"),
        "{err}"
    );
    let dir = tmp("plain-header");
    let out = bin()
        .args(["fuzz", "--cases", "2", "--time", "60s", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(err.contains("budget 2 cases"), "{err}");
    for debug in ["Cases(", "Time(", "Some(", "None"] {
        assert!(!err.contains(debug), "{debug} in {err}");
    }
    if cfg!(not(feature = "cuda")) {
        let out = bin()
            .args(["fuzz", "--backend", "cuda", "--cases", "1"])
            .output()
            .unwrap();
        assert!(
            stderr_of(&out).contains("cargo build --release --features cuda"),
            "{}",
            stderr_of(&out)
        );
    }
}

/// A case file without `scale` says which default it takes.
#[test]
fn a_missing_scale_is_printed_as_defaulted() {
    let case = small_case(&[(3, 4)], 2, 64);
    let bytes = raw(&case);
    // Same length: the scale key becomes a second dropout of 0.
    let text = replace_bytes(&bytes, br#"\"scale\":0.125"#, br#"\"dropout\":0.0"#);
    let p = tmp("no-scale.safetensors");
    std::fs::write(&p, text).unwrap();
    let out = bin().args(["explain", "--case"]).arg(&p).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("no scale in smallseq.config: using the default 1/sqrt(head_dim_qk) = 1/sqrt(64) = 0.125"),
        "{}",
        stderr_of(&out)
    );
}

/// `case new` flags for a GQA f16 case with an empty query slot, a causal mask and a window;
/// `--out FILE` follows.
const NEW_CASE: [&str; 19] = [
    "case",
    "new",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--q-lens",
    "3,5,0",
    "--kv-lens",
    "3,6,1",
    "--mask",
    "causal_bottom_right",
    "--window",
    "-1,0",
    "--dtype",
    "f16",
    "--out",
];

/// `case new` writes a case from flags that the other commands take; bad flags name the
/// valid values.
#[test]
fn case_new_writes_a_case_from_flags() {
    let p = tmp("new-case.safetensors");
    let out = bin().args(NEW_CASE).arg(&p).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("scale 0.125 (default"));
    let c = read_case(&p).unwrap();
    let prm = &c.config.params;
    assert_eq!(
        (prm.num_heads, prm.num_kv_heads, prm.head_dim_qk),
        (4, 2, 64)
    );
    assert_eq!(c.config.dtype, Dtype::F16);
    assert_eq!(c.layout.slots(), 3);
    assert_eq!((c.layout.q.len(1), c.layout.kv.len(2)), (5, 1));
    assert_eq!((prm.window.left, prm.window.right), (-1, 0));
    assert!(c.d_o.is_some());
    // Data is seeded: the same flags give the same file.
    let again = tmp("new-case-again.safetensors");
    let st = bin().args(NEW_CASE).arg(&again).status().unwrap();
    assert!(st.success());
    assert_eq!(read_case(&again).unwrap().q, c.q);
    let run_out = tmp("new-case-run.safetensors");
    let st = bin()
        .args(["run", "--backend", "cpu", "--case"])
        .arg(&p)
        .arg("--out")
        .arg(&run_out)
        .status()
        .unwrap();
    assert!(st.success());
    let out = bin()
        .args([
            "case", "new", "--q-lens", "2", "--mask", "diagonal", "--out",
        ])
        .arg(tmp("bad-mask.safetensors"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("padding_causal"),
        "{}",
        stderr_of(&out)
    );
}

#[test]
fn fuzz_refuses_a_zero_time_budget_and_closes_with_its_verdict() {
    // `--time 0s` checks nothing: refused like `--cases 0`, never a pass.
    let out = bin()
        .args(["fuzz", "--time", "0s", "--out"])
        .arg(tmp("fuzz-zero"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_of(&out);
    assert!(err.contains("--time 0s"), "{err}");
    let dir = tmp("fuzz-verdict");
    let out = bin()
        .args(["fuzz", "--cases", "3", "--seed", "5", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    assert_eq!(
        last,
        format!("PASSED: open {}", dir.join("report.html").display()),
        "{stdout}"
    );
    assert!(dir.join("report.html").is_file());
}

/// `smallseq fuzz … | head`: with both output streams closed before the first line, the
/// campaign still checks its cases, writes its reports and exits with its verdict (a write to
/// a closed pipe panicked before the first case, exit 101, nothing written).
#[test]
fn a_campaign_whose_output_pipes_close_still_reports() {
    let out = tmp("closed-pipes");
    let mut child = bin()
        .args(["fuzz", "--cases", "12", "--seed", "3", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(out.join("report.json").is_file());
}
