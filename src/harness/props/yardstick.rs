//! What a case's outputs are judged by: the f64 reference, the device-faithful emulation and
//! the rounding allowances, computed once per case and shared by every property (and by
//! `repro`, `calibrate` and the report's error pictures, which judge stored outputs).

use crate::case::{Case, Outputs};
use crate::error::Result;
use crate::harness::conditioning::{
    allowances, lse_exp_error, score_sum_levels, Design, GradAllowance, OrderAllowance, PNoise,
};
use crate::harness::tolerance::{judge_all, score_magnitude, Judgement, FLOOR};
use crate::stages::{timed, Stage};
use smallseq_reference::emulate::{self, EmuForward, EmuGradients};
use smallseq_reference::emulate_fallback::{self, FallbackDesign};
use smallseq_reference::{emulate_dbias, forward_backward, Dtype};
use std::borrow::Cow;

/// What a case's outputs are judged by, computed once per case.
#[derive(Clone)]
pub struct Yardstick {
    /// The f64 reference.
    pub reference: Outputs,
    /// The device-faithful emulation.
    pub emulated: Outputs,
    /// The LSE noise floor's scale: [`score_magnitude`] times the design's score-sum levels.
    pub lse_magnitude: f64,
    /// The gradients' per-element rounding allowances ([`allowances`]).
    pub grads: Option<GradAllowance>,
    /// The per-row rule's allowances for another order ([`allowances`]).
    pub order: OrderAllowance,
    /// P's rounding noise in o and dv ([`PNoise`]).
    pub p_noise: PNoise,
    /// The emulation's o and dv before their rounding to the dtype.
    pub emulated_acc: (ndarray::Array3<f64>, Option<ndarray::Array3<f64>>),
    /// The numeric regimes the case reaches ([`numeric_regimes`]), for coverage.
    pub regimes: Vec<&'static str>,
    /// The fallback path's f32 emulation of the CPU's design ([`FallbackDesign::CPU`], with D
    /// from the stored O under [`Design::ProjectDFromO`]), the yardstick of fallback-path outputs: computed on first use ([`Yardstick::fallback`]),
    /// so small-seq cases and backends whose fallback is not emulated never pay for it.
    fallback: std::sync::OnceLock<Outputs>,
    /// The design the order allowance is of, which also decides how a failure is worded.
    pub design: Design,
}

impl Yardstick {
    /// The fallback emulation of `case` (the case this yardstick is of), computed once and
    /// shared by the properties that judge fallback-path outputs.
    pub fn fallback(&self, case: &Case) -> Result<&Outputs> {
        if let Some(y) = self.fallback.get() {
            return Ok(y);
        }
        let problem = case.problem()?;
        // The declared design says where D comes from (docs/semantics.md §1.7).
        let design = FallbackDesign {
            delta_from_stored_o: self.design.d_from_stored_o(),
            ..FallbackDesign::CPU
        };
        let (ff, fg) = timed(Stage::Emulation, || {
            emulate_fallback::forward_backward(&problem, case.config.dtype, &design)
        });
        Ok(self
            .fallback
            .get_or_init(|| emulated_outputs(&ff, fg.as_ref())))
    }

