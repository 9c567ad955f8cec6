//! Writing a file so that a reader, or a process killed half-way, sees the old file or the new
//! one, never half of one. Case files, a worker's scratch inputs and the reports all write
//! this way; it sits below all of them so that none needs the others' modules for it.

use crate::error::{Error, Result};
use std::path::Path;

/// Writes `bytes` to `path` atomically: a temporary file in the same directory (a rename
/// across file systems would not be atomic), then a rename. Creates the directory.
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
}
