//! Replaying a capsule: re-judge its stored outputs on this machine, or run it again on a
//! backend and say whether the new outputs are bitwise equal to the stored ones.

use super::capsule::{build_commit, Replay, COMMIT, PROVENANCE};
use super::props::{dont_care_outputs, numeric, oracle_for, Checker, Outcome, Prop};
use super::{bias, conformance};
use crate::backend::rounding_budget_of;
use crate::case::Case;
use crate::dispatch::{Arch, Path, Profile};
use crate::error::{Error, Result};
use crate::mutants::Mutant;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

static PROGRAM: OnceLock<String> = OnceLock::new();

/// Sets how printed repro commands start: `smallseq` when that name finds the running binary
/// on `PATH`, else the binary's path (the CLI decides; first call wins).
pub fn set_program(program: String) {
    let _ = PROGRAM.set(program);
}

/// The program printed repro commands start with (`smallseq` unless [`set_program`] said
/// otherwise), quoted for a POSIX shell.
pub fn program() -> String {
    shell_quote(PROGRAM.get().map_or("smallseq", String::as_str))
}

/// `word` as one POSIX shell word: unchanged when it needs no quoting, else in single quotes.
pub fn shell_quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// The dispatch inputs a capsule records, read once for every command that replays them
/// (`repro` reruns under them, `explain` asks the gate under them), so the two cannot disagree
/// about which path a capsule took.
#[derive(Clone, Debug, Default)]
pub struct Recorded {
    /// The capsule's replay record; `None` for a capsule written before they were recorded.
    pub replay: Option<Replay>,
    /// The profile it ran under: the record's, else the older `smallseq.profile` key.
    pub profile: Option<Profile>,
    /// The bugs planted in the backend that made the capsule (`fuzz --plant`).
    pub planted: Vec<Mutant>,
}

