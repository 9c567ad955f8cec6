//! The tolerance model: FlashAttention's rule, per tensor and per (token, head) row.
//!
//! `err = max |actual - reference|` over valid elements (NaN counts as infinite), and the case
//! passes iff `err <= threshold` with
//!
//! ```text
//! threshold = K * emu_err + FLOOR * u * magnitude
//! ```
//!
//! where `emu_err` is the same error of the device-faithful emulation (the yardstick: what a
//! correct kernel with these roundings gets), `u` the unit roundoff of the tensor's stored type
//! (the input dtype for o/dq/dk/dv, f32 for lse), and `magnitude = max |reference|` over valid
//! elements (for lse at least 1 and at least the largest `scale·Σ|q·k|` of a visible score,
//! the magnitude its f32 rounding error scales with), so the threshold never collapses to
//! zero. Overflow next to the dtype's limit is judged in `max_err`: past the limit only an
//! infinity of the reference's sign or the saturated value passes. The same rule is applied to
//! every (token, head) row of o/dq/dk/dv with the row's own `max |reference|` and the row's own
//! emulation error, so a wrong row far below the tensor's largest value still fails; there
//! each element's error first loses its allowance for another correct order
//! ([`OrderAllowance`]), so the row rule holds on every backend. `margin`
//! (the larger of the two rules' `err / threshold`) is recorded for every tensor of every case,
//! and a tensor threshold that reaches `max |reference|` is flagged `blind` (docs/judgement.md).
//!
//! For dq and dk each element's error first loses that element's rounding allowance
//! ([`super::conditioning`]): where dS = P·(dP − D) cancels, the f32 noise of its terms is
//! larger than any threshold drawn from one tensor-wide yardstick.

use super::conditioning::{Design, GradAllowance, OrderAllowance};
use super::row_dots::{dots, Columns};
use crate::case::{Case, Outputs};
use ndarray::{ArrayD, ArrayViewD};
pub(crate) use scan::{both_past_limit, same_stored};
use scan::{max_err, worst_of, RowMax, Yard};
use serde::Serialize;
use smallseq_reference::Dtype;

/// Multiplier on the emulation's error.
pub const K: f64 = 4.0;
/// Noise floor, in units of `u * magnitude`, plus as many of the stored type's smallest
/// subnormal (where values are subnormal, precision is absolute).
pub const FLOOR: f64 = 4.0;

/// The element where a tensor's error is largest.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Worst {
    pub tensor: String,
    pub token: usize,
    pub head: usize,
    /// `None` for lse.
    pub dim: Option<usize>,
    pub value: f64,
    pub expected: f64,
    /// The emulation's value there: what the kernel design gives.
    pub emulated: f64,
}

impl Worst {
    /// Whether the output holds the emulation's own value here (the same bits, or the same
    /// non-finite value): the kernel follows its design, and the design loses the value.
    pub fn design_shares(&self) -> bool {
        same_stored(self.value, self.emulated)
    }

    /// One line: where, the value, the reference's, and the emulation's. Only an
    /// implementation of smallseq's design (`design`) is told that sharing the emulation's
    /// value is a limit of its design: the emulation is no model of an undeclared one.
    pub fn describe(&self, design: Design) -> String {
        let dim = self.dim.map_or(String::new(), |x| format!(", dim {x}"));
        let design = match (self.design_shares(), design) {
            (false, _) => "",
            (true, Design::Project | Design::ProjectDFromO) => {
                " (the same value: a limit of the kernel design, not a deviation from it)"
            }
            (true, Design::Envelope) => {
                " (the same value as smallseq's emulation; the implementation declared no \
                 design, so no design limit is claimed)"
            }
        };
        format!(
            "tensor {}, token {}, head {}{dim}: value {} expected {}, emulation {}{design}",
            self.tensor, self.token, self.head, self.value, self.expected, self.emulated
        )
    }
}

