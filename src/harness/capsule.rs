//! Failure capsules: the case, the backend's outputs and the verdict, in one case file,
//! written atomically before the failure is reported.

use super::props::{CaseRun, Checker, Failure};
use super::tolerance::Judgement;
use crate::backend::Backend;
use crate::case::Case;
use crate::case_file::{write_case, OutputPrecision};
use crate::error::Result;
use serde::{Deserialize, Serialize};
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

/// Key of the worker command (a JSON array of words) that ran an implementation outside the
/// tree (`--backend exec`): the printed repro line reruns the case through it.
pub const WORKER: &str = "smallseq.worker";

/// The metadata key of the commit the writing build was made from.
pub const COMMIT: &str = "smallseq.commit";

/// Where capsules' and reports' callers found it before the worker handshake needed it too.
pub use crate::build_commit;

/// Records in `meta` which backend produced a case file's outputs (`smallseq.backend`), on
/// what device and kernel build (`smallseq.provenance`), and this build's commit
/// (`smallseq.commit`; removed when unknown, so an older one is never passed on as this one).
pub fn stamp(meta: &mut BTreeMap<String, String>, backend: &dyn Backend) {
    stamp_as(meta, backend.name(), backend.design(), backend.provenance());
}

/// [`stamp`] for outputs of a runner (in this process or a worker).
pub fn stamp_as(
    meta: &mut BTreeMap<String, String>,
    name: &str,
    design: super::conditioning::Design,
    provenance: BTreeMap<String, String>,
) {
    meta.insert("smallseq.backend".into(), name.into());
    meta.insert(super::conditioning::DESIGN_KEY.into(), design.name().into());
    match build_commit() {
        Some(c) => meta.insert(COMMIT.into(), c.into()),
        None => meta.remove(COMMIT),
    };
    if !provenance.is_empty() {
        meta.insert(PROVENANCE.into(), serde_json::json!(provenance).to_string());
    }
}

/// The metadata key of [`Replay`], a JSON object.
pub const REPLAY: &str = "smallseq.replay";

/// The case timeout a hang capsule records (`case_timeout_s` of [`FAULT`]): the time the
/// worker was given before the case was called a hang. `None` for any other capsule.
pub fn recorded_case_timeout(case: &Case) -> Option<std::time::Duration> {
    let v: serde_json::Value = serde_json::from_str(case.meta.get(FAULT)?).ok()?;
    let s = v.get("case_timeout_s")?.as_f64()?;
    (s.is_finite() && s > 0.0).then(|| std::time::Duration::from_secs_f64(s))
}

/// The metadata key of the path the stored outputs' forward ran (`small_seq`, `fallback`).
pub const PATH: &str = "smallseq.path";

/// The metadata key of the path the stored outputs' backward ran (`small_seq`, `fallback`).
pub const PATH_BWD: &str = "smallseq.path_bwd";

/// The paths a capsule's stored outputs ran, forward and backward, by name: the backward's
/// taken as the forward's where a capsule predates [`PATH_BWD`].
pub fn recorded_paths(case: &Case) -> (Option<&str>, Option<&str>) {
    let fwd = case.meta.get(PATH).map(String::as_str);
    (fwd, case.meta.get(PATH_BWD).map(String::as_str).or(fwd))
}

/// The variable the CUDA backend reads extra kernel defines from.
pub const KERNEL_DEFINES_ENV: &str = "SMALLSEQ_KERNEL_DEFINES";

/// Where in a campaign a capsule's case came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub campaign_seed: u64,
    pub case: u64,
    /// Cases the campaign checked at once (the case's verdict does not depend on it; recorded
    /// so a replay can say under what load the failure was seen).
    pub jobs: usize,
}

/// Every input the dispatch decision and the kernels saw when a capsule's outputs were made,
/// so that `smallseq repro` can run the case again under the same ones.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replay {
    pub backend: String,
    pub profile: String,
    /// The arch the gate was asked about.
    pub arch: String,
    /// The dispatch environment as the dispatch saw it: the process's variables and those the
    /// profile defaulted (`fuzz --profile te625` sets `NVTE_FUSED_ATTN_CK_SMALLSEQ=1`).
    pub env: BTreeMap<String, String>,
    /// The kernels' preprocessor defines (CUDA: `SMALLSEQ_KERNEL_DEFINES` and planted bugs).
    pub kernel_defines: Vec<String>,
    /// Bugs planted in the CPU backend (`fuzz --plant`), by mutant name.
    pub planted: Vec<String>,
    /// The salt the properties ran with (it picks the metamorphic relation and re-poisoning).
    pub salt: u64,
    pub origin: Option<Origin>,
}