impl Recorded {
    /// Reads the replay record of `case`, read from the file `name` (used in errors).
    ///
    /// # Errors
    /// [`Error::CaseFile`] naming the file when the record does not parse or names a planted
    /// bug this build does not know.
    pub fn of(case: &Case, name: &str) -> Result<Self> {
        let replay = Replay::from_meta(&case.meta)
            .transpose()
            .map_err(|detail| Error::CaseFile {
                path: name.into(),
                detail,
            })?;
        let profile = replay
            .as_ref()
            .map(|r| r.profile.clone())
            .or_else(|| case.meta.get("smallseq.profile").cloned())
            .and_then(|p| p.parse().ok());
        let planted = replay
            .iter()
            .flat_map(|r| r.planted.iter())
            .map(|m| {
                m.parse::<Mutant>().map_err(|e| Error::CaseFile {
                    path: name.into(),
                    detail: format!("planted bug: {e}"),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Recorded {
            replay,
            profile,
            planted,
        })
    }

    /// The arch the capsule's gate was asked about, when it names one.
    pub fn arch(&self) -> Option<Arch> {
        self.replay.as_ref().and_then(|r| r.arch.parse().ok())
    }

    /// The dispatch variables the capsule's gate saw, when it records them.
    pub fn env(&self) -> Option<Vec<(String, String)>> {
        self.replay
            .as_ref()
            .map(|r| r.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

/// What a replay found.
#[derive(Clone, Debug, Default)]
pub struct Diagnosis {
    pub lines: Vec<String>,
    pub failed: bool,
    /// The failures the capsule records that stored outputs cannot replay (a relation between
    /// runs, a fault): where nothing judged here fails, only a rerun can reproduce them.
    pub unreplayed: Vec<String>,
}

impl Diagnosis {
    fn say(&mut self, line: String) {
        self.lines.push(line);
    }
}

/// Judges the outputs stored in `case` (produced on the machine its `smallseq.provenance`
/// names, which is printed) against the f64 reference, on every property the
/// stored outputs allow: numeric agreement, don't-care outputs, and conformance to the
/// emulation with the rate budgets of the backend that produced them
/// ([`rounding_budget_of`]; the paths are the capsule's `smallseq.path` and
/// `smallseq.path_bwd`, the backward's taken as the forward's where a capsule predates it).
///
/// # Errors
/// An invalid case.
pub fn judge_stored(case: &Case) -> Result<Diagnosis> {
    let mut d = Diagnosis::default();
    if case.outputs.is_empty() {
        d.say("the case stores no outputs: nothing to judge (pass --backend to run it)".into());
        return Ok(d);
    }
    if let Some(v) = case.meta.get("smallseq.verdict") {
        for line in verdict_lines(v) {
            d.say(line);
        }
    }
    if let Some(p) = case.meta.get(PROVENANCE) {
        let readable = serde_json::from_str::<BTreeMap<String, String>>(p).map(|m| {
            let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
            parts.join(", ")
        });
        d.say(format!("produced on: {}", readable.as_deref().unwrap_or(p)));
    }
    d.say(harness_line(case));
    let y = oracle_for(case, super::conditioning::Design::of_case(case))?;
    let y = y.for_stored(case)?;
    let (num, js) = numeric(case, &case.outputs, &y);
    d.say(format!(
        "numeric regimes of the case: {} (docs/reach.md)",
        y.regimes.join(", ")
    ));
    d.say("judged here (margin = error / threshold; above 1 fails):".into());
    for j in &js {
        d.say(judgement_line(j));
    }
    if let Outcome::Fail(f) = num {
        d.failed = true;
        d.say(format!("numeric_agreement FAILED: {}", f.detail));
        if let Some(limit) = &f.range_limit {
            d.say(format!("numeric_agreement: {limit}"));
        }
        if let Some(w) = f.worst {
            d.say(format!("worst element: {}", w.describe(y.design)));
        }
    }
    if let Some(msg) = dont_care_outputs(case, &case.outputs) {
        d.failed = true;
        d.say(format!("dont_care FAILED: {msg}"));
    }
    let (fwd, bwd) = super::capsule::recorded_paths(case);
    let small = Some(Path::SmallSeq.name());
    let paths = (fwd == small, bwd == small);
    if let (Some(be), true) = (case.meta.get("smallseq.backend"), paths.0 || paths.1) {
        let counts = conformance::counts(case, paths, &case.outputs, &y.emulated, y.undecided());
        match conformance::judge(&counts, |t| rounding_budget_of(be, t)) {
            Outcome::Fail(f) => {
                d.failed = true;
                d.say(format!(
                    "emulation_conformance FAILED ({be} budgets): {}",
                    f.detail
                ));
            }
            Outcome::Pass => d.say(format!("emulation_conformance: pass ({be} budgets)")),
            Outcome::Skip { reason } => d.say(format!("emulation_conformance: skip ({reason})")),
        }
        // The bias test judges the forward path's outputs only where it was small-seq.
        if paths.0 {
            let signs = bias::signs(case, paths, &case.outputs, &y.emulated, y.undecided());
            match bias::judge(&signs, |t| bias::bias_budget_of(be, t)) {
                Outcome::Fail(f) => {
                    d.failed = true;
                    d.say(format!("rounding_bias FAILED ({be} budgets): {}", f.detail));
                }
                Outcome::Pass => d.say(format!("rounding_bias: pass ({be} budgets)")),
                Outcome::Skip { reason } => d.say(format!("rounding_bias: skip ({reason})")),
            }
        }
    }
    if !d.failed {
        d.unreplayed = unreplayed_failures(case);
        if d.unreplayed.is_empty() {
            d.say("stored outputs pass every property they allow".into());
        } else {
            d.say(format!(
                "stored outputs pass every property they allow, but the capsule failed {}, \
                 which compares runs of the case: outputs stored from one run cannot replay it. \
                 Rerun the case with --backend (the repro line the campaign printed does)",
                d.unreplayed.join(" and ")
            ));
        }
    }
    Ok(d)
}

/// The properties [`judge_stored`] judges from one run's stored outputs. The others compare
/// runs (determinism, metamorphic, fallback) or are about the run itself (a crash, a hang,
/// eligibility), and only a rerun can reproduce them.
const FROM_STORED: [Prop; 4] = [
    Prop::NumericAgreement,
    Prop::DontCare,
    Prop::EmulationConformance,
    Prop::RoundingBias,
];

/// Whether [`judge_stored`] can judge a failure of `property` (a verdict's property name)
/// from the stored outputs alone.
pub fn judged_from_stored(property: &str) -> bool {
    FROM_STORED.iter().any(|p| p.name() == property)
}

/// The properties the capsule's verdict records as failed that [`judge_stored`] cannot judge,
/// in the verdict's order.
fn unreplayed_failures(case: &Case) -> Vec<String> {
    let Some(v) = case.meta.get("smallseq.verdict") else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(v) else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    for f in v["failures"].as_array().into_iter().flatten() {
        let Some(name) = f["property"].as_str() else {
            continue;
        };
        if !judged_from_stored(name) && !out.iter().any(|o| o == name) {
            out.push(name.to_string());
        }
    }
    out
}

/// A margin for people: two decimals, or three significant digits past 1000.
pub fn margin_text(m: f64) -> String {
    if m.is_nan() {
        "undefined".into()
    } else if m.is_infinite() {
        "inf".into()
    } else if m.abs() >= 1000.0 {
        format!("{m:.2e}")
    } else {
        format!("{m:.2}")
    }
}

/// One tensor's judgement as a line. dq and dk are judged on each element's error beyond its
/// rounding allowance (see [`super::tolerance`]), which the line says.
fn judgement_line(j: &super::tolerance::Judgement) -> String {
    let what = if matches!(j.tensor.as_str(), "dq" | "dk") {
        "max error beyond the rounding allowance"
    } else {
        "max error"
    };
    format!(
        "  {:>3}: {what} {:.3e}, threshold {:.3e}, margin {} {}",
        j.tensor,
        j.err,
        j.threshold,
        margin_text(j.margin),
        if j.passed() { "ok" } else { "FAIL" }
    )
}

/// The capsule's `smallseq.verdict` JSON as lines: the failed properties with their details,
/// then the recorded margins per tensor, rounded.
pub fn verdict_lines(json: &str) -> Vec<String> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
        return vec!["recorded verdict: unreadable (not JSON)".into()];
    };
    let mut lines = Vec::new();
    let failures = v["failures"].as_array().cloned().unwrap_or_default();
    if failures.is_empty() {
        lines.push("recorded verdict: every property passed".into());
    }
    for (i, f) in failures.iter().enumerate() {
        lines.push(format!(
            "{} {} failed: {}",
            if i == 0 { "recorded verdict:" } else { "  and" },
            f["property"].as_str().unwrap_or("?"),
            f["detail"].as_str().unwrap_or("")
        ));
    }
    let margin = |x: &serde_json::Value| match x {
        serde_json::Value::Number(n) => n.as_f64().map_or("?".into(), margin_text),
        serde_json::Value::String(s) => s.clone(),
        _ => "?".into(),
    };
    if let Some(m) = v["margins"].as_object().filter(|m| !m.is_empty()) {
        let parts: Vec<String> = m
            .iter()
            .map(|(t, x)| format!("{t} {}", margin(x)))
            .collect();
        lines.push(format!(
            "  recorded margins (error / threshold; dq and dk after their rounding allowance): {}",
            parts.join(", ")
        ));
    }
    lines
}

/// Runs the case on `checker`'s backend with `salt` (see [`Checker::check`]; a capsule records
/// the one it failed with): every property, and a bitwise comparison with the
/// stored outputs when there are any.
///
/// # Errors
/// An invalid case.
pub fn rerun(checker: &Checker, case: &Case, salt: u64) -> Result<Diagnosis> {
    let mut d = Diagnosis::default();
    let run = checker.check(case, salt)?;
    for (p, o) in &run.outcomes {
        match o {
            Outcome::Pass => d.say(format!("{p}: pass")),
            Outcome::Skip { reason } => d.say(format!("{p}: skip ({reason})")),
            Outcome::Fail(f) => {
                d.failed = true;
                d.say(format!("{p}: FAIL: {}", f.detail));
                if let Some(limit) = &f.range_limit {
                    d.say(format!("{p}: {limit}"));
                }
                if let Some(w) = &f.worst {
                    let design = checker.design();
                    d.say(format!("  worst element: {}", w.describe(design)));
                }
            }
        }
    }
    let provenance = compare_provenance(
        case.meta.get(PROVENANCE).map(String::as_str),
        &checker.runner.provenance(),
    );
    match &provenance {
        Provenance::Missing => d.say("provenance: the capsule records none".into()),
        Provenance::Unreadable(e) => {
            d.say(format!("provenance: the capsule's is unreadable ({e})"))
        }
        Provenance::Same => {
            d.say("provenance: as the capsule's (device, driver, compiler, kernel build)".into())
        }
        Provenance::Differs(lines) => {
            for line in lines {
                d.say(format!("provenance differs: {line}"));
            }
        }
    }
    d.say(harness_line(case));
    if !case.outputs.is_empty() {
        let same = run
            .outputs
            .bitwise_eq(&restrict(&run.outputs, &case.outputs));
        let verdict = match (same, &provenance) {
            (true, _) => "new outputs are bitwise equal to the stored ones",
            (false, Provenance::Same) => {
                "new outputs are NOT bitwise equal to the stored ones, with the same recorded \
                 provenance: nondeterminism (a race, an uninitialised read), a flaky device, or \
                 host code changed since"
            }
            (false, Provenance::Differs(_)) => {
                "new outputs are NOT bitwise equal to the stored ones; the device or kernel \
                 build differs (above), which can explain it"
            }
            (false, _) => "new outputs are NOT bitwise equal to the stored ones",
        };
        d.say(verdict.into());
    }
    Ok(d)
}

/// [`commit_line`] of `case`'s recorded commit and this build's.
fn harness_line(case: &Case) -> String {
    commit_line(case.meta.get(COMMIT).map(String::as_str), build_commit())
}

/// Which harness build wrote the capsule (`smallseq.commit`) against this one's: the commit to
/// check out to replay it with the same host code. A `+dirty` record (build.rs) names the
/// commit that build's uncommitted changes sat on: no checkout holds its exact code.
pub fn commit_line(capsule: Option<&str>, this: Option<&str>) -> String {
    let Some(c) = capsule else {
        return "harness: the capsule records no commit".into();
    };
    match (c.strip_suffix("+dirty"), this) {
        (Some(base), Some(t)) if c == t => format!(
            "harness: commit {base} with uncommitted changes, as this build's (the changes \
             themselves may differ)"
        ),
        (Some(base), t) => format!(
            "harness: capsule written by a build of commit {base} with uncommitted changes (no \
             checkout holds its exact code); this build is {}",
            t.unwrap_or("of an unknown commit")
        ),
        (None, Some(t)) if c == t => format!("harness: commit {c}, as this build's"),
        (None, Some(t)) => format!("harness: capsule written at commit {c}; this build is {t}"),
        (None, None) => {
            format!("harness: capsule written at commit {c}; this build's commit is unknown")
        }
    }
}

/// How a capsule's recorded provenance compares with the rerun backend's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// The capsule records none (written before provenance was recorded).
    Missing,
    /// The record is not a JSON object of strings.
    Unreadable(String),
    Same,
    /// One `key: capsule A, now B` line per differing entry.
    Differs(Vec<String>),
}

/// Compares the capsule's provenance (`smallseq.provenance`, JSON) with `now`.
pub fn compare_provenance(stored: Option<&str>, now: &BTreeMap<String, String>) -> Provenance {
    let Some(stored) = stored else {
        return Provenance::Missing;
    };
    let stored: BTreeMap<String, String> = match serde_json::from_str(stored) {
        Ok(m) => m,
        Err(e) => return Provenance::Unreadable(e.to_string()),
    };
    let keys: BTreeSet<&String> = stored.keys().chain(now.keys()).collect();
    let shown = |v: Option<&String>| v.map_or("(none)".to_string(), String::clone);
    let lines: Vec<String> = keys
        .into_iter()
        .filter(|k| stored.get(*k) != now.get(*k))
        .map(|k| {
            format!(
                "{k}: capsule {}, now {}",
                shown(stored.get(k)),
                shown(now.get(k))
            )
        })
        .collect();
    if lines.is_empty() {
        Provenance::Same
    } else {
        Provenance::Differs(lines)
    }
}

/// The stored outputs, limited to the tensors the rerun produced.
fn restrict(new: &crate::case::Outputs, stored: &crate::case::Outputs) -> crate::case::Outputs {
    crate::case::Outputs {
        o: new.o.as_ref().and(stored.o.clone()),
        lse: new.lse.as_ref().and(stored.lse.clone()),
        dq: new.dq.as_ref().and(stored.dq.clone()),
        dk: new.dk.as_ref().and(stored.dk.clone()),
        dv: new.dv.as_ref().and(stored.dv.clone()),
        dbias: new.dbias.as_ref().and(stored.dbias.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("device".to_string(), "NVIDIA H200".to_string()),
            ("kernels".to_string(), "00ff".to_string()),
        ])
    }

    #[test]
    fn provenance_comparison_names_each_changed_entry() {
        assert_eq!(compare_provenance(None, &now()), Provenance::Missing);
        let same = r#"{"device":"NVIDIA H200","kernels":"00ff"}"#;
        assert_eq!(compare_provenance(Some(same), &now()), Provenance::Same);
        let other = r#"{"device":"NVIDIA H100","driver":"13.0","kernels":"00ff"}"#;
        assert_eq!(
            compare_provenance(Some(other), &now()),
            Provenance::Differs(vec![
                "device: capsule NVIDIA H100, now NVIDIA H200".to_string(),
                "driver: capsule 13.0, now (none)".to_string(),
            ])
        );
        assert!(matches!(
            compare_provenance(Some("[1,2]"), &now()),
            Provenance::Unreadable(_)
        ));
    }

    #[test]
    fn the_commit_line_says_which_build_to_check_out() {
        assert_eq!(
            commit_line(None, Some("abc")),
            "harness: the capsule records no commit"
        );
        assert_eq!(
            commit_line(Some("abc"), Some("abc")),
            "harness: commit abc, as this build's"
        );
        assert_eq!(
            commit_line(Some("abc"), Some("def")),
            "harness: capsule written at commit abc; this build is def"
        );
        assert!(commit_line(Some("abc"), None).contains("unknown"));
        assert_eq!(
            commit_line(Some("abc+dirty"), Some("def")),
            "harness: capsule written by a build of commit abc with uncommitted changes (no \
             checkout holds its exact code); this build is def"
        );
        assert!(commit_line(Some("abc+dirty"), Some("abc+dirty")).contains("may differ"));
        assert!(commit_line(Some("abc+dirty"), None).ends_with("of an unknown commit"));
    }

    #[test]
    fn a_stamp_records_this_builds_commit_and_never_passes_on_an_old_one() {
        let be = crate::backend::cpu::CpuBackend::default();
        let mut meta = BTreeMap::from([(COMMIT.to_string(), "0ld".to_string())]);
        super::super::capsule::stamp(&mut meta, &be);
        assert_eq!(meta.get(COMMIT).map(String::as_str), build_commit());
        // This crate is built from its git checkout here (and in `.ci/run`'s clean clone).
        if std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(".git")
            .exists()
        {
            let c = build_commit().expect("a build in a git checkout knows its commit");
            let hash = c.strip_suffix("+dirty").unwrap_or(c);
            assert!(
                hash.len() == 40 && hash.chars().all(|x| x.is_ascii_hexdigit()),
                "{c}"
            );
            // build.rs's inputs, as they are now (cargo rebuilt on any change).
            let status = std::process::Command::new("git")
                .args(["--no-optional-locks", "status", "--porcelain", "--"])
                .args(env!("SMALLSEQ_BUILD_INPUTS").split(' '))
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .output();
            if let Some(o) = status.ok().filter(|o| o.status.success()) {
                assert_eq!(c.ends_with("+dirty"), !o.stdout.is_empty(), "{c}");
            }
        }
    }
}
