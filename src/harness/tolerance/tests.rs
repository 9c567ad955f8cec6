//! The tolerance rule's cases: element errors at and past the dtype's limit, the row rule, margins,
//! blindness and the score magnitude.

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
        actual: arr3(&[[[actual]]]).into_dyn().view(),
        reference: arr3(&[[[reference]]]).into_dyn().view(),
        emulated: arr3(&[[[emulated]]]).into_dyn().view(),
        valid: &valid,
        unit: dtype.unit_roundoff(),
        min_magnitude: 0.0,
        max_finite: f64::from(dtype.max_finite()),
        min_spacing: dtype.smallest_subnormal(),
        spacings: FLOOR,
        allowance: allowance
            .map(|a| arr3(&[[[a]]]).into_dyn())
            .as_ref()
            .map(|a| a.view()),
        order: None,
        order_in_tensor_rule: false,
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
fn a_non_finite_value_the_yardstick_shares_is_excused_only_where_the_reference_overflows() {
    // The reference past the limit (or within the threshold of it): the emulation
    // overflowing too is the same verdict.
    let j = triple_with(f64::NEG_INFINITY, -70000.0, f64::NEG_INFINITY);
    assert!(j.passed() && j.threshold.is_finite(), "{j:?}");
    let j = triple_with(f64::NAN, 70000.0, f64::NAN);
    assert!(j.passed() && j.threshold.is_finite(), "{j:?}");
    assert!(!triple_with(f64::INFINITY, -70000.0, f64::NEG_INFINITY).passed());
    // Where the reference is an ordinary value, a kernel and the emulation sharing an
    // infinity or a NaN agree about a bug (CPU fuzz seed 2032, case 4871, was excused so:
    // f16 dQ -inf on both where the reference is +31,244): the kernel fails, and the
    // emulation's own overflow does not make the threshold infinite.
    for shared in [f64::NEG_INFINITY, f64::NAN] {
        let j = triple_with(shared, 31244.0, shared);
        assert!(!j.passed() && j.threshold.is_finite(), "{j:?}");
    }
    let j = triple_with(f64::NAN, 1.0, f64::NAN);
    assert!(!j.passed(), "{j:?}");
    // A kernel accurate where the yardstick overflowed passes; one off does not.
    assert!(triple_with(31244.0, 31244.0, f64::NEG_INFINITY).passed());
    assert!(!triple_with(20000.0, 31244.0, f64::NEG_INFINITY).passed());
    assert!(!triple_with(f64::NAN, 31244.0, 31244.0).passed());
}

/// H200 fuzz seed 2102, case 37242: an f16 dQ of -0.045 stored as +inf because dS of
/// 91,248 saturates before the product, on the device and in the emulation alike. The
/// verdict fails, and says that the emulation holds the same value there and how many of
/// its elements its own error leaves out, so it does not read as a kernel off its design.
#[test]
fn a_failure_says_where_the_design_itself_holds_the_kernels_value() {
    let j = triple_with(f64::INFINITY, -0.045, f64::INFINITY);
    assert!(!j.passed(), "{j:?}");
    let w = j.worst.clone().expect("a worst element");
    assert!(w.design_shares() && w.emulated == f64::INFINITY, "{w:?}");
    assert!(
        w.describe(Design::Project)
            .contains("emulation inf (the same value"),
        "{}",
        w.describe(Design::Project)
    );
    assert!(
        !w.describe(Design::Envelope)
            .contains("limit of the kernel design"),
        "{}",
        w.describe(Design::Envelope)
    );
    assert_eq!(j.emu_non_finite, 1);
    // A kernel off the emulation: neither note.
    let j = triple_with(f64::INFINITY, -0.045, -0.05);
    let w = j.worst.clone().expect("a worst element");
    assert!(
        !j.passed() && !w.design_shares() && j.emu_non_finite == 0,
        "{j:?}"
    );
    assert!(
        !w.describe(Design::Project).contains("the same value"),
        "{}",
        w.describe(Design::Project)
    );
    // Past the range the emulation's infinity is the reference's own: not counted.
    assert_eq!(
        triple_with(f64::INFINITY, 70000.0, f64::INFINITY).emu_non_finite,
        0
    );
}

#[test]
fn past_the_limit_only_the_right_infinity_or_the_saturated_value_passes() {
    let max = f64::from(Dtype::F16.max_finite());
    // The emulation overflows to +inf where the reference is 70,000.
    let at = |actual| triple_with(actual, 70000.0, f64::INFINITY);
    assert!(at(f64::INFINITY).passed());
    assert!(at(max).passed());
    // Once skipped: a finite value far below the reference, NaN instead of inf, the
    // wrong infinity.
    for wrong in [45440.0, f64::NAN, f64::NEG_INFINITY, -max, 0.0] {
        assert!(!at(wrong).passed(), "{wrong} passed");
    }
}

