//! The messages of `smallseq-worker/1` (`docs/worker-protocol.md`), one JSON object per line.

use crate::dispatch::{EnvView, Path};
use crate::error::{Error, Result};
use crate::runner::WireCaps;
use crate::wrapper::{RunOptions, WorkspaceReport};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The protocol version a handshake must name.
pub const PROTOCOL: &str = "smallseq-worker/1";

/// The worker's first line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Handshake {
    pub protocol: String,
    pub name: String,
    #[serde(default)]
    pub version: String,
    /// Values of any JSON type; kept as text.
    #[serde(default)]
    pub provenance: BTreeMap<String, Value>,
    #[serde(default)]
    pub caps: WireCaps,
}

impl Handshake {
    /// Provenance values as text (strings verbatim, anything else as JSON).
    pub fn provenance_text(&self) -> BTreeMap<String, String> {
        self.provenance
            .iter()
            .map(|(k, v)| {
                let t = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), t)
            })
            .collect()
    }
}

/// A request line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    pub op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub case: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out: Option<String>,
    #[serde(default)]
    pub want: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub force: Option<String>,
    /// A number, or `"nan"`.
    #[serde(default)]
    pub fill: Option<Value>,
    #[serde(default)]
    pub trace_env: Option<BTreeMap<String, String>>,
    /// A file holding `o` and `lse`: compute only the backward, from that forward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lse_from: Option<String>,
}

/// The paths a reply names.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Paths {
    #[serde(default)]
    pub fwd: Option<String>,
    #[serde(default)]
    pub bwd: Option<String>,
}

/// The workspace reports a reply carries.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Workspaces {
    #[serde(default)]
    pub fwd: WorkspaceReport,
    #[serde(default)]
    pub bwd: WorkspaceReport,
}

/// A typed error on the wire.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct WireError {
    pub kind: String,
    #[serde(default)]
    pub message: String,
}

/// A reply line.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Reply {
    pub id: u64,
    pub ok: bool,
    #[serde(default)]
    pub path: Option<Paths>,
    #[serde(default)]
    pub elapsed_us: Option<u64>,
    #[serde(default)]
    pub workspace: Option<Workspaces>,
    #[serde(default)]
    pub error: Option<WireError>,
}

/// Error kinds, stable on the wire.
pub const KINDS: [&str; 5] = ["unsupported", "invalid", "workspace", "device", "internal"];

/// The wire error of a library error: its kind and its message.
pub fn wire_error(e: &Error) -> WireError {
    let kind = match e {
        Error::Unsupported(_) => "unsupported",
        Error::Workspace(_) => "workspace",
        Error::Layout(_) | Error::Config(_) | Error::CaseFile { .. } | Error::Tensor { .. } => {
            "invalid"
        }
        Error::NoDevice { .. } | Error::Device { .. } => "device",
        _ => "internal",
    };
    // The variant's own prefix ("unsupported: ") is the kind already.
    let message = match e {
        Error::Unsupported(m) | Error::Workspace(m) => m.clone(),
        other => other.to_string(),
    };
    WireError {
        kind: kind.into(),
        message,
    }
}

/// The library error a wire error stands for (`device` is a fault, handled by the caller).
pub fn from_wire(name: &str, e: &WireError) -> Error {
    match e.kind.as_str() {
        "unsupported" => Error::Unsupported(e.message.clone()),
        "workspace" => Error::Workspace(e.message.clone()),
        "invalid" => Error::Backend {
            backend: name.into(),
            detail: format!("refused the case as invalid: {}", e.message),
        },
        kind => Error::Backend {
            backend: name.into(),
            detail: format!("{kind} error: {}", e.message),
        },
    }
}

/// Parses a path name from a reply.
pub fn path_of(name: Option<&str>) -> Result<Option<Path>> {
    match name {
        None | Some("none") => Ok(None),
        Some("small_seq") => Ok(Some(Path::SmallSeq)),
        Some("fallback") => Ok(Some(Path::Fallback)),
        Some(other) => Err(Error::config(format!(
            "worker reply path {other:?} is not small_seq, fallback or none"
        ))),
    }
}