/// The verdict on one tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Judgement {
    pub tensor: String,
    pub err: f64,
    pub emu_err: f64,
    pub threshold: f64,
    /// The larger of the tensor rule's `err / threshold` and the per-row rule's worst margin.
    pub margin: f64,
    pub worst: Option<Worst>,
    /// The per-row rule's worst row (None for lse).
    pub row: Option<RowVerdict>,
    /// An output of all zeros would pass (outside the subnormal range): the tensor threshold
    /// reaches `max |reference|` and no row of zeros fails the per-row rule, though it would
    /// fail without the emulation's error in the thresholds: a blind spot of the yardstick.
    pub blind: bool,
    /// Valid elements where the emulation is non-finite and the reference finite and inside the
    /// dtype's range: the emulation's error (`emu_err`) leaves them out.
    pub emu_non_finite: usize,
    /// The tensor threshold reaches `max |reference|` and zeros pass the per-row rule on its
    /// floors and per-element allowances alone: every element lies inside the rounding noise
    /// of its own terms, so its value is not determined at the working precision (no judge
    /// could tell zeros from it). Counted apart from `blind`.
    pub indeterminate: bool,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.margin <= 1.0
    }
}

pub(crate) fn elem_err(a: f64, r: f64) -> f64 {
    // One test for the common case: the difference is NaN only where a side is NaN or both
    // are the same infinity; elsewhere it is the error, infinite where a side is.
    let d = (a - r).abs();
    if !d.is_nan() {
        d
    } else if a == r {
        0.0 // equal infinities
    } else {
        f64::INFINITY
    }
}

fn magnitude(r: &ArrayViewD<f64>, valid: &[bool]) -> f64 {
    let per_token = r.shape().iter().skip(1).product::<usize>().max(1);
    let r = r.as_standard_layout();
    let mut m = 0.0f64;
    for (token, _) in r
        .as_slice()
        .expect("standard")
        .chunks(per_token)
        .zip(valid)
        .filter(|(_, v)| **v)
    {
        // A comparison, not `f64::max`: no NaN reaches it (NaN is not finite).
        for x in token {
            if x.is_finite() && x.abs() > m {
                m = x.abs();
            }
        }
    }
    m
}

/// The absolute floor of a tensor stored as `stored` whose elements sum `terms` products, in
/// smallest spacings: [`FLOOR`], and for f32 `(1 + factor)/2` more per term. An f32 kernel
/// computes its products in the stored type, so where they are subnormal each intermediate is
/// rounded to a whole spacing (half a spacing off), and a rounding before the last multiply is
/// scaled by the remaining factor (at most `factor`: the case's largest input magnitude times
/// the softmax scale, if above 1). An f32 fallback dK of 5 spacings summing 3 products
/// `scale·dS·Q` (scale 0.01, spiky Q) came out 0: margin 0.69 under a floor of 4 spacings (CPU
/// fuzz seed 2072, case 38419; case 10693, 4.6 spacings over 17 terms, 0.67). A 16-bit type's
/// spacing is far above f32's, where such products round.
/// At most the spacings below the normal range (`1/(2u)`): the floor stays an absolute one for
/// the subnormal range, never reaching a normal value (huge inputs would otherwise make it
/// infinite, and pass anything).
pub fn subnormal_spacings(stored: Dtype, terms: usize, factor: f64) -> f64 {
    match stored {
        Dtype::F32 => (FLOOR + terms as f64 * (1.0 + factor.max(0.0)) / 2.0)
            .min(1.0 / (2.0 * Dtype::F32.unit_roundoff())),
        _ => FLOOR,
    }
}

/// The per-tensor views needed to judge one output (views: a case's tensors are judged
/// several times over, and copying them was a fifth of the judging's time).
pub struct Triple<'a> {
    pub name: &'static str,
    pub actual: ArrayViewD<'a, f64>,
    pub reference: ArrayViewD<'a, f64>,
    pub emulated: ArrayViewD<'a, f64>,
    pub valid: &'a [bool],
    pub unit: f64,
    pub min_magnitude: f64,
    /// Largest finite value of the stored type.
    pub max_finite: f64,
    /// Smallest positive value of the stored type.
    pub min_spacing: f64,
    /// The absolute floor, in `min_spacing`s: [`FLOOR`], or more where an f32 kernel's sums
    /// of subnormal products each lose up to half a spacing per term ([`subnormal_spacings`]).
    pub spacings: f64,
    /// Per-element rounding allowance of the kernel's error (dq and dk).
    pub allowance: Option<ArrayViewD<'a, f64>>,
    /// Per-element allowance for another summation order or other rounding points, taken off
    /// each element's error by the per-row rule ([`OrderAllowance`]).
    pub order: Option<ArrayViewD<'a, f64>>,
    /// Whether the tensor rule takes `order` off too ([`OrderAllowance::in_tensor_rule`]).
    pub order_in_tensor_rule: bool,
}

