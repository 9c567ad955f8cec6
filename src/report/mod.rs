//! Pictures of campaigns: `report.html` beside `report.json` (properties, coverage, margin
//! histograms, an error picture per failure), and one page over several runs
//! (`smallseq report`).

pub mod charts;
pub mod heatmap;
pub mod page;
pub mod run;

pub use crate::harness::histogram::Histogram;
pub use run::Run;

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Writes `dir/report.html` for `report` (a campaign's `Report`, or anything that serialises
/// to its JSON), atomically.
///
/// # Errors
/// I/O errors naming the file.
pub fn write_html<T: serde::Serialize>(dir: &Path, report: &T) -> Result<()> {
    let run = Run::of(report, dir)?;
    write_atomic(&dir.join("report.html"), &page::run_page(&run))
}

/// How `smallseq report` orders its runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// By when each `report.json` was written, oldest first (ties by name).
    Time,
    /// By directory name.
    Name,
}

/// Reads the reports in `dirs` (directories holding `report.json`, or the files) and renders
/// one page over them, in `order`.
///
/// # Errors
/// A report that cannot be read, or no report at all.
pub fn runs_page(dirs: &[PathBuf], order: Order) -> Result<String> {
    if dirs.is_empty() {
        return Err(Error::Report("no run directory given".into()));
    }
    let mut runs = dirs
        .iter()
        .map(|d| Run::read(d))
        .collect::<Result<Vec<_>>>()?;
    match order {
        Order::Time => runs.sort_by(|a, b| a.written.cmp(&b.written).then(a.name().cmp(&b.name()))),
        Order::Name => runs.sort_by_key(Run::name),
    }
    Ok(page::runs_page(&runs))
}

/// Writes `text` to `path` through a temporary file in the same directory and a rename.
///
/// # Errors
/// I/O errors naming `path`.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}
