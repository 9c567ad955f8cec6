//! The per-element rule of the tolerance model, row by row: each (token, head) row's largest
//! error, where it is, and its magnitude ([`max_err`]).

use super::elem_err;
use ndarray::ArrayViewD;

/// Whether `x` and `y` both say "at or past the dtype's limit", with the same sign: an
/// overflow to infinity and a saturation to the largest finite value are the same verdict.
pub(crate) fn both_past_limit(x: f64, y: f64, max_finite: f64) -> bool {
    x.abs() >= max_finite && y.abs() >= max_finite && x.signum() == y.signum()
}

/// Whether `x` is the value `e` is as stored: the same bits, or NaN for NaN whatever its
/// payload (the emulation's arithmetic meeting `inf - inf`). The one test of "the emulation
/// holds this value" for the tolerance rule, the worst element's wording and the range limits.
pub(crate) fn same_stored(x: f64, e: f64) -> bool {
    x.to_bits() == e.to_bits() || (x.is_nan() && e.is_nan())
}

/// Where an error is: (token, head, dim: None for lse), value, expected.
pub(super) type At = ((usize, usize, Option<usize>), f64, f64);

/// The largest error of one (token, head) row (of lse: one element), where it is, and the
/// row's `max |reference|` (finite values).
#[derive(Clone, Debug, Default)]
pub(super) struct RowMax {
    pub err: f64,
    pub at: Option<At>,
    pub mag: f64,
    /// The largest error less each element's allowance for another order (the per-row rule's
    /// error; `err` without one).
    pub row_err: f64,
}

/// How the yardstick's non-finite values excuse an element.
#[derive(Clone, Copy)]
pub(super) enum Yard<'a, 'b> {
    /// Judging the emulation itself: its own overflows are no error of it (an intermediate
    /// past the dtype's range would make its error, and the threshold, infinite).
    Own,
    /// Judging a kernel: a non-finite value the emulation holds too is excused only where the
    /// f64 reference also overflows (non-finite, or within the headroom of the limit): a kernel
    /// and the emulation sharing a NaN where the reference is 1.0 agree about a bug.
    Kernel(&'a ArrayViewD<'b, f64>),
}

/// Max error per row over tokens flagged valid, and where it is. Past the dtype's limit only
/// an infinity of the reference's sign or the saturated value passes ([`both_past_limit`]);
/// an infinity of the reference's sign is no error where the reference lies within
/// `headroom` plus the element's allowance of the limit, and elsewhere is judged as the limit
/// in its direction; a shared non-finite value, see [`Yard`]. Each element's error is reduced
/// by its `allow`ance, when given, and for the per-row rule by its `order` allowance too.
#[allow(clippy::too_many_arguments)]
pub(super) fn max_err(
    a: &ArrayViewD<f64>,
    r: &ArrayViewD<f64>,
    valid: &[bool],
    max_finite: f64,
    headroom: f64,
    yard: Yard,
    allow: Option<&ArrayViewD<f64>>,
    order: Option<&ArrayViewD<f64>>,
    order_in_tensor_rule: bool,
) -> Vec<RowMax> {
    let shape = a.shape();
    let heads = shape.get(1).copied().unwrap_or(1);
    let inner = shape.get(2).copied().unwrap_or(1);
    let mut best = vec![RowMax::default(); shape[0] * heads];
    // Flat slices in one layout: the per-element index arithmetic of a dynamic array is
    // most of a judgement's time.
    let a = a.as_standard_layout();
    let r = r.as_standard_layout();
    let yard_e = match yard {
        Yard::Own => None,
        Yard::Kernel(e) => Some(e.as_standard_layout()),
    };
    let allow = allow.map(|al| al.as_standard_layout());
    let order = order.map(|o| o.as_standard_layout());
    let order = order.as_ref().map(|o| o.as_slice().expect("standard"));
    let (a, r) = (
        a.as_slice().expect("standard"),
        r.as_slice().expect("standard"),
    );
    let yard_e = yard_e.as_ref().map(|e| e.as_slice().expect("standard"));
    let allow = allow.as_ref().map(|al| al.as_slice().expect("standard"));
    let n = a.len().min(r.len());
    let rule = ElementRule {
        max_finite,
        headroom,
        order_in_tensor_rule,
    };
    // Row by row: an invalid token's rows are skipped whole, and no element pays for index
    // divisions (they were a third of the judging stage's time).
    for (row_i, row) in best.iter_mut().enumerate() {
        if !valid[row_i / heads] {
            continue;
        }
        let start = row_i * inner;
        let end = (start + inner).min(n);
        if start >= end {
            continue;
        }
        let at = RowAt {
            token: row_i / heads,
            head: row_i % heads,
            has_dim: shape.len() > 2,
        };
        let (x, y) = (&a[start..end], &r[start..end]);
        let e = yard_e.map(|e| &e[start..end]);
        // One loop per combination of allowances present, so that an absent one costs no
        // test per element (absent reads as NaN, which excuses nothing, as before).
        match (
            allow.map(|al| &al[start..end]),
            order.map(|o| &o[start..end]),
        ) {
            (Some(al), Some(o)) => rule.scan(row, at, x, y, e, |k| al[k], |k| o[k]),
            (Some(al), None) => rule.scan(row, at, x, y, e, |k| al[k], |_| f64::NAN),
            (None, Some(o)) => rule.scan(row, at, x, y, e, |_| f64::NAN, |k| o[k]),
            (None, None) => rule.scan(row, at, x, y, e, |_| f64::NAN, |_| f64::NAN),
        }
    }
    best
}

