//! dS in 16 bits without losing its value (`docs/semantics.md` §1.7, issue 33): the kernels
//! round dS = P·(dP − D) to the input type as a matrix operand, and an f16 dS past 65,504 used
//! to saturate there, which lost the cancellation dQ and dK rely on (H200 seed 2102, case
//! 37242: a row's dS reached 91,248 and dQ came out +inf where the answer is −0.045).
//!
//! Instead, each 16 × 16 block of a (slot, head)'s dS matrix (rows and keys counted from the
//! slot's first token, the tiles of every kernel) whose largest finite |dS| lies past the
//! type's largest finite value is scaled by the least power of two 2^-k that brings it under,
//! rounded, and the products are scaled back by 2^k in f32. A power of two commutes with every
//! rounding in between, so the block's operand is worth `round(dS·2^-k)·2^k` exactly, and a
//! block in range is untouched (bit for bit the unscaled design). Only values so small that
//! `dS·2^-k` is subnormal in the type lose bits to the scaling. An infinite dS (its f32 product
//! overflowed) still saturates: no power of two brings it back.

use crate::types::Dtype;

/// Rows and keys of one scaling block: the matrix cores' 16 × 16 operand tile.
pub const BLOCK: usize = 16;

/// The power of two `2^-k`, `k ≥ 0` least, with `max_abs · 2^-k` at most the type's largest
/// finite value (1 when it already is, and for a non-finite `max_abs`).
pub fn range_scale(dtype: Dtype, max_abs: f32) -> f32 {
    let limit = dtype.max_finite();
    let mut s = 1.0f32;
    if max_abs.is_finite() {
        while max_abs * s > limit {
            s *= 0.5;
        }
    }
    s
}

/// The scale of each 16 × 16 block of an `lq × lk` row-major dS matrix (`ds[r * lk + c]`), in
/// block-row-major order (`scales[(r / 16) * blocks(lk) + c / 16]`).
pub fn block_scales(dtype: Dtype, ds: &[f32], lq: usize, lk: usize) -> Vec<f32> {
    let (br, bc) = (lq.div_ceil(BLOCK), lk.div_ceil(BLOCK));
    let mut max = vec![0.0f32; br * bc];
    for r in 0..lq {
        for c in 0..lk {
            let a = ds[r * lk + c].abs();
            let m = &mut max[(r / BLOCK) * bc + c / BLOCK];
            if a.is_finite() && a > *m {
                *m = a;
            }
        }
    }
    max.into_iter().map(|m| range_scale(dtype, m)).collect()
}

/// dS as the matrix operand carries it: rounded to the type after the block's scale `s`,
/// saturated where still out of range, and worth `round(dS·s) / s`.
#[inline]
pub fn operand(dtype: Dtype, ds: f32, s: f32) -> f32 {
    dtype.round_saturating(ds * s) / s
}

/// Every value of an `lq × lk` dS matrix as its operand ([`operand`] with [`block_scales`]).
pub fn operands(dtype: Dtype, ds: &[f32], lq: usize, lk: usize) -> Vec<f32> {
    let scales = block_scales(dtype, ds, lq, lk);
    let bc = lk.div_ceil(BLOCK);
    (0..lq * lk)
        .map(|i| {
            let (r, c) = (i / lk, i % lk);
            operand(dtype, ds[i], scales[(r / BLOCK) * bc + c / BLOCK])
        })
        .collect()
}

/// How a design carries dS as a 16-bit matrix operand: smallseq's kernels scale its blocks
/// into the range ([`operands`]); the other designs an implementation may have (and smallseq's
/// own before issue 33) saturate it at the largest finite value, or round it plainly, past
/// which it is ±inf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DsOperand {
    /// A power of two per 16 × 16 block ([`operands`]).
    BlockScaled,
    /// Rounded with saturation ([`Dtype::round_saturating`]).
    Saturated,
    /// Rounded to nearest-even, overflowing to ±inf.
    Rounded,
}

