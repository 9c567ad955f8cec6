//! What an implementation under test can compute: the `caps` of a worker's handshake
//! (`docs/worker-protocol.md`), typed. The campaign draws cases inside them and lists what
//! they leave out.

use crate::config::LayoutKind;
use crate::design::Design;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use smallseq_reference::{Dtype, Mask};

/// What a row with no visible key holds in an implementation's outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoKeyRow {
    /// The semantics: O = 0, LSE = -inf.
    Zero,
    /// NaN in O (and LSE).
    Nan,
    /// Anything else the implementation documents.
    Other,
}

impl NoKeyRow {
    pub fn name(self) -> &'static str {
        match self {
            NoKeyRow::Zero => "zero",
            NoKeyRow::Nan => "nan",
            NoKeyRow::Other => "other",
        }
    }
}

/// The capabilities, typed and validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Caps {
    pub dtypes: Vec<Dtype>,
    pub layouts: Vec<LayoutKind>,
    pub masks: Vec<Mask>,
    pub window: bool,
    pub gqa: bool,
    pub dv_ne_dqk: bool,
    /// `None`: any head dim.
    pub head_dims: Option<Vec<usize>>,
    /// Largest token count per side; `None`: no limit.
    pub max_tokens: Option<usize>,
    pub backward: bool,
    pub lse: bool,
    pub padded_offsets: bool,
    pub reports_path: bool,
    pub reports_workspace: bool,
    pub follows_small_seq_roundings: bool,
    /// Honours `force`, `fill` and `trace_env`.
    pub harness_options: bool,
    pub no_key_row: NoKeyRow,
    /// The architecture the dispatch gate is asked about.
    pub arch: Option<String>,
    /// Whether a small-seq kernel exists for that architecture.
    pub small_seq: bool,
    /// Devices the worker could serve.
    pub devices: usize,
    /// Computes dropout as `docs/semantics.md` §1.8 says (Philox mask, `1/(1−p)`).
    pub dropout: bool,
    /// Computes a post-scale bias and ALiBi as `docs/semantics.md` §1.9 says.
    pub bias: bool,
    /// Returns dBias, the gradient of a post-scale bias (`docs/semantics.md` §1.9), when asked
    /// for it in a request's `want`.
    pub dbias: bool,
    /// The numeric design it declares (docs/judgement.md, "Declared designs"); `None`: undeclared, judged
    /// against the envelope of the common designs.
    pub design: Option<Design>,
    /// The outputs it declares not bitwise deterministic (`caps.nondeterministic`, names of
    /// [`OUTPUTS`] in that order): a kernel that sums partial results in the order its blocks
    /// finish (PyTorch's memory-efficient backward and dQ) differs from run to run in the last
    /// bits by design. `determinism` holds their reruns to tolerance instead of to their bits;
    /// the others keep the bitwise rule.
    pub nondeterministic: Vec<String>,
    /// Why (`caps.nondeterministic_note`), quoted where triage calls a rerun difference a
    /// design limit.
    pub nondeterministic_note: Option<String>,
    /// The least time one call may take (`caps.case_timeout_s`): a worker that compiles each
    /// new shape (JAX's XLA) declares it, and the campaign's default case timeout is never
    /// below it (`--case-timeout` still overrides both).
    pub case_timeout_s: Option<f64>,
}

/// The outputs `caps.nondeterministic` may name, in the order the declaration is kept.
pub const OUTPUTS: [&str; 6] = ["o", "lse", "dq", "dk", "dv", "dbias"];

