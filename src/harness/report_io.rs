//! Writing reports so that a stopped campaign always leaves one: every file is written
//! atomically (a temporary file in the same directory, then a rename), a running campaign
//! rewrites a partial report every few seconds (so even SIGKILL leaves the last one), and an
//! output directory reused from a previous run is cleaned of the files that run wrote.

use super::campaign::{write_reports, Budget, Report};
use crate::error::{Error, Result};
use serde::ser::SerializeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Writes `bytes` to `path` atomically: a reader (or a process killed half-way) sees the old
/// file or the new one, never half of one.
///
/// # Errors
/// [`Error::Io`] naming `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}", std::process::id()));
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
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
const REPORT_FILES: [&str; 5] = [
    "report.json",
    "junit.xml",
    "summary.md",
    "te625.json",
    "mutants.json",
];

/// Removes from `dir` what an earlier `fuzz` or `mutants` run wrote there (its reports, and
/// the capsules `case-*.safetensors` in `capsules/`), so stale capsules never sit next to a
/// new "passed"; other files are left alone. Returns the files removed.
///
/// # Errors
/// [`Error::Io`] naming the file that could not be removed.
pub fn clean_previous(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut doomed: Vec<PathBuf> = REPORT_FILES.iter().map(|f| dir.join(f)).collect();
    let capsules = dir.join("capsules");
    if let Ok(entries) = std::fs::read_dir(&capsules) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("case-") && name.contains(".safetensors") {
                doomed.push(e.path());
            }
        }
    }
    let mut removed = Vec::new();
    for p in doomed.into_iter().filter(|p| p.is_file()) {
        std::fs::remove_file(&p).map_err(|source| Error::Io {
            path: p.display().to_string(),
            source,
        })?;
        removed.push(p);
    }
    removed.sort();
    Ok(removed)
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
    fn an_atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("smallseq-report-io-{}", std::process::id()));
        let p = dir.join("report.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
