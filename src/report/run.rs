//! What a page shows of one campaign, read from `report.json` (or from the report in memory,
//! through the same JSON), so pages render the reports of older and newer builds alike:
//! fields a report lacks take their defaults.

use crate::error::{Error, Result};
use crate::harness::histogram::Histogram;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Counts {
    pub pass: u64,
    pub fail: u64,
    pub skip: u64,
}

/// JSON has no infinity: serde writes an infinite percentile as `null`, read back as `None`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Percentiles {
    pub n: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Failure {
    pub case: u64,
    pub property: String,
    pub detail: String,
    pub capsule: String,
    pub shrunk_capsule: Option<String>,
    pub repro: String,
}

impl Failure {
    /// The capsule the repro command names: the shrunk one when there is one.
    pub fn capsule_shown(&self) -> &str {
        self.shrunk_capsule.as_deref().unwrap_or(&self.capsule)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Run {
    pub cases: u64,
    pub seed: u64,
    pub backend: String,
    pub profile: String,
    pub elapsed_s: f64,
    pub cases_per_s: f64,
    pub properties: BTreeMap<String, Counts>,
    pub skip_reasons: BTreeMap<String, u64>,
    pub coverage: BTreeMap<String, u64>,
    pub paths: BTreeMap<String, u64>,
    pub margins: BTreeMap<String, Percentiles>,
    pub margin_histograms: BTreeMap<String, Histogram>,
    pub failures: Vec<Failure>,
    pub interrupted: bool,
    /// Where the report was read from (empty for one in memory).
    #[serde(skip)]
    pub dir: PathBuf,
    /// When `report.json` was last written.
    #[serde(skip)]
    pub written: Option<SystemTime>,
}

impl Run {
    /// The report as a page sees it.
    ///
    /// # Errors
    /// [`Error::Report`] if `report` does not serialise to a report's JSON.
    pub fn of<T: serde::Serialize>(report: &T, dir: &Path) -> Result<Self> {
        let value = serde_json::to_value(report).map_err(|e| Error::Report(e.to_string()))?;
        let mut run: Run =
            serde_json::from_value(value).map_err(|e| Error::Report(e.to_string()))?;
        run.dir = dir.to_path_buf();
        Ok(run)
    }

    /// Reads `DIR/report.json` (or the file itself when `path` names one).
    ///
    /// # Errors
    /// [`Error::Io`] naming the file, or [`Error::Report`] naming it and what is wrong.
    pub fn read(path: &Path) -> Result<Self> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("report.json"))
        } else {
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (dir, path.to_path_buf())
        };
        let io = |source| Error::Io {
            path: file.display().to_string(),
            source,
        };
        let text = std::fs::read_to_string(&file).map_err(io)?;
        let written = std::fs::metadata(&file).and_then(|m| m.modified()).ok();
        let mut run: Run = serde_json::from_str(&text).map_err(|e| {
            Error::Report(format!("{}: not a smallseq report: {e}", file.display()))
        })?;
        run.dir = dir;
        run.written = written;
        Ok(run)
    }

    /// A failure's capsule on this machine: its recorded path when that exists (relative to
    /// where the campaign ran), else the file of that name in this run's `capsules/`, as in a
    /// downloaded CI artifact.
    pub fn locate(&self, capsule: &str) -> PathBuf {
        let recorded = PathBuf::from(capsule);
        if recorded.exists() {
            return recorded;
        }
        let beside = self.dir.join(capsule);
        if beside.exists() {
            return beside;
        }
        match recorded.file_name() {
            Some(name) => self.dir.join("capsules").join(name),
            None => recorded,
        }
    }

    /// A short name for the run: its directory's name.
    pub fn name(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.dir.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_report_without_histograms_reads_and_infinite_percentiles_are_none() {
        let json = r#"{"cases":3,"seed":1,"backend":"cpu","profile":"native","elapsed_s":1.0,
            "cases_per_s":3.0,"properties":{"eligibility":{"pass":3,"fail":0,"skip":0}},
            "margins":{"o":{"n":3,"p50":0.1,"p90":0.2,"p99":0.2,"max":null}},
            "failures":[{"case":2,"property":"numeric_agreement","detail":"d","capsule":"c",
            "shrunk_capsule":null,"shrunk_size":[1,2],"repro":"r"}],"interrupted":false}"#;
        let dir = std::env::temp_dir().join(format!("smallseq-run-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("report.json"), json).unwrap();
        let run = Run::read(&dir).unwrap();
        assert!(run.margin_histograms.is_empty());
        assert_eq!(run.margins["o"].max, None);
        assert_eq!(run.failures[0].capsule_shown(), "c");
        assert_eq!(run.locate("c"), dir.join("capsules").join("c"));
        assert!(run.written.is_some());
        std::fs::write(dir.join("report.json"), "{\"cases\": \"many\"}").unwrap();
        let err = Run::read(&dir).unwrap_err().to_string();
        assert!(err.contains("report.json: not a smallseq report"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