impl Triple<'_> {
    /// The stored type's smallest normal value (`min_spacing` is its smallest subnormal).
    fn smallest_normal(&self) -> f64 {
        self.min_spacing / (2.0 * self.unit)
    }
}

/// The verdict of the per-row rule on a tensor's worst row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowVerdict {
    pub token: usize,
    pub head: usize,
    /// `max |reference|` over the row: the row's own scale.
    pub scale: f64,
    pub err: f64,
    pub emu_err: f64,
    pub threshold: f64,
    pub margin: f64,
}

/// `err / threshold`, 0 for no error, with a threshold never 0.
pub(crate) fn margin_of(err: f64, threshold: f64) -> (f64, f64) {
    let threshold = if threshold > 0.0 {
        threshold
    } else {
        f64::MIN_POSITIVE
    };
    (if err == 0.0 { 0.0 } else { err / threshold }, threshold)
}

/// Largest relative emulation error, in units of the dtype, that a row's yardstick takes from
/// its tensor. The floor is there for a row where the emulation happens to land exactly (a few
/// units); uncapped, a tensor whose emulation is off by a quarter of its magnitude somewhere
/// (dS cancelling in a few rows) gave every row a threshold above its own scale, and a tensor
/// of zeros passed (docs/judgement.md, "Blind verdicts").
const RELATIVE_FLOOR_CAP_UNITS: f64 = 4.0;

/// The least emulation error a row's yardstick takes from its tensor: `relative` times the
/// row's scale, or `absolute` where the row's scale lies in the subnormal range (precision is
/// absolute there).
#[derive(Clone, Copy)]
struct RowFloors {
    relative: f64,
    absolute: f64,
}

impl RowFloors {
    fn of(t: &Triple, tensor_emu: f64, mag: f64) -> RowFloors {
        let relative = if mag > 0.0 {
            (tensor_emu / mag).min(RELATIVE_FLOOR_CAP_UNITS * t.unit)
        } else {
            0.0
        };
        RowFloors {
            relative,
            absolute: tensor_emu,
        }
    }
}

/// The per-row rule: each (token, head) row of a 3-D tensor judged with its own scale and its
/// own emulation error, `K·emu_err_row + FLOOR·(u·max|ref_row| + spacing)`, so that a row far
/// below the tensor's largest value is not hidden under the tensor's threshold. Each element's
/// error first loses its allowance for another correct order ([`OrderAllowance`]): the
/// emulation's error on a row is one draw of the rounding noise, and where the row's terms
/// cancel another draw lands far from it (an H200 failed 103 correct dV rows so, `smallseq
/// fuzz --backend cuda --time 10m --seed 2052`). A row's emulation error is never taken below
/// the tensor's relative one (`emu_err / magnitude`) at the row's scale: a row where the
/// emulation happens to land exactly would leave a correct kernel of another order a floor of
/// a few units (f32 fallback O of the CPU reached margin 0.51 so, `cargo run --release -- fuzz
/// --time 10m --seed 2042`, case 74). A row whose scale lies in the subnormal range, where
/// precision is absolute, takes the tensor's emulation error (bf16 dK of 2e-39 on the CPU
/// fallback: 4.3 spacings off where the emulation is 0.9, margin 0.53, same campaign, case
/// 5023). Returns the row with the largest margin.
fn rows_verdict(
    t: &Triple,
    emu: &[RowMax],
    act: &[RowMax],
    floors: RowFloors,
) -> Option<RowVerdict> {
    let shape = t.reference.shape();
    if shape.len() < 3 {
        return None; // lse: a row is one element, judged by the tensor rule
    }
    let heads = shape[1];
    let RowFloors { relative, absolute } = floors;
    let smallest_normal = t.smallest_normal();
    let mut worst: Option<RowVerdict> = None;
    for (row, (e, a)) in emu.iter().zip(act).enumerate() {
        let (token, head) = (row / heads, row % heads);
        if !t.valid[token] {
            continue;
        }
        let scale = e.mag.min(t.max_finite);
        let yardstick = if scale < smallest_normal {
            absolute
        } else {
            relative * scale
        };
        let emu_err = e.err.max(yardstick).min(f64::MAX);
        let threshold = K * emu_err + FLOOR * t.unit * scale + t.spacings * t.min_spacing;
        let (margin, threshold) = margin_of(a.row_err, threshold);
        if worst.as_ref().is_none_or(|w| margin > w.margin) {
            worst = Some(RowVerdict {
                token,
                head,
                scale,
                err: a.row_err,
                emu_err,
                threshold,
                margin,
            });
        }
    }
    worst
}