    /// This yardstick for outputs whose backward ran the fallback path (`fallback_bwd`). Under
    /// [`Design::ProjectDFromO`] that backward takes D from the stored O, which the small-seq
    /// design's emulation does not: dQ and dK become those of the same emulation with D from
    /// its stored O (`emulate::forward_backward_d_from_o`), so the tensor rule owes the
    /// design's own error (O's rounding to the input type, which D carries into every dS of
    /// the row) and a value the design loses reads as the design's (`tests/d_from_o.rs`); so
    /// does dBias (Σ dS). Which way each element of O rounded is the implementation's, so
    /// the tensor rule of dQ and dK also takes the order allowance off each element (its
    /// `P·Σ|dO|·|O|` term is that rounding; [`OrderAllowance::grads_in_tensor_rule`]). dV does
    /// not depend on D and keeps its yardstick; so do every other design and path.
    pub fn for_backward(&self, case: &Case, fallback_bwd: bool) -> Result<Cow<'_, Yardstick>> {
        // Already following it (the base run's backward took the fallback, and the forced
        // fallback run asks again): the same yardstick, not a second emulation.
        let followed = self.order.grads_in_tensor_rule;
        if followed || !(fallback_bwd && self.design.d_from_stored_o() && case.d_o.is_some()) {
            return Ok(Cow::Borrowed(self));
        }
        let problem = case.problem()?;
        let dtype = case.config.dtype;
        let (f, g) = timed(Stage::Emulation, || {
            emulate::forward_backward_d_from_o(&problem, dtype)
        });
        let mut y = self.clone();
        y.order.grads_in_tensor_rule = true;
        y.emulated.dq = g.as_ref().map(|g| g.dq.mapv(f64::from));
        y.emulated.dk = g.as_ref().map(|g| g.dk.mapv(f64::from));
        // dBias = Σ dS carries the same D.
        if y.emulated.dbias.is_some() {
            y.emulated.dbias = timed(Stage::Emulation, || {
                emulate_dbias::dbias_d_from_o(&problem, dtype, &f.o)
            })
            .map(|d| d.mapv(f64::from));
        }
        Ok(Cow::Owned(y))
    }

    /// [`Self::for_backward`] of a stored case: the backward path its capsule records (the
    /// forward's where a capsule predates that key, as `repro` reads it).
    pub fn for_stored(&self, case: &Case) -> Result<Cow<'_, Yardstick>> {
        let (_, bwd) = crate::harness::capsule::recorded_paths(case);
        self.for_backward(case, bwd == Some(crate::dispatch::Path::Fallback.name()))
    }

    /// `actual` judged tensor by tensor; `order` takes the per-row rule's allowance for
    /// another summation order (without it, the rule as the emulation alone would set it).
    pub fn judge(&self, case: &Case, actual: &Outputs, order: bool) -> Vec<Judgement> {
        judge_all(
            actual,
            &self.reference,
            &self.emulated,
            case,
            self.lse_magnitude,
            self.grads.as_ref(),
            order.then_some(&self.order),
        )
    }
}

/// The f64 reference and the emulation of a case, as outputs, with the LSE floor's scale;
/// the order allowance is the envelope of the common designs ([`oracle_for`] takes another).
pub fn oracle(case: &Case) -> Result<Yardstick> {
    oracle_for(case, Design::Envelope)
}

/// [`oracle`] with the order allowance of an implementation of `design`.
pub fn oracle_for(case: &Case, design: Design) -> Result<Yardstick> {
    let problem = case.problem()?;
    let (f, g) = timed(Stage::Reference, || forward_backward(&problem));
    let allow = timed(Stage::Allowances, || allowances(case, &f.o, &f.lse, design));
    let reference = Outputs {
        o: Some(f.o),
        lse: Some(f.lse),
        dq: g.as_ref().map(|g| g.dq.clone()),
        dk: g.as_ref().map(|g| g.dk.clone()),
        dbias: g.as_ref().and_then(|g| g.dbias.clone()),
        dv: g.map(|g| g.dv),
    };
    let (ef, eg) = timed(Stage::Emulation, || {
        emulate::forward_backward(&problem, case.config.dtype)
    });
    let regimes = numeric_regimes(
        case.config.dtype,
        &reference,
        eg.as_ref().map_or(0, |g| g.ds_past_range),
    );
    let mut emulated = emulated_outputs(&ef, eg.as_ref());
    emulated.dbias = timed(Stage::Emulation, || {
        emulate_dbias::dbias(&problem, case.config.dtype)
    })
    .map(|d| d.mapv(f64::from));
    Ok(Yardstick {
        fallback: std::sync::OnceLock::new(),
        reference,
        emulated,
        emulated_acc: (
            ef.o_acc.mapv(f64::from),
            eg.map(|g| g.dv_acc.mapv(f64::from)),
        ),
        lse_magnitude: lse_magnitude(case, design),
        grads: allow.grads,
        order: allow.order,
        p_noise: allow.p_noise,
        regimes,
        design,
    })
}

