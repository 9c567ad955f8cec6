//! The tolerance model: FlashAttention's rule, per tensor.
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
//! zero. Overflow next to the dtype's limit is judged in `max_err`. `margin =
//! err / threshold` is recorded for every tensor of every case.
//!
//! For dq and dk each element's error first loses that element's rounding allowance
//! ([`super::conditioning`]): where dS = P·(dP − D) cancels, the f32 noise of its terms is
//! larger than any threshold drawn from one tensor-wide yardstick.

use super::conditioning::GradAllowance;
use crate::case::{Case, Outputs};
use ndarray::ArrayD;
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
}

/// The verdict on one tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Judgement {
    pub tensor: String,
    pub err: f64,
    pub emu_err: f64,
    pub threshold: f64,
    pub margin: f64,
    pub worst: Option<Worst>,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.margin <= 1.0
    }
}

fn elem_err(a: f64, r: f64) -> f64 {
    if a == r {
        0.0 // equal infinities included
    } else if a.is_nan() || r.is_nan() || a.is_infinite() || r.is_infinite() {
        f64::INFINITY
    } else {
        (a - r).abs()
    }
}

/// Max error over rows flagged valid, and where it is.
/// Whether `x` and `y` both say "at or past the dtype's limit", with the same sign: an
/// overflow to infinity and a saturation to the largest finite value are the same verdict.
fn both_past_limit(x: f64, y: f64, max_finite: f64) -> bool {
    x.abs() >= max_finite && y.abs() >= max_finite && x.signum() == y.signum()
}

/// Whether `x` is the non-finite value `e` is: the same infinity, or NaN for NaN (the
/// emulation's arithmetic meeting `inf - inf`).
fn same_non_finite(x: f64, e: f64) -> bool {
    (x.is_infinite() && x == e) || (x.is_nan() && e.is_nan())
}

/// Max error over rows flagged valid, and where it is. An infinity of the reference's sign is
/// no error where the reference lies within `headroom` of the dtype's limit; nor is an
/// infinity (or NaN) the yardstick (`yard`, when given) holds too, whatever the reference: the
/// device-faithful arithmetic overflows there (an intermediate past the dtype's range), so the
/// kernel computing the same infinity is faithful. Each element's error is reduced by its
/// `allow`ance, when given.
fn max_err(
    a: &ArrayD<f64>,
    r: &ArrayD<f64>,
    valid: &[bool],
    max_finite: f64,
    headroom: f64,
    yard: Option<&ArrayD<f64>>,
    allow: Option<&ArrayD<f64>>,
) -> (f64, Option<(Vec<usize>, f64, f64)>) {
    // Flat, row-major slices: indexing an `ArrayD` element by element through dynamic
    // indices cost a quarter of a CPU campaign's time.
    let (a_s, r_s) = (flat(a), flat(r));
    let (yard_s, allow_s) = (yard.map(flat), allow.map(flat));
    let inner = a.shape().iter().skip(1).product::<usize>().max(1);
    let mut best = (0.0, None);
    for (i, (&x, &y)) in a_s.iter().zip(r_s.iter()).enumerate() {
        // A reference value the output dtype cannot hold may legitimately overflow.
        if !valid[i / inner] || (y.is_finite() && y.abs() >= max_finite) {
            continue;
        }
        if both_past_limit(x, y, max_finite) {
            continue;
        }
        if yard_s.as_ref().is_some_and(|e| same_non_finite(x, e[i])) {
            continue;
        }
        // A non-finite allowance (from non-finite inputs) excuses nothing.
        let allowed = allow_s.as_ref().map(|al| al[i]).filter(|a| a.is_finite());
        // The element's own allowance is headroom too: a value that noise may carry past the
        // limit may be stored as the infinity of its sign.
        let room = headroom + allowed.unwrap_or(0.0);
        if x.is_infinite() && x.signum() == y.signum() && y.abs() + room >= max_finite {
            continue;
        }
        // A stored infinity says the value before the store was at or past the limit in its
        // direction: its error is at least that of the limit itself (with a finite reference),
        // which a threshold wider than the distance to the limit covers (an f16 dK of -15,822
        // whose noise, measured by the emulation's error of 41,600, carried it past +65,504:
        // CPU fuzz seed 2043, case 1632).
        let at = if x.is_infinite() && y.is_finite() {
            x.signum() * max_finite
        } else {
            x
        };
        let e = match allowed {
            Some(a) => (elem_err(at, y) - a).max(0.0),
            None => elem_err(at, y),
        };
        if e > best.0 || (best.1.is_none() && e.is_nan()) {
            best = (e, Some((unravel(i, a.shape()), x, y)));
        }
    }
    best
}