/// How many valid elements the emulation holds non-finite where the reference is finite and
/// inside the range.
fn emulation_overflows(t: &Triple) -> usize {
    let per_token = t.reference.shape().iter().skip(1).product::<usize>().max(1);
    // Token by token over flat slices (an element's token was a division per element).
    let (e, r) = (
        t.emulated.as_standard_layout(),
        t.reference.as_standard_layout(),
    );
    let (e, r) = (
        e.as_slice().expect("standard"),
        r.as_slice().expect("standard"),
    );
    e.chunks(per_token)
        .zip(r.chunks(per_token))
        .zip(t.valid)
        .filter(|(_, v)| **v)
        .map(|((e, r), _)| {
            e.iter()
                .zip(r)
                .filter(|(e, r)| !e.is_finite() && r.is_finite() && r.abs() < t.max_finite)
                .count()
        })
        .sum()
}

/// Judges one tensor: the tensor rule, then the per-row rule.
pub fn judge(t: &Triple) -> Judgement {
    let mag = magnitude(&t.reference, t.valid)
        .min(t.max_finite)
        .max(t.min_magnitude);
    let floor = FLOOR * t.unit * mag + t.spacings * t.min_spacing;
    // The yardstick's own overflows are no error of it (it is its own yardstick): an
    // intermediate past the dtype's range would otherwise make its error, and the threshold,
    // infinite for the whole tensor. There the kernel must be accurate, or overflow where the
    // reference does; elsewhere it gets the whole threshold as headroom next to the limit.
    let emu_rows = max_err(
        &t.emulated,
        &t.reference,
        t.valid,
        t.max_finite,
        floor,
        Yard::Own,
        None,
        None,
        false,
    );
    let emu_err = worst_of(&emu_rows).err;
    let threshold = K * emu_err.min(f64::MAX) + floor;
    // A kernel's output (or, below, an output of zeros) judged as the kernel's: against the
    // reference, with the emulation as yardstick and every allowance.
    let kernel_rows = |out: &ArrayViewD<f64>| {
        max_err(
            out,
            &t.reference,
            t.valid,
            t.max_finite,
            threshold,
            Yard::Kernel(&t.emulated),
            t.allowance.as_ref(),
            t.order.as_ref(),
            t.order_in_tensor_rule,
        )
    };
    let act_rows = kernel_rows(&t.actual);
    let worst_row = worst_of(&act_rows);
    let (tensor_margin, threshold) = margin_of(worst_row.err, threshold);
    let floors = RowFloors::of(t, emu_err, mag);
    let row = rows_verdict(t, &emu_rows, &act_rows, floors);
    // Where the whole tensor lies in the subnormal range, precision is absolute and a
    // threshold of a few spacings may exceed every value.
    let smallest_normal = t.smallest_normal();
    // Blind: an output of all zeros would pass both rules. The tensor rule alone is blind
    // where its threshold reaches the reference's magnitude; then the row rule decides. Where
    // zeros pass even with no yardstick term at all (the floors and the per-element allowances
    // alone: every element lies inside the rounding noise of its own terms), no judge could
    // tell zeros from the right value: that is `indeterminate`, not a blind spot.
    let (blind, indeterminate) = if threshold >= mag && mag >= smallest_normal {
        let zero_rows = kernel_rows(&ArrayD::zeros(t.reference.raw_dim()).view());
        let passes = |emu: &[RowMax], floors: RowFloors| {
            rows_verdict(t, emu, &zero_rows, floors).is_none_or(|r| r.margin <= 1.0)
        };
        // No yardstick: no row's own emulation error and no relative floor; subnormal rows
        // keep the tensor's absolute noise, which is their precision.
        let no_yardstick: Vec<RowMax> = emu_rows
            .iter()
            .map(|r| RowMax {
                mag: r.mag,
                ..RowMax::default()
            })
            .collect();
        let within_noise = passes(
            &no_yardstick,
            RowFloors {
                relative: 0.0,
                ..floors
            },
        );
        (!within_noise && passes(&emu_rows, floors), within_noise)
    } else {
        (false, false)
    };
    let worst = worst_row
        .at
        .map(|((token, head, dim), value, expected)| Worst {
            tensor: t.name.into(),
            token,
            head,
            dim,
            value,
            expected,
            emulated: match dim {
                Some(d) => t.emulated.get([token, head, d]),
                None => t.emulated.get([token, head]),
            }
            .copied()
            .unwrap_or(f64::NAN),
        });
    Judgement {
        tensor: t.name.into(),
        err: worst_row.err,
        emu_err,
        emu_non_finite: emulation_overflows(t),
        threshold,
        margin: row
            .as_ref()
            .map_or(tensor_margin, |r| r.margin.max(tensor_margin)),
        blind,
        indeterminate,
        worst,
        row,
    }
}

