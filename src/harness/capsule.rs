//! Failure capsules: the case, the backend's outputs and the verdict, in one case file,
//! written atomically before the failure is reported.

use super::props::{CaseRun, Failure};
use super::tolerance::Judgement;
use crate::backend::Backend;
use crate::case::Case;
use crate::case_file::{write_case, OutputPrecision};
use crate::error::Result;
use crate::runner::Runner;
use std::collections::BTreeMap;
use std::path::Path;

/// The `smallseq.verdict` JSON.
pub fn verdict_json(failures: &[&Failure], judgements: &[Judgement]) -> String {
    let margins: BTreeMap<&str, f64> = judgements
        .iter()
        .map(|j| (j.tensor.as_str(), j.margin))
        .collect();
    let first = failures.first();
    serde_json::json!({
        "property": first.map(|f| f.prop.name()),
        "detail": first.map(|f| f.detail.clone()),
        "worst": first.and_then(|f| f.worst.clone()),
        "failures": failures.iter().map(|f| serde_json::json!({"property": f.prop.name(), "detail": f.detail, "margin": finite(f.margin)})).collect::<Vec<_>>(),
        "margins": margins.into_iter().map(|(k, v)| (k.to_string(), finite(v))).collect::<BTreeMap<_, _>>(),
    })
    .to_string()
}

/// JSON has no infinity; write it as a large sentinel string-free number.
fn finite(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::json!("inf")
    }
}

/// The metadata key of the producing backend's [`Backend::provenance`], a JSON object.
pub const PROVENANCE: &str = "smallseq.provenance";

/// The metadata key of a worker fault (`kind`, `detail`, `stderr_tail`, `worker`), JSON.
pub const FAULT: &str = "smallseq.fault";

/// The metadata key of the commit the writing build was made from.
pub const COMMIT: &str = "smallseq.commit";

/// The commit this build was made from (`git rev-parse HEAD` when it was built; uncommitted
/// changes are not seen); `None` for a build from outside a git checkout.
pub fn build_commit() -> Option<&'static str> {
    Some(env!("SMALLSEQ_GIT_COMMIT")).filter(|c| !c.is_empty())
}

/// Records in `meta` which backend produced a case file's outputs (`smallseq.backend`), on
/// what device and kernel build (`smallseq.provenance`), and this build's commit
/// (`smallseq.commit`; removed when unknown, so an older one is never passed on as this one).
pub fn stamp(meta: &mut BTreeMap<String, String>, backend: &dyn Backend) {
    stamp_as(meta, backend.name(), backend.provenance());
}

/// [`stamp`] for outputs of a runner (in this process or a worker).
pub fn stamp_as(
    meta: &mut BTreeMap<String, String>,
    name: &str,
    provenance: BTreeMap<String, String>,
) {
    meta.insert("smallseq.backend".into(), name.into());
    match build_commit() {
        Some(c) => meta.insert(COMMIT.into(), c.into()),
        None => meta.remove(COMMIT),
    };
    if !provenance.is_empty() {
        meta.insert(PROVENANCE.into(), serde_json::json!(provenance).to_string());
    }
}

/// Writes a capsule for `case` with the outputs and verdict of `run` on `backend`.
///
/// # Errors
/// I/O errors.
pub fn write(
    path: &Path,
    case: &Case,
    run: &CaseRun,
    runner: &dyn Runner,
    profile: &str,
) -> Result<()> {
    let mut c = case.clone();
    c.outputs = run.outputs.clone();
    stamp_as(&mut c.meta, runner.name(), runner.provenance());
    if let Some(f) = &run.fault {
        c.meta.insert(
            FAULT.into(),
            serde_json::json!({
                "kind": f.kind.name(),
                "detail": f.detail,
                "stderr_tail": f.stderr,
                "worker": runner.worker_command(),
            })
            .to_string(),
        );
    }
    c.meta.insert("smallseq.profile".into(), profile.into());
    if let Some(p) = run.path_fwd {
        c.meta.insert("smallseq.path".into(), p.name().into());
    }
    if let Some(p) = run.path_bwd {
        c.meta.insert("smallseq.path_bwd".into(), p.name().into());
    }
    c.meta.insert(
        "smallseq.verdict".into(),
        verdict_json(&run.failures(), &run.judgements),
    );
    write_case(&c, path, OutputPrecision::Device)
}
