//! Writing a campaign's reports (`report.json`, `junit.xml`, `summary.md`, `margins.json`) so
//! that a stopped campaign always leaves one: every file is written
//! atomically (a temporary file in the same directory, then a rename), a running campaign
//! rewrites a partial report every few seconds (so even SIGKILL leaves the last one), and an
//! output directory reused from a previous run is cleaned of the files that run wrote.

use super::campaign::{Budget, Report};
use crate::error::{Error, Result};
use serde::ser::SerializeMap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the reports' callers found it before case files and workers needed it too.
pub use crate::files::write_atomic;

/// Writes `report.json`, `junit.xml`, `summary.md` and `margins.json` into `dir`, each
/// atomically. The page beside them, `report.html`, is drawn by [`crate::report`], which
/// reads these: the caller writes it once the report is final.
///
/// # Errors
/// I/O errors.
pub fn write_reports(dir: &Path, rep: &Report) -> Result<()> {
    let json = serde_json::to_string_pretty(rep).expect("report serialises");
    // Atomic: a signal or SIGKILL mid-write leaves the previous (partial) report whole.
    write_atomic(&dir.join("report.json"), json.as_bytes())?;
    write_atomic(&dir.join("junit.xml"), junit(rep).as_bytes())?;
    let samples = serde_json::to_string(&rep.margin_samples).expect("margins serialise");
    write_atomic(&dir.join("margins.json"), samples.as_bytes())?;
    write_atomic(&dir.join("summary.md"), markdown(rep).as_bytes())
}

/// A short Markdown summary for CI pages: verdict, per-property counts, every failure with
/// its capsule and repro command (capsule paths as written, relative to the run directory).
pub fn markdown(rep: &Report) -> String {
    let verdict = if rep.failed() {
        format!("**FAILED**: {} failure(s)", rep.failures.len())
    } else if rep.partial {
        "**PARTIAL** (written while the campaign ran; it did not finish), no failure so far"
            .to_string()
    } else if rep.interrupted {
        "**INTERRUPTED**, no failure so far".to_string()
    } else {
        "passed".to_string()
    };
    let mut m = format!(
        "### smallseq fuzz: backend `{}`, profile `{}`, seed {}\n\n{verdict}. {} cases in {:.1} s ({:.1} cases/s).\n\n",
        rep.backend, rep.profile, rep.seed, rep.cases, rep.elapsed_s, rep.cases_per_s
    );
    m.push_str(&markdown_context(rep));
    if let Some(o) = &rep.protocol_overhead_us {
        m.push_str(&format!(
            "Protocol overhead per worker request (round trip minus the worker's own time): \
             median {:.0} µs, p90 {:.0} µs, max {:.0} µs over {} requests.\n\n",
            o.p50, o.p90, o.max, o.n
        ));
    }
    m.push_str(&super::profile::markdown(&rep.stages));
    let per_tensor = |counts: &BTreeMap<String, u64>| {
        counts
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !rep.largest_margins.is_empty() {
        let at: Vec<String> = rep
            .largest_margins
            .iter()
            .map(|(t, m)| {
                format!(
                    "{t} {} (case {})",
                    super::text::decimal(m.margin, 3),
                    m.case
                )
            })
            .collect();
        m.push_str(&format!(
            "Largest margin per tensor (1 is the failure line): {}.\n\n",
            at.join(", ")
        ));
    }
    if !rep.blind_verdicts.is_empty() {
        m.push_str(&format!(
            "Blind verdicts (an output of zeros would have passed): {} (docs/judgement.md, \
             \"Blind verdicts\").\n\n",
            per_tensor(&rep.blind_verdicts)
        ));
    }
    if !rep.indeterminate_verdicts.is_empty() {
        m.push_str(&format!(
            "Indeterminate tensors (every element inside the rounding noise of its own terms): \
             {}.\n\n",
            per_tensor(&rep.indeterminate_verdicts)
        ));
    }
    m.push_str(&rep.dimensions.markdown());
    m.push_str("| property | pass | fail | skip |\n|---|---:|---:|---:|\n");
    for (name, c) in &rep.properties {
        m.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            c.pass, c.fail, c.skip
        ));
    }
    let missed = rep.classes_missed();
    if !missed.is_empty() {
        m.push_str(&format!("\nClasses not hit: {}.\n", missed.join(", ")));
    }
    m.push_str(&markdown_skips(rep));
    if !rep.range_limits.is_empty() {
        m.push_str(&format!(
            "\nRange limits of a 16-bit design, not defects ({} case(s); `fuzz \
             --fail-on-range-limit` fails on them):\n\n| case | characterisation | capsule |\n|---:|---|---|\n",
            rep.range_limits.len()
        ));
        for f in &rep.range_limits {
            m.push_str(&format!(
                "| {} | {} | `{}` |\n",
                f.case,
                f.detail.replace('|', "\\|"),
                f.capsule
            ));
        }
    }
    if !rep.failures.is_empty() {
        m.push_str("\n| case | property | detail | capsule | repro |\n|---:|---|---|---|---|\n");
        for f in &rep.failures {
            let capsule = f.shrunk_capsule.as_deref().unwrap_or(&f.capsule);
            m.push_str(&format!(
                "| {} | {} | {} | `{capsule}` | `{}` |\n",
                f.case,
                f.property,
                f.detail.replace('|', "\\|"),
                f.repro
            ));
        }
    }
    m
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// One test case per property; each failure becomes a `<failure>` with its repro command.
pub fn junit(rep: &Report) -> String {
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let fails = rep.properties.values().filter(|c| c.fail > 0).count();
    let stopped = junit_stopped(rep);
    x.push_str(&format!(
        "<testsuite name=\"smallseq-fuzz-{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" time=\"{:.3}\">\n",
        xml_escape(&rep.backend),
        rep.properties.len() + usize::from(stopped.is_some()),
        fails,
        usize::from(stopped.is_some()),
        rep.elapsed_s
    ));
    for (name, c) in &rep.properties {
        x.push_str(&format!(
            "  <testcase classname=\"smallseq.{}\" name=\"{}\">\n    <system-out>pass {} fail {} skip {}</system-out>\n",
            xml_escape(&rep.backend),
            name,
            c.pass,
            c.fail,
            c.skip
        ));
        for f in rep.failures.iter().filter(|f| &f.property == name) {
            x.push_str(&format!(
                "    <failure message=\"case {}: {}\">{}</failure>\n",
                f.case,
                xml_escape(&f.detail),
                xml_escape(&f.repro)
            ));
        }
        x.push_str("  </testcase>\n");
    }
    if let Some(msg) = stopped {
        x.push_str(&format!(
            "  <testcase classname=\"smallseq.{}\" name=\"campaign\">\n    <error message=\"{}\"/>\n  </testcase>\n",
            xml_escape(&rep.backend),
            xml_escape(&msg)
        ));
    }
    x.push_str("</testsuite>\n");
    x
}