/// The largest `scale·Σ_d |q_d·k_d|` over visible (query, key) pairs: the magnitude an f32
/// score carries before cancellation, so the scale of its rounding error and of LSE's. With
/// cancellation it far exceeds `|lse|`, which alone would make the noise floor too tight for
/// any accumulation order but the emulation's.
pub fn score_magnitude(case: &Case) -> f64 {
    let scale = case.config.params.scale.abs();
    let mut best = 0.0f64;
    // Each row's sums `Σ_d |q_d|·|k_d|` against every key of its slot side by side.
    let k_abs = Columns::of(&case.k, |x| f64::from(x).abs());
    let mut sums = Vec::new();
    for row in case.visible_rows() {
        let q = case.q.slice(ndarray::s![row.token, row.head, ..]);
        let q_abs: Vec<f64> = q.iter().map(|&x| f64::from(x).abs()).collect();
        let first_key = case.layout.kv.offset(row.slot);
        let slot_keys = first_key..first_key + case.layout.kv.len(row.slot);
        dots(&q_abs, &k_abs, row.kv_head, slot_keys, -0.0, &mut sums);
        for &c in &row.keys {
            best = best.max(sums[c - first_key] * scale);
        }
    }
    best
}

fn dyn3(x: &Option<ndarray::Array3<f64>>) -> Option<ArrayViewD<'_, f64>> {
    x.as_ref().map(|a| a.view().into_dyn())
}

