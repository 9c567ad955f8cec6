//! The error picture of a failure: `|actual − reference|` of one output tensor per (token,
//! head), the largest over the head dimension, with the layout's slot boundaries.

use crate::case::Case;
use crate::case_file::read_case;
use crate::error::{Error, Result};
use crate::harness::props::oracle;
use crate::harness::tolerance::elem_err;
use ndarray::{Array3, Axis};
use std::path::Path;

/// One tensor's errors, token-major.
#[derive(Clone, Debug)]
pub struct ErrorGrid {
    pub tensor: String,
    /// Why this tensor: the verdict's worst element, or its largest margin.
    pub chosen_by: String,
    pub tokens: usize,
    pub heads: usize,
    /// `err[token * heads + head]`; infinite where one side is NaN or infinite and the other
    /// is not the same value.
    pub err: Vec<f64>,
    /// Per slot: its first token and the end of its valid tokens (`off[i]`, `off[i] + L_i`).
    pub slots: Vec<(usize, usize)>,
    /// `off[b]`: tokens from here on are tail slack.
    pub end: usize,
    /// The capsule's own recorded verdict, (property, detail) per failure, so a failure card
    /// prints the text of the capsule it draws (a shrunk case fails with other numbers).
    pub recorded: Vec<(String, String)>,
}

impl ErrorGrid {
    pub fn at(&self, token: usize, head: usize) -> f64 {
        self.err[token * self.heads + head]
    }

    /// The largest error and where it is (token, head); the first in token-major order among
    /// equals, as the tolerance rule names it.
    pub fn worst(&self) -> Option<(f64, usize, usize)> {
        let mut best: Option<(usize, f64)> = None;
        for (i, &e) in self.err.iter().enumerate() {
            if best.is_none_or(|(_, b)| e > b) {
                best = Some((i, e));
            }
        }
        best.map(|(i, e)| (e, i / self.heads.max(1), i % self.heads.max(1)))
    }
}

/// The grid of the capsule at `path`: its stored outputs against the f64 reference.
///
/// # Errors
/// An unreadable or invalid capsule, or one that stores no outputs.
pub fn error_grid(path: &Path) -> Result<ErrorGrid> {
    let case = read_case(path)?;
    if case.outputs.is_empty() {
        return Err(Error::Report(format!(
            "{}: the capsule stores no outputs",
            path.display()
        )));
    }
    let (tensor, chosen_by) = choose_tensor(&case);
    let mut g = grid(&case, &tensor, chosen_by)?;
    g.recorded = recorded_failures(&case);
    Ok(g)
}

impl ErrorGrid {
    /// The capsule's recorded detail of `property`, else of its first failure.
    pub fn detail_of(&self, property: &str) -> Option<&str> {
        self.recorded
            .iter()
            .find(|(p, _)| p == property)
            .or(self.recorded.first())
            .map(|(_, d)| d.as_str())
    }
}

fn recorded_failures(case: &Case) -> Vec<(String, String)> {
    let verdict: serde_json::Value = case
        .meta
        .get("smallseq.verdict")
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default();
    verdict["failures"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            let text = |k: &str| f[k].as_str().unwrap_or_default().to_string();
            (text("property"), text("detail"))
        })
        .collect()
}

/// The verdict's worst tensor, else the one with the largest recorded margin, else the first
/// stored.
fn choose_tensor(case: &Case) -> (String, String) {
    let verdict: serde_json::Value = case
        .meta
        .get("smallseq.verdict")
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default();
    let stored = |t: &str| match t {
        "lse" => case.outputs.lse.is_some(),
        _ => case
            .outputs
            .rows3()
            .iter()
            .any(|(n, a)| *n == t && a.is_some()),
    };
    if let Some(t) = verdict["worst"]["tensor"].as_str().filter(|t| stored(t)) {
        return (t.into(), "the verdict's worst element".into());
    }
    let margin = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::INFINITY);
    if let Some((t, _)) = verdict["margins"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(t, _)| stored(t))
        .max_by(|a, b| margin(a.1).total_cmp(&margin(b.1)))
    {
        return (t.clone(), "the largest margin of the verdict".into());
    }
    let first = ["o", "lse", "dq", "dk", "dv"]
        .into_iter()
        .find(|t| stored(t))
        .unwrap_or("o");
    (first.into(), "the first stored output (no verdict)".into())
}

fn grid(case: &Case, tensor: &str, chosen_by: String) -> Result<ErrorGrid> {
    let y = oracle(case)?;
    let (side, heads, err) = if tensor == "lse" {
        let (a, r) = (case.outputs.lse.as_ref(), y.reference.lse.as_ref());
        let (Some(a), Some(r)) = (a, r) else {
            return Err(missing(tensor));
        };
        let err = a.iter().zip(r.iter()).map(|(&a, &r)| elem_err(a, r));
        (&case.layout.q, a.shape()[1], err.collect())
    } else {
        let pick = |o: &crate::case::Outputs| -> Option<Array3<f64>> {
            o.rows3()
                .into_iter()
                .find(|(n, _)| *n == tensor)
                .and_then(|(_, a)| a.cloned())
        };
        let (Some(a), Some(r)) = (pick(&case.outputs), pick(&y.reference)) else {
            return Err(missing(tensor));
        };
        let mut e = a.clone();
        e.zip_mut_with(&r, |a, &r| *a = elem_err(*a, r));
        let per_head = e.map_axis(Axis(2), |d| d.iter().copied().fold(0.0, f64::max));
        let side = if matches!(tensor, "dk" | "dv") {
            &case.layout.kv
        } else {
            &case.layout.q
        };
        (side, a.shape()[1], per_head.iter().copied().collect())
    };
    let slots = (0..side.slots())
        .map(|i| (side.offset(i), side.offset(i) + side.len(i)))
        .collect();
    Ok(ErrorGrid {
        tensor: tensor.into(),
        chosen_by,
        tokens: side.tokens,
        heads,
        err,
        slots,
        end: side.offsets().last().map_or(0, |&o| o as usize),
        recorded: Vec::new(),
    })
}

fn missing(tensor: &str) -> Error {
    Error::Report(format!(
        "tensor {tensor}: not stored in the capsule or the reference"
    ))
}