fn env_map(env: &EnvView) -> BTreeMap<String, String> {
    crate::dispatch::facts::ENV_KEYS
        .iter()
        .filter_map(|k| env.get(k).map(|v| (k.to_string(), v.to_string())))
        .collect()
}

/// The request that runs a case under `opts`; harness options only for workers that take them.
pub fn run_request(
    id: u64,
    case: &std::path::Path,
    out: &std::path::Path,
    want: Vec<String>,
    opts: &RunOptions,
    harness_options: bool,
) -> Request {
    let fill = (harness_options && opts.fill.to_bits() != 0f32.to_bits()).then(|| {
        if opts.fill.is_nan() {
            Value::String("nan".into())
        } else {
            serde_json::json!(opts.fill)
        }
    });
    Request {
        id,
        op: "run".into(),
        case: Some(case.display().to_string()),
        out: Some(out.display().to_string()),
        want,
        env: env_map(&opts.env),
        force: opts
            .force
            .filter(|_| harness_options)
            .map(|p| p.name().to_string()),
        fill,
        trace_env: opts
            .trace_env
            .as_ref()
            .filter(|_| harness_options)
            .map(env_map),
        lse_from: None,
    }
}

/// The options a worker applies to a request.
///
/// # Errors
/// [`Error::Config`] for a `force` or `fill` it cannot read.
pub fn options_of(req: &Request, base: &RunOptions) -> Result<RunOptions> {
    let force = match req.force.as_deref() {
        None => None,
        Some(p) => path_of(Some(p))?,
    };
    let fill = match &req.fill {
        None => 0.0,
        Some(Value::String(s)) if s == "nan" => f32::NAN,
        Some(Value::Number(n)) => n.as_f64().unwrap_or(0.0) as f32,
        Some(other) => {
            return Err(Error::config(format!(
                "request fill {other} is neither a number nor \"nan\""
            )))
        }
    };
    let view = |m: &BTreeMap<String, String>| EnvView::from_pairs(m.clone());
    Ok(RunOptions {
        profile: base.profile,
        env: view(&req.env),
        force,
        fill,
        trace_env: req.trace_env.as_ref().map(view),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_carry_harness_options_only_to_workers_that_take_them() {
        let opts = RunOptions {
            fill: f32::NAN,
            force: Some(Path::Fallback),
            env: EnvView::from_pairs([("SMALLSEQ_FORCE_FALLBACK".into(), "1".into())]),
            ..RunOptions::default()
        };
        let p = std::path::Path::new("/x");
        let r = run_request(3, p, p, vec!["o".into()], &opts, true);
        let back = options_of(&r, &RunOptions::default()).unwrap();
        assert!(back.fill.is_nan());
        assert_eq!(back.force, Some(Path::Fallback));
        assert_eq!(back.env.get("SMALLSEQ_FORCE_FALLBACK"), Some("1"));
        let plain = run_request(3, p, p, vec![], &opts, false);
        assert!(plain.fill.is_none() && plain.force.is_none());
        assert_eq!(
            plain.env.len(),
            1,
            "the dispatch environment always travels"
        );
    }

    #[test]
    fn wire_errors_keep_their_kind() {
        for e in [
            Error::Unsupported("x".into()),
            Error::Workspace("y".into()),
            Error::config("z"),
        ] {
            let w = wire_error(&e);
            assert!(KINDS.contains(&w.kind.as_str()));
            let back = from_wire("w", &w);
            assert_eq!(
                std::mem::discriminant(&back) == std::mem::discriminant(&e),
                w.kind != "invalid"
            );
        }
        assert!(path_of(Some("warp")).is_err());
        // A failed device call is a crash on the wire, whichever GPU backend; a backend's own
        // refusal (a grid too large, a kernel build) fails the property that asked.
        for backend in ["cuda", "hip"] {
            let device = Error::Device {
                backend: backend.into(),
                detail: "launch failed".into(),
            };
            assert_eq!(wire_error(&device).kind, "device");
            let own = Error::Backend {
                backend: backend.into(),
                detail: "1 work items exceed the 1-D grid".into(),
            };
            assert_eq!(wire_error(&own).kind, "internal");
        }
    }
}