/// How often a running campaign rewrites its partial report, in campaign time.
pub const PARTIAL_EVERY: Duration = Duration::from_secs(5);

/// Rewrites `report.json`, `junit.xml` and `summary.md` as a campaign runs, marked partial,
/// at most every [`PARTIAL_EVERY`] and whenever a failure is added.
pub struct PartialReports {
    dir: PathBuf,
    command: String,
    last: Option<Instant>,
    failures: usize,
}

impl PartialReports {
    /// `command`: the command line, as the final report carries it.
    pub fn new(dir: &Path, command: &str) -> Self {
        PartialReports {
            dir: dir.to_path_buf(),
            command: command.into(),
            last: None,
            failures: 0,
        }
    }

    /// Writes `rep` as a partial report when one is due.
    ///
    /// # Errors
    /// I/O errors.
    pub fn offer(&mut self, rep: &Report) -> Result<()> {
        let due = self.last.is_none_or(|t| t.elapsed() >= PARTIAL_EVERY);
        if !due && rep.failures.len() == self.failures {
            return Ok(());
        }
        self.last = Some(Instant::now());
        self.failures = rep.failures.len();
        let mut r = rep.clone();
        r.partial = true;
        r.command.clone_from(&self.command);
        r.cases_per_s = r.cases as f64 / r.elapsed_s.max(1e-9);
        write_reports(&self.dir, &r)
    }
}

/// Files a campaign writes into its output directory.
const REPORT_FILES: [&str; 7] = [
    "report.json",
    "report.html",
    "margins.json",
    "junit.xml",
    "summary.md",
    "te625.json",
    "mutants.json",
];