/// Where a row lies: its token and head, and whether its elements have a dimension index
/// (not for lse).
#[derive(Clone, Copy)]
struct RowAt {
    token: usize,
    head: usize,
    has_dim: bool,
}

/// The per-element rule of [`max_err`].
struct ElementRule {
    max_finite: f64,
    headroom: f64,
    order_in_tensor_rule: bool,
}

impl ElementRule {
    /// Folds the elements of one row (`x` judged against `y`, the yardstick's own values `e`
    /// for [`Yard::Kernel`]) into `row`; `allow(k)` and `order(k)` are element `k`'s
    /// allowances.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn scan(
        &self,
        row: &mut RowMax,
        at: RowAt,
        x: &[f64],
        y: &[f64],
        e: Option<&[f64]>,
        allow: impl Fn(usize) -> f64,
        order: impl Fn(usize) -> f64,
    ) {
        let max_finite = self.max_finite;
        for (k, (&x, &y)) in x.iter().zip(y).enumerate() {
            // Comparisons instead of `f64::max`, whose NaN handling costs three instructions
            // of a dependent chain: neither side is NaN here.
            if y.is_finite() && y.abs() > row.mag {
                row.mag = y.abs();
            }
            if both_past_limit(x, y, max_finite) {
                continue;
            }
            // A non-finite allowance (from non-finite inputs) excuses nothing.
            let allowed = Some(allow(k)).filter(|a| a.is_finite());
            if !x.is_finite() {
                // The element's own allowance is headroom too: a value that noise may carry
                // past the limit may be stored as the infinity of its sign.
                let room = self.headroom + allowed.unwrap_or(0.0);
                let reference_overflows = !y.is_finite() || y.abs() + room >= max_finite;
                let shared = match e {
                    None => true,
                    Some(e) => reference_overflows && same_stored(x, e[k]),
                };
                if shared {
                    continue;
                }
                if x.is_infinite() && x.signum() == y.signum() && reference_overflows {
                    continue;
                }
            }
            // A stored infinity says the value before the store was at or past the limit in
            // its direction: its error is at least that of the limit itself (with a finite
            // reference), which a threshold wider than the distance to the limit covers (an
            // f16 dK of -15,822 whose noise, measured by the emulation's error of 41,600,
            // carried it past +65,504: CPU fuzz seed 2043, case 1632). NaN still fails.
            let value = if x.is_infinite() && y.is_finite() {
                x.signum() * max_finite
            } else {
                x
            };
            let err = match allowed {
                Some(a) => (elem_err(value, y) - a).max(0.0),
                None => elem_err(value, y),
            };
            // A non-finite order allowance (from non-finite inputs) excuses nothing.
            let o = order(k);
            let err_row = if o.is_finite() {
                (err - o).max(0.0)
            } else {
                err
            };
            // `err` is never NaN (elem_err says infinity) and the allowances are finite.
            if err_row > row.row_err {
                row.row_err = err_row;
            }
            let err = if self.order_in_tensor_rule {
                err_row
            } else {
                err
            };
            if err > row.err || (row.at.is_none() && err.is_nan()) {
                row.err = err;
                row.at = Some(((at.token, at.head, at.has_dim.then_some(k)), x, y));
            }
        }
    }
}

/// The row of `rows` with the largest error (the first of equals).
pub(super) fn worst_of(rows: &[RowMax]) -> RowMax {
    rows.iter().fold(RowMax::default(), |best, r| {
        if r.err > best.err {
            r.clone()
        } else {
            best
        }
    })
}