impl Replay {
    /// The inputs of `checker` checking a case with `salt`. Planted bugs and kernel defines
    /// come from the backend's provenance (`defects` of the plain CPU backend, `defines` of
    /// the CUDA one), which every way of running a backend reports.
    pub fn of(checker: &Checker, salt: u64, origin: Option<Origin>) -> Self {
        let be = checker.runner.as_ref();
        let provenance = be.provenance();
        let listed = |key: &str, sep: char| -> Vec<String> {
            provenance.get(key).map_or_else(Vec::new, |v| {
                v.split(sep)
                    .filter(|x| !x.is_empty())
                    .map(String::from)
                    .collect()
            })
        };
        Replay {
            backend: be.name().into(),
            profile: checker.opts.profile.name().into(),
            arch: be.caps().arch.clone().unwrap_or_default(),
            env: checker
                .opts
                .env
                .pairs()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            kernel_defines: listed("defines", ' '),
            // The TE model's defects are what its name opens, not planted.
            planted: if be.name() == "cpu" {
                listed("defects", ',')
            } else {
                Vec::new()
            },
            salt,
            origin,
        }
    }

    /// The record in `meta`: `None` when there is none (a capsule written before replay inputs
    /// were recorded), an error text when it does not parse.
    pub fn from_meta(meta: &BTreeMap<String, String>) -> Option<std::result::Result<Self, String>> {
        meta.get(REPLAY)
            .map(|s| serde_json::from_str(s).map_err(|e| format!("{REPLAY} does not parse: {e}")))
    }

    /// One line naming what a replay applies.
    pub fn describe(&self) -> String {
        let env = if self.env.is_empty() {
            "no dispatch variable set".to_string()
        } else {
            let vars: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vars.join(" ")
        };
        let mut line = format!(
            "profile {}, arch {}, env {env}, salt {}",
            self.profile, self.arch, self.salt
        );
        if !self.kernel_defines.is_empty() {
            line.push_str(&format!(
                ", kernel defines {}",
                self.kernel_defines.join(" ")
            ));
        }
        if !self.planted.is_empty() {
            line.push_str(&format!(", planted {}", self.planted.join(",")));
        }
        if let Some(o) = self.origin {
            line.push_str(&format!(
                " (campaign seed {}, case {}, {} job(s))",
                o.campaign_seed, o.case, o.jobs
            ));
        }
        line
    }
}

/// Writes a capsule for `case` with the outputs and verdict of `run`, made by `checker` with
/// `salt`, and the [`Replay`] inputs that reproduce it.
///
/// # Errors
/// I/O errors.
pub fn write(
    path: &Path,
    case: &Case,
    run: &CaseRun,
    checker: &Checker,
    salt: u64,
    origin: Option<Origin>,
) -> Result<()> {
    let runner = checker.runner.as_ref();
    let mut c = case.clone();
    c.outputs = run.outputs.clone();
    let design = checker.design();
    stamp_as(&mut c.meta, runner.name(), design, runner.provenance());
    if let Some(cmd) = runner.worker_command().filter(|_| runner.external()) {
        c.meta
            .insert(WORKER.into(), serde_json::json!(cmd).to_string());
    }
    if let Some(f) = &run.fault {
        c.meta.insert(
            FAULT.into(),
            serde_json::json!({
                "kind": f.kind.name(),
                "detail": f.detail,
                "stderr_tail": f.stderr,
                "worker": runner.worker_command(),
                "case_timeout_s": f.timeout_s,
            })
            .to_string(),
        );
    }
    let replay = Replay::of(checker, salt, origin);
    c.meta
        .insert("smallseq.profile".into(), replay.profile.clone());
    c.meta.insert(
        REPLAY.into(),
        serde_json::to_string(&replay).expect("replay serialises"),
    );
    if let Some(p) = run.path_fwd {
        c.meta.insert(PATH.into(), p.name().into());
    }
    if let Some(p) = run.path_bwd {
        c.meta.insert(PATH_BWD.into(), p.name().into());
    }
    c.meta.insert(
        "smallseq.verdict".into(),
        verdict_json(&run.failures(), &run.judgements),
    );
    write_case(&c, path, OutputPrecision::Device)
}