/// What an earlier `fuzz`, `mutants` or `merge` run wrote in `dir` (its reports, and the
/// capsules `case-*.safetensors` in `capsules/`), sorted; empty when `dir` holds none.
pub fn previous_report_files(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = REPORT_FILES
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.is_file())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir.join("capsules")) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("case-") && name.contains(".safetensors") && e.path().is_file() {
                found.push(e.path());
            }
        }
    }
    found.sort();
    found
}

/// Removes from `dir` what [`previous_report_files`] finds, so stale capsules never sit next
/// to a new "passed"; other files are left alone. Returns the files removed.
///
/// # Errors
/// [`Error::Io`] naming the file that could not be removed.
pub fn clean_previous(dir: &Path) -> Result<Vec<PathBuf>> {
    let doomed = previous_report_files(dir);
    for p in &doomed {
        std::fs::remove_file(p).map_err(|source| Error::Io {
            path: p.display().to_string(),
            source,
        })?;
    }
    Ok(doomed)
}

/// The lines of `summary.md` that say how the campaign was run: the exact command line, the
/// commit, the budget and the jobs.
pub fn markdown_context(rep: &Report) -> String {
    let mut m = String::new();
    if !rep.command.is_empty() {
        m.push_str(&format!("Command: `{}`\n\n", rep.command));
    }
    m.push_str(&format!(
        "Commit {}, budget {}, {} job(s).\n\n",
        rep.commit.as_deref().unwrap_or("unknown"),
        rep.budget,
        rep.jobs
    ));
    m
}

/// The skip reasons of `summary.md`, most frequent first.
pub fn markdown_skips(rep: &Report) -> String {
    if rep.skip_reasons.is_empty() {
        return String::new();
    }
    let mut reasons: Vec<(&String, &u64)> = rep.skip_reasons.iter().collect();
    reasons.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut m = String::from("\n| skipped (property: reason) | cases |\n|---|---:|\n");
    for (reason, n) in reasons {
        m.push_str(&format!("| {} | {n} |\n", reason.replace('|', "\\|")));
    }
    m
}

/// The JUnit `<error>` of a campaign that did not run to its budget: stopped by a signal, or a
/// partial report of one still running (or killed).
pub fn junit_stopped(rep: &Report) -> Option<String> {
    if rep.partial {
        Some(format!(
            "partial report: written while the campaign ran ({} cases so far); the process did \
             not finish it",
            rep.cases
        ))
    } else if rep.interrupted {
        Some(format!(
            "interrupted by a signal after {} cases, before its budget ({}) was spent",
            rep.cases, rep.budget
        ))
    } else {
        None
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Cases(n) => write!(f, "{n} cases"),
            Budget::Time(t) => write!(f, "{} s", t.as_secs_f64()),
        }
    }
}

/// `{"cases": N}` or `{"time_s": S}`.
impl serde::Serialize for Budget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        match self {
            Budget::Cases(n) => m.serialize_entry("cases", n)?,
            Budget::Time(t) => m.serialize_entry("time_s", &t.as_secs_f64())?,
        }
        m.end()
    }
}

/// Reads what [`Budget`]'s `Serialize` writes (`smallseq merge` reads shard reports).
impl<'de> serde::Deserialize<'de> for Budget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Wire {
            cases: Option<u64>,
            time_s: Option<f64>,
        }
        let w = Wire::deserialize(d)?;
        match (w.cases, w.time_s) {
            (Some(n), _) => Ok(Budget::Cases(n)),
            (None, Some(t)) if t.is_finite() && t >= 0.0 => {
                Ok(Budget::Time(std::time::Duration::from_secs_f64(t)))
            }
            _ => Err(serde::de::Error::custom(
                "a budget is {\"cases\": N} or {\"time_s\": S}",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_read_as_words_and_labelled_json() {
        assert_eq!(Budget::Cases(300).to_string(), "300 cases");
        assert_eq!(Budget::Time(Duration::from_secs(60)).to_string(), "60 s");
        assert_eq!(
            serde_json::to_string(&Budget::Time(Duration::from_millis(1500))).unwrap(),
            r#"{"time_s":1.5}"#
        );
        assert_eq!(
            serde_json::to_string(&Budget::Cases(7)).unwrap(),
            r#"{"cases":7}"#
        );
    }
}