/// Judges every output present in `actual` against reference and emulation (both given as
/// [`Outputs`] widened to f64).
/// `lse_magnitude` is the case's [`score_magnitude`], `grads` its gradients' rounding
/// allowances and `order` its allowances for another order (all computed once per case by the
/// caller; `order` only where the per-row rule's verdict is read).
pub fn judge_all(
    actual: &Outputs,
    reference: &Outputs,
    emulated: &Outputs,
    case: &Case,
    lse_magnitude: f64,
    grads: Option<&GradAllowance>,
    order: Option<&OrderAllowance>,
) -> Vec<Judgement> {
    let _judging = crate::stages::enter(crate::stages::Stage::Judging);
    let in_tensor_rule = order.is_some_and(|o| o.in_tensor_rule);
    let grads_in_tensor_rule = order.is_some_and(|o| o.grads_in_tensor_rule);
    let layout = &case.layout;
    let dtype = case.config.dtype;
    let lse_magnitude = lse_magnitude.max(1.0);
    let vq = layout.q.valid_tokens();
    let vk = layout.kv.valid_tokens();
    let u = dtype.unit_roundoff();
    let group = case.config.params.num_heads / case.config.params.num_kv_heads.max(1);
    // Only f32 tensors take it (`subnormal_spacings`): a pass over the inputs skipped otherwise.
    let factor = if dtype == Dtype::F32 {
        let largest =
            |x: &ndarray::Array3<f32>| x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        [&case.q, &case.k, &case.v]
            .into_iter()
            .chain(case.d_o.as_ref())
            .map(largest)
            .fold(0.0f64, f64::max)
            * case.config.params.scale.abs().max(1.0)
    } else {
        0.0
    };
    // The terms one output element sums: keys for o and dq, queries of the group for dk, dv.
    let terms = |name: &str| match name {
        "o" | "dq" => layout.kv.max_len(),
        "dk" | "dv" => layout.q.max_len() * group,
        // dBias sums dS over every slot and head that shares an entry.
        "dbias" => layout.slots() * case.config.params.num_heads,
        _ => 0,
    };
    let mut out = Vec::new();
    let mut add = |name: &'static str,
                   a: Option<ArrayViewD<f64>>,
                   r: Option<ArrayViewD<f64>>,
                   e: Option<ArrayViewD<f64>>,
                   valid: &[bool],
                   unit: f64,
                   min_mag: f64| {
        let allowance = match name {
            "dq" => grads.map(|g| g.dq.view().into_dyn()),
            "dk" => grads.map(|g| g.dk.view().into_dyn()),
            "dbias" => grads
                .and_then(|g| g.dbias.as_ref())
                .map(|d| d.view().into_dyn()),
            _ => None,
        };
        let order = order.and_then(|o| match name {
            "o" => Some(&o.o),
            "dq" => o.dq.as_ref(),
            "dk" => o.dk.as_ref(),
            "dv" => o.dv.as_ref(),
            "dbias" => o.dbias.as_ref(),
            _ => None,
        });
        let order = order.map(|o| o.view().into_dyn());
        let in_tensor_rule = (in_tensor_rule && name != "dbias")
            || (grads_in_tensor_rule && matches!(name, "dq" | "dk"));
        // LSE is stored as f32 whatever the inputs' type.
        let stored = if name == "lse" { Dtype::F32 } else { dtype };
        if let (Some(actual), Some(reference), Some(emulated)) = (a, r, e) {
            // Reborrowed, so that every view of the triple has one lifetime.
            out.push(judge(&Triple {
                name,
                actual: actual.view(),
                reference: reference.view(),
                emulated: emulated.view(),
                valid,
                unit,
                min_magnitude: min_mag,
                max_finite: f64::from(stored.max_finite()),
                min_spacing: stored.smallest_subnormal(),
                spacings: subnormal_spacings(stored, terms(name), factor),
                allowance: allowance.as_ref().map(|a| a.view()),
                order_in_tensor_rule: order.is_some() && in_tensor_rule,
                order: order.as_ref().map(|o| o.view()),
            }));
        }
    };
    add(
        "o",
        dyn3(&actual.o),
        dyn3(&reference.o),
        dyn3(&emulated.o),
        &vq,
        u,
        0.0,
    );
    add(
        "lse",
        actual.lse.as_ref().map(|a| a.view().into_dyn()),
        reference.lse.as_ref().map(|a| a.view().into_dyn()),
        emulated.lse.as_ref().map(|a| a.view().into_dyn()),
        &vq,
        Dtype::F32.unit_roundoff(),
        lse_magnitude,
    );
    add(
        "dq",
        dyn3(&actual.dq),
        dyn3(&reference.dq),
        dyn3(&emulated.dq),
        &vq,
        u,
        0.0,
    );
    add(
        "dk",
        dyn3(&actual.dk),
        dyn3(&reference.dk),
        dyn3(&emulated.dk),
        &vk,
        u,
        0.0,
    );
    add(
        "dv",
        dyn3(&actual.dv),
        dyn3(&reference.dv),
        dyn3(&emulated.dv),
        &vk,
        u,
        0.0,
    );
    // dBias as rows `[Bb·Sq, Hb, Sk]`: every row is judged, the entries no slot reads being
    // exactly 0 in the reference and in a correct output.
    let rows = |o: &Outputs| o.dbias.as_ref().map(crate::case::dbias_rows);
    let (a, r, e) = (rows(actual), rows(reference), rows(emulated));
    let valid = vec![true; r.as_ref().map_or(0, |r| r.dim().0)];
    add("dbias", dyn3(&a), dyn3(&r), dyn3(&e), &valid, u, 0.0);
    out
}

mod scan;
#[cfg(test)]
mod tests;