impl Caps {
    /// Everything the in-tree backends compute, on `arch`. A backend that computes the bias
    /// returns its dBias too.
    pub fn in_tree(arch: &str, small_seq: bool, devices: usize, computes: (bool, bool)) -> Caps {
        let (dropout, bias) = computes;
        Caps {
            dtypes: Dtype::ALL.to_vec(),
            layouts: vec![LayoutKind::Thd, LayoutKind::Bshd],
            masks: Mask::ALL.to_vec(),
            window: true,
            gqa: true,
            dv_ne_dqk: true,
            head_dims: None,
            max_tokens: None,
            backward: true,
            lse: true,
            padded_offsets: true,
            reports_path: true,
            reports_workspace: true,
            follows_small_seq_roundings: true,
            harness_options: true,
            no_key_row: NoKeyRow::Zero,
            arch: Some(arch.into()),
            small_seq,
            devices,
            dropout,
            bias,
            dbias: bias,
            design: Some(Design::Project),
            nondeterministic: Vec::new(),
            nondeterministic_note: None,
            case_timeout_s: None,
        }
    }

    /// These caps declaring `design` (an in-tree backend's [`crate::backend::BackendInfo::design`]).
    pub fn with_design(self, design: Design) -> Caps {
        Caps {
            design: Some(design),
            ..self
        }
    }

    /// Whether `tensor` is declared not bitwise deterministic.
    pub fn declares_nondeterministic(&self, tensor: &str) -> bool {
        self.nondeterministic.iter().any(|t| t == tensor)
    }

    /// Validates the wire form.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field and the value it could not read.
    pub fn from_wire(w: &WireCaps) -> Result<Caps> {
        let bad = |field: &str, v: &str, why: String| {
            Error::config(format!(
                "worker caps.{field}: '{v}' is not understood ({why})"
            ))
        };
        let dtypes = w
            .dtypes
            .iter()
            .map(|s| s.parse::<Dtype>().map_err(|e| bad("dtypes", s, e)))
            .collect::<Result<Vec<_>>>()?;
        let masks = w
            .masks
            .iter()
            .map(|s| s.parse::<Mask>().map_err(|e| bad("masks", s, e)))
            .collect::<Result<Vec<_>>>()?;
        let layouts = w
            .layouts
            .iter()
            .map(|s| match s.as_str() {
                "thd" => Ok(LayoutKind::Thd),
                "bshd" => Ok(LayoutKind::Bshd),
                _ => Err(bad("layouts", s, "expected thd or bshd".into())),
            })
            .collect::<Result<Vec<_>>>()?;
        let no_key_row = match w.no_key_row.as_deref() {
            None | Some("zero") => NoKeyRow::Zero,
            Some("nan") => NoKeyRow::Nan,
            Some("other") => NoKeyRow::Other,
            Some(s) => return Err(bad("no_key_row", s, "expected zero, nan or other".into())),
        };
        let design = w
            .design
            .as_deref()
            .map(|d| d.parse::<Design>().map_err(|e| bad("design", d, e)))
            .transpose()?;
        if let Some(a) = &w.arch {
            a.parse::<crate::dispatch::Arch>()
                .map_err(|e| bad("arch", a, e))?;
        }
        if let Some(t) = w
            .nondeterministic
            .iter()
            .find(|t| !OUTPUTS.contains(&t.as_str()))
        {
            return Err(bad(
                "nondeterministic",
                t,
                format!("expected output names among {}", OUTPUTS.join(", ")),
            ));
        }
        // Kept in the outputs' order, each once: the report and the failure texts list them so.
        let nondeterministic: Vec<String> = (OUTPUTS.iter())
            .filter(|o| w.nondeterministic.iter().any(|t| t == *o))
            .map(|o| o.to_string())
            .collect();
        Ok(Caps {
            dtypes,
            layouts,
            masks,
            window: w.window,
            gqa: w.gqa,
            dv_ne_dqk: w.dv_ne_dqk,
            head_dims: w.head_dims.clone(),
            max_tokens: w.max_tokens,
            backward: w.backward,
            lse: w.lse,
            padded_offsets: w.padded_offsets,
            reports_path: w.reports_path,
            reports_workspace: w.reports_workspace,
            follows_small_seq_roundings: w.follows_small_seq_roundings,
            harness_options: w.harness_options,
            no_key_row,
            arch: w.arch.clone(),
            small_seq: w.small_seq,
            devices: w.devices.unwrap_or(1).max(1),
            dropout: w.dropout,
            bias: w.bias,
            dbias: w.dbias,
            design,
            nondeterministic,
            nondeterministic_note: w.nondeterministic_note.clone(),
            case_timeout_s: match w.case_timeout_s {
                Some(t) if !(t > 0.0 && t <= 86_400.0) => {
                    return Err(bad(
                        "case_timeout_s",
                        &t.to_string(),
                        "seconds, above 0 and at most 86400".into(),
                    ))
                }
                t => t,
            },
        })
    }