/// The elements of `t` in row-major order, borrowed where `t` is already laid out so.
fn flat(t: &ArrayD<f64>) -> std::borrow::Cow<'_, [f64]> {
    match t.as_slice() {
        Some(s) => std::borrow::Cow::Borrowed(s),
        None => std::borrow::Cow::Owned(t.iter().copied().collect()),
    }
}

/// The multi-index of row-major position `i` in `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (k, &n) in shape.iter().enumerate().rev() {
        idx[k] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

fn magnitude(r: &ArrayD<f64>, valid: &[bool]) -> f64 {
    let inner = r.shape().iter().skip(1).product::<usize>().max(1);
    flat(r)
        .iter()
        .enumerate()
        .filter(|(i, x)| valid[i / inner] && x.is_finite())
        .fold(0.0f64, |m, (_, x)| m.max(x.abs()))
}

/// The per-tensor views needed to judge one output.
pub struct Triple<'a> {
    pub name: &'static str,
    pub actual: ArrayD<f64>,
    pub reference: ArrayD<f64>,
    pub emulated: ArrayD<f64>,
    pub valid: &'a [bool],
    pub unit: f64,
    pub min_magnitude: f64,
    /// Largest finite value of the stored type.
    pub max_finite: f64,
    /// Smallest positive value of the stored type.
    pub min_spacing: f64,
    /// Per-element rounding allowance of the kernel's error (dq and dk).
    pub allowance: Option<ArrayD<f64>>,
}

/// Judges one tensor.
pub fn judge(t: &Triple) -> Judgement {
    let mag = magnitude(&t.reference, t.valid)
        .min(t.max_finite)
        .max(t.min_magnitude);
    let floor = FLOOR * (t.unit * mag + t.min_spacing);
    // The yardstick's own overflows are no error of it (it is its own yardstick): an
    // intermediate past the dtype's range would otherwise make its error, and the threshold,
    // infinite for the whole tensor. There the kernel must hold the same infinity, or be
    // accurate; elsewhere it gets the whole threshold as headroom next to the limit.
    let (emu_err, _) = max_err(
        &t.emulated,
        &t.reference,
        t.valid,
        t.max_finite,
        floor,
        Some(&t.emulated),
        None,
    );
    let threshold = K * emu_err.min(f64::MAX) + floor;
    let (err, at) = max_err(
        &t.actual,
        &t.reference,
        t.valid,
        t.max_finite,
        threshold,
        Some(&t.emulated),
        t.allowance.as_ref(),
    );
    let threshold = if threshold > 0.0 {
        threshold
    } else {
        f64::MIN_POSITIVE
    };
    let worst = at.map(|(idx, value, expected)| Worst {
        tensor: t.name.into(),
        token: idx[0],
        head: idx[1],
        dim: idx.get(2).copied(),
        value,
        expected,
    });
    Judgement {
        tensor: t.name.into(),
        err,
        emu_err,
        threshold,
        margin: if err == 0.0 { 0.0 } else { err / threshold },
        worst,
    }
}

/// The largest `scale·Σ_d |q_d·k_d|` over visible (query, key) pairs: the magnitude an f32
/// score carries before cancellation, so the scale of its rounding error and of LSE's. With
/// cancellation it far exceeds `|lse|`, which alone would make the noise floor too tight for
/// any accumulation order but the emulation's.
pub fn score_magnitude(case: &Case) -> f64 {
    let scale = case.config.params.scale.abs();
    let mut best = 0.0f64;
    for row in case.visible_rows() {
        let q = case.q.slice(ndarray::s![row.token, row.head, ..]);
        for &c in &row.keys {
            let k = case.k.slice(ndarray::s![c, row.kv_head, ..]);
            let s: f64 = q
                .iter()
                .zip(k.iter())
                .map(|(a, b)| f64::from(*a).abs() * f64::from(*b).abs())
                .sum();
            best = best.max(s * scale);
        }
    }
    best
}

