//! The standalone script of a triage group: `adapters/standalone.py` writes it (numpy and the
//! framework only, no smallseq), from the capsule. A capsule of an outside implementation
//! records its worker command, whose adapter is embedded and called as the campaign called it;
//! smallseq's own backends have no framework to call, so their script checks the outputs the
//! capsule recorded against the numpy f64 reference (`--recorded`).

use super::capsule::WORKER;
use crate::case::Case;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where `adapters/standalone.py` is: `explicit`, else `SMALLSEQ_ADAPTERS`, else the source
/// tree this binary was built from, else `./adapters`.
pub fn adapters_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    let candidates = [
        explicit.map(Path::to_path_buf),
        std::env::var_os("SMALLSEQ_ADAPTERS").map(PathBuf::from),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("adapters")),
        Some(PathBuf::from("adapters")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|d| d.join("standalone.py").is_file())
}

/// The adapter (its path) and its flags, where `case` records a worker that is a Python
/// adapter (`python3 adapters/torch_sdpa.py --kernel flash`).
pub fn recorded_adapter(case: &Case, adapters: &Path) -> Option<(PathBuf, Vec<String>)> {
    let words: Vec<String> = serde_json::from_str(case.meta.get(WORKER)?).ok()?;
    let at = words.iter().position(|w| w.ends_with(".py"))?;
    let script = PathBuf::from(&words[at]);
    let path = if script.is_file() {
        script
    } else {
        adapters.join(script.file_name()?)
    };
    path.is_file().then(|| (path, words[at + 1..].to_vec()))
}

/// The Python that writes the scripts: `SMALLSEQ_PYTHON` (a venv with numpy and safetensors,
/// as `ci/python-kit.sh` makes), else `python3` from `PATH`.
pub fn python() -> String {
    std::env::var("SMALLSEQ_PYTHON")
        .ok()
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Writes the standalone script of `capsule` to `dest`; the reason, in one sentence, where
/// none can be written.
pub fn write(
    capsule: &Path,
    case: &Case,
    dest: &Path,
    adapters: Option<&Path>,
) -> Result<(), String> {
    let Some(dir) = adapters_dir(adapters) else {
        return Err(
            "adapters/standalone.py was not found (pass --adapters DIR or set \
                    SMALLSEQ_ADAPTERS)"
                .into(),
        );
    };
    let python = python();
    let mut cmd = Command::new(&python);
    cmd.arg(dir.join("standalone.py")).arg(capsule);
    cmd.arg("-o").arg(dest);
    match recorded_adapter(case, &dir) {
        Some((adapter, flags)) => {
            cmd.arg("--adapter").arg(adapter).args(flags);
        }
        None if case.meta.contains_key(WORKER) => {
            return Err(
                "the capsule's worker is not a Python adapter of adapters/, so there \
                        is no framework call to embed"
                    .into(),
            );
        }
        None => {
            cmd.arg("--recorded");
        }
    }
    let out = cmd
        .output()
        .map_err(|e| format!("{python} could not be started: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or("no message").trim();
    let hint = if last.starts_with("ModuleNotFoundError") {
        " (standalone.py needs numpy and safetensors: install them, or set SMALLSEQ_PYTHON \
         to a Python that has them, e.g. the venv of ci/python-kit.sh)"
    } else {
        ""
    };
    Err(format!(
        "adapters/standalone.py failed under {python} ({}): {last}{hint}",
        out.status
    ))
}