    /// The wire form.
    pub fn to_wire(&self) -> WireCaps {
        WireCaps {
            dtypes: self.dtypes.iter().map(|d| d.name().into()).collect(),
            layouts: self.layouts.iter().map(|l| l.name().into()).collect(),
            masks: self.masks.iter().map(|m| m.name().into()).collect(),
            window: self.window,
            gqa: self.gqa,
            dv_ne_dqk: self.dv_ne_dqk,
            head_dims: self.head_dims.clone(),
            max_tokens: self.max_tokens,
            backward: self.backward,
            lse: self.lse,
            padded_offsets: self.padded_offsets,
            reports_path: self.reports_path,
            reports_workspace: self.reports_workspace,
            follows_small_seq_roundings: self.follows_small_seq_roundings,
            harness_options: self.harness_options,
            no_key_row: Some(self.no_key_row.name().into()),
            arch: self.arch.clone(),
            small_seq: self.small_seq,
            devices: Some(self.devices),
            dropout: self.dropout,
            bias: self.bias,
            dbias: self.dbias,
            design: self.design.map(|d| d.name().into()),
            nondeterministic: self.nondeterministic.clone(),
            nondeterministic_note: self.nondeterministic_note.clone(),
            case_timeout_s: self.case_timeout_s,
        }
    }

    /// The design the judge holds it to: the declared one, else the envelope.
    pub fn judged_design(&self) -> Design {
        self.design.unwrap_or(Design::Envelope)
    }

    /// What the campaign cannot draw for this implementation, one line each, for the report's
    /// "not covered" list.
    pub fn not_covered(&self) -> Vec<String> {
        let mut v = Vec::new();
        for d in Dtype::ALL {
            if !self.dtypes.contains(&d) {
                v.push(format!("dtype {d}: not in the worker's caps.dtypes"));
            }
        }
        for m in Mask::ALL {
            if !self.masks.contains(&m) {
                v.push(format!("mask {}: not in the worker's caps.masks", m.name()));
            }
        }
        for l in [LayoutKind::Thd, LayoutKind::Bshd] {
            if !self.layouts.contains(&l) {
                v.push(format!(
                    "layout {}: not in the worker's caps.layouts",
                    l.name()
                ));
            }
        }
        let flags = [
            (self.window, "sliding windows (caps.window is false)"),
            (self.gqa, "grouped-query attention (caps.gqa is false)"),
            (
                self.dv_ne_dqk,
                "head_dim_v != head_dim_qk (caps.dv_ne_dqk is false)",
            ),
            (
                self.backward,
                "backward: dq, dk, dv (caps.backward is false)",
            ),
            (self.lse, "the log-sum-exp output (caps.lse is false)"),
            (self.dropout, "dropout p > 0 (caps.dropout is false)"),
            (
                self.bias,
                "a post-scale bias and ALiBi (caps.bias is false)",
            ),
            (
                self.padded_offsets,
                "gaps between sequences: padded offsets (caps.padded_offsets is false)",
            ),
            (
                self.reports_path,
                "eligibility and fallback_equivalence: the worker does not report its path",
            ),
            (
                self.reports_workspace,
                "workspace: the worker does not report its workspace",
            ),
            (
                self.follows_small_seq_roundings,
                "emulation_conformance: the worker does not declare the small-seq roundings",
            ),
        ];
        v.extend(
            flags
                .iter()
                .filter(|(ok, _)| !ok)
                .map(|(_, what)| what.to_string()),
        );
        if self.bias && self.backward && !self.dbias {
            v.push(
                "dBias, the gradient of a post-scale bias: the worker does not return it \
                 (caps.dbias is false)"
                    .into(),
            );
        }
        if self.no_key_row != NoKeyRow::Zero {
            v.push(format!(
                "rows that see no key: O and LSE there, and the gradients of cases with such \
                 rows (caps.no_key_row is {})",
                self.no_key_row.name()
            ));
        }
        if !self.nondeterministic.is_empty() {
            v.push(format!(
                "bitwise determinism of {}: declared nondeterministic (caps.nondeterministic); \
                 their reruns are held to numeric_agreement's tolerance instead",
                self.nondeterministic.join(", ")
            ));
        }
        if let Some(h) = &self.head_dims {
            let list: Vec<String> = h.iter().map(|d| d.to_string()).collect();
            v.push(format!("head dims other than {}", list.join(", ")));
        }
        if let Some(t) = self.max_tokens {
            v.push(format!("more than {t} tokens per side"));
        }
        v
    }
}