/// A `[2, 2, 4]` bf16 tensor: row (0, 0) holds values of `big`, row (1, 1) of `small`, the
/// rest 1; `actual` edits the reference; the emulation is the reference rounded to bf16.
/// One bf16 dK of two tokens, both valid, judged with the plain floor.
fn bf16_dk(
    actual: ArrayD<f64>,
    reference: ArrayD<f64>,
    emulated: ArrayD<f64>,
    allowance: Option<ArrayD<f64>>,
) -> Judgement {
    judge(&Triple {
        name: "dk",
        actual: actual.view(),
        reference: reference.view(),
        emulated: emulated.view(),
        valid: &[true, true],
        unit: Dtype::Bf16.unit_roundoff(),
        min_magnitude: 0.0,
        max_finite: f64::from(Dtype::Bf16.max_finite()),
        min_spacing: Dtype::Bf16.smallest_subnormal(),
        spacings: FLOOR,
        allowance: allowance.as_ref().map(|a| a.view()),
        order: None,
        order_in_tensor_rule: false,
    })
}

fn two_scale_rows(big: f64, small: f64, edit: impl Fn(&mut ArrayD<f64>)) -> Judgement {
    let reference = ndarray::Array3::from_shape_fn((2, 2, 4), |(t, h, d)| {
        let s = match (t, h) {
            (0, 0) => big,
            (1, 1) => small,
            _ => 1.0,
        };
        s * (1.0 + 0.1 * d as f64)
    })
    .into_dyn();
    let emulated = reference.mapv(|x| f64::from(Dtype::Bf16.round_f64(x)));
    let mut actual = emulated.clone();
    edit(&mut actual);
    bf16_dk(actual, reference, emulated, None)
}

#[test]
fn a_zeroed_row_under_the_tensor_threshold_fails_the_row_rule() {
    // Row (1, 1) at 1.5 % of the tensor's largest value (4,700, as the dK): under
    // the tensor threshold 4·u·4700 ≈ 73, so only the row rule sees it zeroed.
    let zero_row = |t: &mut ArrayD<f64>| {
        t.slice_mut(ndarray::s![1, 1, ..]).fill(0.0);
    };
    let j = two_scale_rows(4700.0, 70.0, zero_row);
    assert!(
        j.err < j.threshold,
        "the tensor rule alone passes it: {j:?}"
    );
    assert!(!j.passed(), "{j:?}");
    let row = j.row.clone().unwrap();
    assert_eq!((row.token, row.head), (1, 1));
    assert!(row.margin > 10.0, "{row:?}");
    // The correct output passes both rules, with a small margin.
    let j = two_scale_rows(4700.0, 70.0, |_| {});
    assert!(j.passed() && j.margin < 0.5, "{j:?}");
    // A one-ulp change of the small row passes (its own floor is four units).
    let j = two_scale_rows(4700.0, 70.0, |t| {
        t[[1, 1, 0]] = f64::from(Dtype::Bf16.round_f64(t[[1, 1, 0]] * (1.0 + 1.0 / 128.0)));
    });
    assert!(j.passed(), "{j:?}");
}

/// A bf16 dK of two tokens × two heads × 4 dims, every row of scale 1 but for row (0, 0)
/// whose emulation is `emu_off` off (dS cancelling there), with per-element allowances
/// `allow` (None: none) and `edit` applied to the emulation's values for the actual.
fn one_noisy_row(emu_off: f64, allow: Option<f64>, edit: impl Fn(&mut ArrayD<f64>)) -> Judgement {
    let reference =
        ndarray::Array3::from_shape_fn((2, 2, 4), |(_, _, d)| 1.0 + 0.1 * d as f64).into_dyn();
    let mut emulated = reference.mapv(|x| f64::from(Dtype::Bf16.round_f64(x)));
    emulated[[0, 0, 0]] += emu_off;
    let mut actual = emulated.clone();
    edit(&mut actual);
    let allowance = allow.map(|a| reference.mapv(|_| a));
    bf16_dk(actual, reference, emulated, allowance)
}

#[test]
fn one_cancelling_row_no_longer_blinds_the_other_rows() {
    let zero_row = |t: &mut ArrayD<f64>| t.slice_mut(ndarray::s![1, 1, ..]).fill(0.0);
    // The emulation 0.4 off on one element: the tensor threshold (4·0.4 + floor) exceeds
    // max|ref| = 1.3. Until the relative floor was capped, every row's yardstick took the
    // tensor's relative error (0.31) and a zeroed row passed with margin 0.8.
    let j = one_noisy_row(0.4, None, zero_row);
    assert!(j.threshold >= 1.3, "{j:?}");
    assert!(!j.passed(), "{j:?}");
    let row = j.row.clone().unwrap();
    assert_eq!((row.token, row.head), (1, 1));
    assert!(row.margin > 10.0, "{row:?}");
    // The correct output (the emulation) passes with a small margin, the noisy row included.
    let j = one_noisy_row(0.4, None, |_| {});
    assert!(j.passed() && j.margin <= 0.25 + 1e-9, "{j:?}");
    // All zeros fail: not blind.
    let j = one_noisy_row(0.4, None, |t| t.fill(0.0));
    assert!(!j.passed() && !j.blind && !j.indeterminate, "{j:?}");
}