impl DsOperand {
    /// Every value of an `lq × lk` dS matrix as this design's operand.
    pub fn operands(self, dtype: Dtype, ds: &[f32], lq: usize, lk: usize) -> Vec<f32> {
        match self {
            DsOperand::BlockScaled => operands(dtype, ds, lq, lk),
            DsOperand::Saturated => ds.iter().map(|&x| dtype.round_saturating(x)).collect(),
            DsOperand::Rounded => ds.iter().map(|&x| dtype.round(x)).collect(),
        }
    }
}

/// How many values of a dS matrix lie past the type's largest finite value (or are NaN):
/// the ones a block scale or the saturation had to deal with.
pub fn past_range(dtype: Dtype, ds: &[f32]) -> usize {
    ds.iter()
        .filter(|x| x.is_nan() || x.abs() > dtype.max_finite())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_is_the_least_power_of_two_that_fits() {
        assert_eq!(range_scale(Dtype::F16, 65504.0), 1.0);
        assert_eq!(range_scale(Dtype::F16, 91248.0), 0.5);
        assert_eq!(range_scale(Dtype::F16, 262016.5), 0.125);
        assert_eq!(range_scale(Dtype::F16, f32::INFINITY), 1.0);
        assert_eq!(range_scale(Dtype::Bf16, 1e38), 1.0);
        assert_eq!(range_scale(Dtype::Bf16, f32::MAX), 0.5);
    }

    #[test]
    fn a_saturating_row_keeps_its_cancellation() {
        // One row whose dS sums to 0 (as Σ_j dS_j does): saturated, the first key's excess
        // of 25,744 is lost; scaled by 1/2, the sum is off by f16 roundings alone.
        let ds = [91248.0f32, -50000.0, -41248.0];
        let op = operands(Dtype::F16, &ds, 1, 3);
        let sum: f32 = op.iter().sum();
        assert_eq!(op[0], 91264.0, "round(45624)·2 in f16");
        assert_eq!(sum, 32.0, "91,264 - 49,984 - 41,248");
        let sat: f32 = ds.iter().map(|&x| Dtype::F16.round_saturating(x)).sum();
        assert_eq!(
            sat, -25728.0,
            "65,504 - 49,984 - 41,248: the excess is lost"
        );
    }

    #[test]
    fn the_other_designs_saturate_or_overflow() {
        let ds = [91248.0f32, -50000.0, -41248.0];
        let sat = DsOperand::Saturated.operands(Dtype::F16, &ds, 1, 3);
        let rounded = DsOperand::Rounded.operands(Dtype::F16, &ds, 1, 3);
        assert_eq!((sat[0], rounded[0]), (65504.0, f32::INFINITY));
        assert_eq!(sat[1], rounded[1]);
        assert_eq!(
            DsOperand::BlockScaled.operands(Dtype::F16, &ds, 1, 3)[0],
            91264.0
        );
    }

    #[test]
    fn only_the_block_past_the_range_is_scaled() {
        // 17 × 17: blocks (0,0), (0,1), (1,0), (1,1); only (1,1) holds a value past 65,504.
        let (lq, lk) = (17, 17);
        let mut ds = vec![1.5f32; lq * lk];
        ds[16 * lk + 16] = 1e6;
        ds[3] = f32::INFINITY;
        let s = block_scales(Dtype::F16, &ds, lq, lk);
        assert_eq!(s, vec![1.0, 1.0, 1.0, 2f32.powi(-4)]);
        let op = operands(Dtype::F16, &ds, lq, lk);
        assert_eq!(op[0], 1.5);
        assert_eq!(op[3], 65504.0, "an infinite dS still saturates");
        assert_eq!(
            op[16 * lk + 16],
            999_936.0,
            "round(62,500) = 62,496 in f16, times 16"
        );
        assert_eq!(past_range(Dtype::F16, &ds), 2);
    }
}