/// The `caps` object as it travels. Every field is optional; a missing one is the most
/// conservative value.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct WireCaps {
    pub dtypes: Vec<String>,
    pub layouts: Vec<String>,
    pub masks: Vec<String>,
    pub window: bool,
    pub gqa: bool,
    pub dv_ne_dqk: bool,
    pub head_dims: Option<Vec<usize>>,
    pub max_tokens: Option<usize>,
    pub backward: bool,
    pub lse: bool,
    pub padded_offsets: bool,
    pub reports_path: bool,
    pub reports_workspace: bool,
    pub follows_small_seq_roundings: bool,
    pub harness_options: bool,
    pub no_key_row: Option<String>,
    pub arch: Option<String>,
    pub small_seq: bool,
    pub devices: Option<usize>,
    pub dropout: bool,
    pub bias: bool,
    /// Added after the first workers: absent in their handshakes, so `false`.
    pub dbias: bool,
    pub design: Option<String>,
    /// Added with issue 31's determinism findings; left out of the wire when empty, so the
    /// in-tree workers' handshakes and the capsules that record caps stay as they were.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nondeterministic: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nondeterministic_note: Option<String>,
    /// Added with seed 71's flaky JAX hang; left out of the wire when absent, as above.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub case_timeout_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_and_conservative_defaults() {
        let c = Caps::in_tree("sm_90", true, 2, (true, true));
        assert_eq!(Caps::from_wire(&c.to_wire()).unwrap(), c);
        assert!(c.not_covered().is_empty());
        let empty: WireCaps = serde_json::from_str("{}").unwrap();
        let e = Caps::from_wire(&empty).unwrap();
        assert!(!e.backward && !e.reports_path && !e.dropout && !e.bias && e.dtypes.is_empty());
        assert!(!e.dbias);
        assert_eq!(e.no_key_row, NoKeyRow::Zero);
        assert!(e.not_covered().iter().any(|l| l.contains("backward")));
    }

    #[test]
    fn a_declared_case_timeout_is_read_validated_and_kept_off_the_wire_when_absent() {
        let c = Caps::from_wire(&serde_json::from_str(r#"{"case_timeout_s": 240}"#).unwrap());
        assert_eq!(c.unwrap().case_timeout_s, Some(240.0));
        for bad in ["0", "-3", "1e9"] {
            let w: WireCaps =
                serde_json::from_str(&format!(r#"{{"case_timeout_s": {bad}}}"#)).unwrap();
            let e = Caps::from_wire(&w).unwrap_err().to_string();
            assert!(e.contains("caps.case_timeout_s"), "{e}");
        }
        let in_tree = Caps::in_tree("sm_90", true, 1, (true, true)).to_wire();
        assert!(!serde_json::to_string(&in_tree)
            .unwrap()
            .contains("case_timeout_s"));
    }

    #[test]
    fn dbias_is_read_when_declared_and_listed_when_missing() {
        // A worker written before the field: bias and backward, no dBias.
        let old: WireCaps = serde_json::from_str(r#"{"bias": true, "backward": true}"#).unwrap();
        let c = Caps::from_wire(&old).unwrap();
        assert!(c.bias && !c.dbias);
        assert!(
            c.not_covered().iter().any(|l| l.contains("caps.dbias")),
            "{:?}",
            c.not_covered()
        );
        let new: WireCaps =
            serde_json::from_str(r#"{"bias": true, "backward": true, "dbias": true}"#).unwrap();
        let c = Caps::from_wire(&new).unwrap();
        assert!(c.dbias);
        assert!(!c.not_covered().iter().any(|l| l.contains("caps.dbias")));
        assert_eq!(Caps::from_wire(&c.to_wire()).unwrap(), c);
        // In-tree backends return dBias exactly when they compute the bias.
        assert!(Caps::in_tree("cpu", true, 1, (true, true)).dbias);
        assert!(!Caps::in_tree("sm_90", true, 1, (false, false)).dbias);
    }

    #[test]
    fn unknown_names_are_refused_with_the_field() {
        let w: WireCaps = serde_json::from_str(r#"{"dtypes": ["fp8"]}"#).unwrap();
        let e = Caps::from_wire(&w).unwrap_err().to_string();
        assert!(e.contains("caps.dtypes") && e.contains("fp8"), "{e}");
        let w: WireCaps = serde_json::from_str(r#"{"no_key_row": "garbage"}"#).unwrap();
        assert!(Caps::from_wire(&w).is_err());
        let w: WireCaps = serde_json::from_str(r#"{"design": "fa9"}"#).unwrap();
        let e = Caps::from_wire(&w).unwrap_err().to_string();
        assert!(e.contains("caps.design") && e.contains("'fa9'"), "{e}");
    }

    #[test]
    fn nondeterministic_outputs_are_read_in_order_and_unknown_names_refused() {
        let empty: WireCaps = serde_json::from_str("{}").unwrap();
        let e = Caps::from_wire(&empty).unwrap();
        assert!(e.nondeterministic.is_empty() && !e.declares_nondeterministic("dq"));
        // Absent from the wire when empty: old handshakes and capsules are unchanged.
        let wire = serde_json::to_string(&e.to_wire()).unwrap();
        assert!(!wire.contains("nondeterministic"), "{wire}");
        let w: WireCaps = serde_json::from_str(
            r#"{"nondeterministic": ["dv", "dq", "dq"], "nondeterministic_note": "atomics"}"#,
        )
        .unwrap();
        let c = Caps::from_wire(&w).unwrap();
        assert_eq!(c.nondeterministic, ["dq", "dv"]);
        assert!(c.declares_nondeterministic("dq") && !c.declares_nondeterministic("dk"));
        assert_eq!(c.nondeterministic_note.as_deref(), Some("atomics"));
        assert_eq!(Caps::from_wire(&c.to_wire()).unwrap(), c);
        assert!(
            c.not_covered()
                .iter()
                .any(|l| l.starts_with("bitwise determinism of dq, dv: declared")),
            "{:?}",
            c.not_covered()
        );
        let w: WireCaps = serde_json::from_str(r#"{"nondeterministic": ["dx"]}"#).unwrap();
        let e = Caps::from_wire(&w).unwrap_err().to_string();
        assert!(
            e.contains("caps.nondeterministic") && e.contains("'dx'"),
            "{e}"
        );
    }

    #[test]
    fn an_undeclared_design_is_judged_against_the_envelope() {
        let empty: WireCaps = serde_json::from_str("{}").unwrap();
        assert_eq!(
            Caps::from_wire(&empty).unwrap().judged_design(),
            Design::Envelope
        );
        let w: WireCaps = serde_json::from_str(r#"{"design": "project"}"#).unwrap();
        assert_eq!(
            Caps::from_wire(&w).unwrap().judged_design(),
            Design::Project
        );
        assert_eq!(
            Caps::in_tree("cpu", true, 1, (true, true)).judged_design(),
            Design::Project
        );
    }
}