/// The magnitude LSE's noise floor scales with under `design`: the largest score's
/// `scale·Σ|q·k|` ([`score_magnitude`]) times its sum's rounding levels
/// ([`score_sum_levels`]). Under the envelope the f16 LSE of SDPA flash, varlen flash,
/// memory-efficient and cuDNN alike sat 2.4 to 2.9 thresholds out, 16 f32 ulps of a score of
/// 238, with every other output exact (H100, seed 67: 112 failures in 6 groups). Under the
/// envelope a 16-bit case's floor also covers a fast exp ([`lse_exp_error`]).
fn lse_magnitude(case: &Case, design: Design) -> f64 {
    // The floor is `FLOOR · u32 · magnitude`: the magnitude that makes it the exp's error.
    let exp = lse_exp_error(case, design) / (FLOOR * Dtype::F32.unit_roundoff());
    (score_magnitude(case) * score_sum_levels(case, design)).max(exp)
}

/// An emulation's outputs as the judge reads them.
pub(super) fn emulated_outputs(ef: &EmuForward, eg: Option<&EmuGradients>) -> Outputs {
    Outputs {
        o: Some(ef.o.mapv(f64::from)),
        lse: Some(ef.lse.mapv(f64::from)),
        dq: eg.map(|g| g.dq.mapv(f64::from)),
        dk: eg.map(|g| g.dk.mapv(f64::from)),
        dv: eg.map(|g| g.dv.mapv(f64::from)),
        // The emulation's dBias is apart (emulate_dbias), added by the oracle.
        dbias: None,
    }
}

/// The numeric regimes a case reaches, each a value of coverage's `numeric_regime`: a
/// reference output (o, dQ, dK, dV) at or past the dtype's largest finite value
/// (`output_past_limit`), a nonzero one below its smallest normal (`output_subnormal`), a dS
/// past the type's range, which the kernels' design scales by a power of two per 16 × 16 block
/// before dQ = dS·K and dK = dSᵀ·Q (`ds_past_range`, from the emulation), or none of these
/// (`in_range`).
pub fn numeric_regimes(
    dtype: Dtype,
    reference: &Outputs,
    ds_past_range: usize,
) -> Vec<&'static str> {
    let max = f64::from(dtype.max_finite());
    let smallest_normal = dtype.smallest_normal();
    let values = || {
        [&reference.o, &reference.dq, &reference.dk, &reference.dv]
            .into_iter()
            .flatten()
            .flat_map(|a| a.iter().copied())
    };
    let mut regimes = Vec::new();
    if values().any(|x| x.abs() >= max) {
        regimes.push("output_past_limit");
    }
    if values().any(|x| x != 0.0 && x.abs() < smallest_normal) {
        regimes.push("output_subnormal");
    }
    if ds_past_range > 0 {
        regimes.push("ds_past_range");
    }
    if regimes.is_empty() {
        regimes.push("in_range");
    }
    regimes
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array3;

    #[test]
    fn numeric_regimes_name_what_the_reference_and_the_emulation_reach() {
        let out = |v: f64| Outputs {
            o: Some(Array3::from_elem((1, 1, 2), v)),
            ..Outputs::default()
        };
        assert_eq!(numeric_regimes(Dtype::F16, &out(1.0), 0), ["in_range"]);
        assert_eq!(numeric_regimes(Dtype::F16, &out(0.0), 0), ["in_range"]);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(70000.0), 2),
            ["output_past_limit", "ds_past_range"]
        );
        // 2^-15 is subnormal in f16 and normal in bf16.
        let tiny = 2f64.powi(-15);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(tiny), 0),
            ["output_subnormal"]
        );
        assert_eq!(numeric_regimes(Dtype::Bf16, &out(tiny), 0), ["in_range"]);
        assert_eq!(
            numeric_regimes(Dtype::F16, &out(f64::NEG_INFINITY), 0),
            ["output_past_limit"]
        );
    }
}