#[test]
fn values_inside_their_own_noise_are_indeterminate_not_blind() {
    // Every element's allowance (the rounding noise of its own terms) exceeds its value:
    // zeros pass on the allowances alone.
    let j = one_noisy_row(0.4, Some(1.5), |t| t.fill(0.0));
    assert!(j.passed() && j.indeterminate && !j.blind, "{j:?}");
    // Allowances under the values: zeros fail.
    let j = one_noisy_row(0.4, Some(0.5), |t| t.fill(0.0));
    assert!(!j.passed() && !j.indeterminate && !j.blind, "{j:?}");
}

/// The boundary that remains (docs/judgement.md, "Blind verdicts"): a row whose own
/// emulation error is a third of its scale gives that row a threshold above its values, so
/// where every other row lies inside its own noise, zeros pass on that row's yardstick
/// alone: flagged blind and counted in report.json.
#[test]
fn a_row_as_noisy_as_its_values_is_the_blind_boundary() {
    let reference = ndarray::arr3(&[[[1.0, 1.1]], [[1.0, 1.1]]]).into_dyn();
    let mut emulated = reference.mapv(|x| f64::from(Dtype::Bf16.round_f64(x)));
    emulated[[0, 0, 0]] += 0.4;
    // Row 1 lies inside its allowance, row 0 does not.
    let allowance = ndarray::arr3(&[[[0.2, 0.2]], [[1.5, 1.5]]]).into_dyn();
    let j = bf16_dk(
        reference.mapv(|_| 0.0),
        reference,
        emulated,
        Some(allowance),
    );
    assert!(j.passed() && j.blind && !j.indeterminate, "{j:?}");
}

#[test]
fn f32_sums_of_subnormal_products_get_spacings_per_term() {
    assert_eq!(subnormal_spacings(Dtype::F32, 17, 0.0), FLOOR + 8.5);
    assert_eq!(subnormal_spacings(Dtype::F32, 3, 3.0), FLOOR + 6.0);
    assert_eq!(subnormal_spacings(Dtype::Bf16, 129, 9.0), FLOOR);
    // Never past the subnormal range, however large the inputs.
    assert_eq!(
        subnormal_spacings(Dtype::F32, 129, f64::INFINITY),
        2f64.powi(23)
    );
    assert_eq!(subnormal_spacings(Dtype::F16, 129, 9.0), FLOOR);
    // A subnormal f32 element 4.6 spacings from the reference, the emulation exact: past
    // the plain floor of 4 spacings, inside 4 + 17/2.
    let s = Dtype::F32.smallest_subnormal();
    let judge_with = |spacings, off: f64| {
        let one = |x: f64| arr3(&[[[x]]]).into_dyn();
        judge(&Triple {
            name: "dk",
            actual: one(0.0).view(),
            reference: one(off * s).view(),
            emulated: one(off * s).view(),
            valid: &[true],
            unit: Dtype::F32.unit_roundoff(),
            min_magnitude: 0.0,
            max_finite: f64::from(Dtype::F32.max_finite()),
            min_spacing: s,
            spacings,
            allowance: None,
            order: None,
            order_in_tensor_rule: false,
        })
    };
    assert!(!judge_with(FLOOR, 4.6).passed());
    let j = judge_with(subnormal_spacings(Dtype::F32, 17, 0.0), 4.6);
    assert!(j.passed() && j.margin < 0.5, "{j:?}");
    // Twenty spacings off fails even so.
    assert!(!judge_with(subnormal_spacings(Dtype::F32, 17, 0.0), 20.0).passed());
}

#[test]
fn a_threshold_reaching_the_references_magnitude_is_flagged_blind() {
    // The emulation a quarter off: threshold 4·emu_err > max |ref|.
    let j = triple_with(0.0, 1.0, 0.75);
    assert!(j.blind && j.passed(), "{j:?}");
    assert!(!triple_with(1.0, 1.0, 1.0).blind);
    // In the subnormal range a few spacings exceed every value: not flagged.
    let tiny = 3.0 * Dtype::F16.smallest_subnormal();
    let j = one_element(Dtype::F16, tiny, tiny, tiny, None);
    assert!(j.threshold >= tiny && !j.blind, "{j:?}");
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

#[test]
fn an_elements_error_is_its_distance_or_infinity_where_a_side_is_not_finite() {
    // The rule as first written, test by test; `elem_err` forms it with one test.
    let spelled_out = |a: f64, r: f64| {
        if a == r {
            0.0
        } else if a.is_nan() || r.is_nan() || a.is_infinite() || r.is_infinite() {
            f64::INFINITY
        } else {
            (a - r).abs()
        }
    };
    let values = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        f64::MAX,
        -f64::MAX,
        f64::MIN_POSITIVE,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
    ];
    for a in values {
        for r in values {
            assert_eq!(
                elem_err(a, r).to_bits(),
                spelled_out(a, r).to_bits(),
                "{a} {r}"
            );
        }
    }
}