/// Judges every output present in `actual` against reference and emulation (both given as
/// [`Outputs`] widened to f64).
/// `lse_magnitude` is the case's [`score_magnitude`] and `grads` its gradients' rounding
/// allowances (both computed once per case by the caller).
pub fn judge_all(
    actual: &Outputs,
    reference: &Outputs,
    emulated: &Outputs,
    case: &Case,
    lse_magnitude: f64,
    grads: Option<&GradAllowance>,
) -> Vec<Judgement> {
    let layout = &case.layout;
    let dtype = case.config.dtype;
    let lse_magnitude = lse_magnitude.max(1.0);
    let vq = layout.q.valid_tokens();
    let vk = layout.kv.valid_tokens();
    let u = dtype.unit_roundoff();
    let mut out = Vec::new();
    let mut add = |name: &'static str,
                   a: Option<ArrayD<f64>>,
                   r: Option<ArrayD<f64>>,
                   e: Option<ArrayD<f64>>,
                   valid: &[bool],
                   unit: f64,
                   min_mag: f64| {
        let allowance = match name {
            "dq" => grads.map(|g| g.dq.clone().into_dyn()),
            "dk" => grads.map(|g| g.dk.clone().into_dyn()),
            _ => None,
        };
        // LSE is stored as f32 whatever the inputs' type.
        let stored = if name == "lse" { Dtype::F32 } else { dtype };
        if let (Some(actual), Some(reference), Some(emulated)) = (a, r, e) {
            out.push(judge(&Triple {
                name,
                actual,
                reference,
                emulated,
                valid,
                unit,
                min_magnitude: min_mag,
                max_finite: f64::from(stored.max_finite()),
                min_spacing: stored.smallest_subnormal(),
                allowance,
            }));
        }
    };
    let dyn3 = |x: &Option<ndarray::Array3<f64>>| x.clone().map(|a| a.into_dyn());
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
        actual.lse.clone().map(|a| a.into_dyn()),
        reference.lse.clone().map(|a| a.into_dyn()),
        emulated.lse.clone().map(|a| a.into_dyn()),
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
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr3;

    fn triple(actual: f64, reference: f64) -> Judgement {
        triple_with(actual, reference, reference)
    }

    fn triple_with(actual: f64, reference: f64, emulated: f64) -> Judgement {
        one_element(Dtype::F16, actual, reference, emulated, None)
    }

    fn with_allowance(actual: f64, reference: f64, allowance: f64) -> Judgement {
        one_element(Dtype::F32, actual, reference, reference, Some(allowance))
    }

    /// A one-element dq tensor of `dtype`, judged.
    fn one_element(
        dtype: Dtype,
        actual: f64,
        reference: f64,
        emulated: f64,
        allowance: Option<f64>,
    ) -> Judgement {
        let valid = [true];
        judge(&Triple {
            name: "dq",
            actual: arr3(&[[[actual]]]).into_dyn(),
            reference: arr3(&[[[reference]]]).into_dyn(),
            emulated: arr3(&[[[emulated]]]).into_dyn(),
            valid: &valid,
            unit: dtype.unit_roundoff(),
            min_magnitude: 0.0,
            max_finite: f64::from(dtype.max_finite()),
            min_spacing: dtype.smallest_subnormal(),
            allowance: allowance.map(|a| arr3(&[[[a]]]).into_dyn()),
        })
    }

    /// CPU fuzz seed 2043, case 1632: an f16 dK whose reference is -15,822, stored as +inf by a
    /// path whose noise (the emulation's own error 41,600) exceeds its distance to the limit.
    #[test]
    fn a_stored_infinity_is_judged_as_the_limit_and_nan_never_passes() {
        let max = f64::from(Dtype::F16.max_finite());
        // One element whose emulation is 41,600 off: threshold 4 x 41,600 + floor.
        let j = triple_with(f64::INFINITY, -15_822.0, -15_822.0 + 41_600.0);
        assert!((j.err - (max + 15_822.0)).abs() < 1e-9, "{j:?}");
        assert!(j.passed(), "{j:?}");
        // Without the noise the same infinity fails, and NaN fails whatever the noise.
        assert!(!triple(f64::INFINITY, -15_822.0).passed());
        assert!(!triple_with(f64::NAN, -15_822.0, -15_822.0 + 41_600.0).passed());
    }

    /// CPU fuzz seed 2043, case 1564: a dK of 60,644 whose own rounding allowance reaches the
    /// limit may be stored as the infinity of its sign.
    #[test]
    fn an_elements_allowance_is_headroom_at_the_limit() {
        let at = |allowance| one_element(Dtype::F16, f64::INFINITY, 60_644.0, 60_644.0, allowance);
        assert!(!at(None).passed());
        assert!(!at(Some(1_000.0)).passed());
        assert!(at(Some(5_000.0)).passed());
    }

    #[test]
    fn subnormal_outputs_get_a_few_subnormal_spacings() {
        // bf16 dK at its smallest normal (CPU fuzz seed 2036, case 45052, mixed-path
        // backward): 6.5 subnormal spacings off, the emulation 0.8.
        let spacing = Dtype::Bf16.smallest_subnormal();
        let (r, e) = (
            -1.2171821268948917e-38,
            -1.2171821268948917e-38 + 0.77 * spacing,
        );
        let j = one_element(Dtype::Bf16, -1.1571272515906893e-38, r, e, None);
        assert!(j.passed(), "{j:?}");
        // Ten spacings are still an error.
        assert!(!one_element(Dtype::Bf16, r + 10.0 * spacing, r, e, None).passed());
    }

    #[test]
    fn an_elements_allowance_comes_off_its_error_and_a_non_finite_one_excuses_nothing() {
        let j = with_allowance(2.0, 1.0, 0.75);
        assert!((j.err - 0.25).abs() < 1e-12, "{}", j.err);
        assert!(!j.passed());
        assert!(with_allowance(2.0, 1.0, 1.5).passed());
        assert!(!with_allowance(2.0, 1.0, f64::NAN).passed());
        assert!(!with_allowance(2.0, 1.0, f64::INFINITY).passed());
    }

    #[test]
    fn overflow_next_to_the_limit_is_accepted_with_the_right_sign() {
        // f16 max is 65504; -65464.7 is within the noise floor of overflowing.
        assert!(triple(f64::NEG_INFINITY, -65464.7).passed());
        assert!(!triple(f64::INFINITY, -65464.7).passed());
        assert!(!triple(f64::NEG_INFINITY, -60000.0).passed());
        assert!(!triple(f64::NAN, -65464.7).passed());
    }

    #[test]
    fn saturation_and_overflow_agree_past_the_limit() {
        let max = f64::from(Dtype::F16.max_finite());
        assert!(triple(max, f64::INFINITY).passed());
        assert!(triple(f64::INFINITY, max).passed());
        assert!(!triple(-max, f64::INFINITY).passed());
    }

    #[test]
    fn an_overflow_the_yardstick_shares_is_no_error() {
        // The emulation overflows too (dS rounded past the f16 limit): same verdict.
        let j = triple_with(f64::NEG_INFINITY, -20251.0, f64::NEG_INFINITY);
        assert!(j.passed(), "{j:?}");
        assert!(!triple_with(f64::INFINITY, -20251.0, f64::NEG_INFINITY).passed());
        // Whatever the reference's sign: a row whose dS overflowed sums infinities (CPU fuzz,
        // seed 2032, case 4871: f16 dQ -inf on both where the reference is +31,244).
        let j = triple_with(f64::NEG_INFINITY, 31244.0, f64::NEG_INFINITY);
        assert!(j.passed(), "{j:?}");
        assert!(j.threshold.is_finite(), "{j:?}");
        // A kernel accurate where the yardstick overflowed passes; one off does not.
        assert!(triple_with(31244.0, 31244.0, f64::NEG_INFINITY).passed());
        assert!(!triple_with(20000.0, 31244.0, f64::NEG_INFINITY).passed());
        // NaN where the emulation meets inf - inf too; a NaN of the kernel's own is an error.
        let j = triple_with(f64::NAN, 31244.0, f64::NAN);
        assert!(j.passed() && j.threshold.is_finite(), "{j:?}");
        assert!(!triple_with(f64::NAN, 31244.0, 31244.0).passed());
        assert!(!triple_with(f64::NAN, 31244.0, f64::INFINITY).passed());
    }

    #[test]
    fn score_magnitude_is_the_largest_visible_abs_dot_product() {
        use smallseq_reference::{Layout, Mask};
        let layout = Layout::packed(&[(2, 2)]);
        let q = ndarray::Array3::from_shape_vec((2, 1, 2), vec![1.0, -2.0, 3.0, 4.0]).unwrap();
        let k = ndarray::Array3::from_shape_vec((2, 1, 2), vec![1.0, 1.0, -1.0, 2.0]).unwrap();
        let mut config = crate::AttnConfig::new(Dtype::F32, 1, 2, Mask::Causal);
        config.params.scale = 0.5;
        let case = Case::new(config, layout, q, k.clone(), k, None).unwrap();
        // Row 0 sees key 0 only: |1·1| + |−2·1| = 3; row 1 sees both: max(3+4, 3+8) = 11.
        assert_eq!(score_magnitude(&case), 0.5 * 11.0);
    }
}
