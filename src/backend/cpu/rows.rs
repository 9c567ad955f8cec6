//! One head's rows of an input, loaded once per (slot, head) instead of once per use, and the
//! dot products of one row against all of them.
//!
//! The kernels' dot products are sums in `d` order from 0 ([`dot`]), a chain of dependent f32
//! adds that does not vectorise. [`HeadRows::dots`] forms the same sums for every row at once
//! over the rows transposed (`[D, n]`): each sum still adds its terms in `d` order from 0, so
//! every finite or infinite result is bit for bit the one [`dot`] gives, but the adds of
//! different rows are independent and run side by side.
//!
//! NaN is the exception: which operand's NaN an add or multiply passes on is the machine
//! code's choice, and the vectorised loop may choose otherwise. Where an operand is not finite
//! (a planted defect reading poisoned don't-care rows), [`dot`] forms the sums as before, so
//! the NaN an output holds, which bitwise relations compare, stays the same.

use super::CpuBackend;
use ndarray::ArrayView3;
use smallseq_reference::Dtype;

/// Rows `first..first + n` of head `h` of a tensor, as the kernel's loader reads them
/// ([`CpuBackend::load`]), row after row (`[n, width]`) and transposed (`[width, stride]`, the
/// rows padded with zeros to a whole number of [`KEYS`]).
pub(super) struct HeadRows {
    data: Vec<f32>,
    transposed: Vec<f32>,
    width: usize,
    stride: usize,
    /// Every element is finite.
    finite: bool,
}

/// Rows whose dot products are formed together, in registers.
const KEYS: usize = 8;

impl HeadRows {
    pub fn load(
        be: &CpuBackend,
        dtype: Dtype,
        t: &ArrayView3<f32>,
        first: usize,
        n: usize,
        h: usize,
    ) -> Self {
        let width = t.shape()[2];
        let mut data = Vec::with_capacity(n * width);
        for row in first..first + n {
            if row < t.shape()[0] {
                be.load_into(dtype, t, row, h, &mut data);
            } else {
                // Past the tensor (a planted slot-geometry defect): no kernel reads it.
                data.resize(data.len() + width, f32::NAN);
            }
        }
        let stride = n.div_ceil(KEYS) * KEYS;
        let mut transposed = vec![0f32; stride * width];
        for (i, row) in data.chunks_exact(width.max(1)).enumerate() {
            for (j, &x) in row.iter().enumerate() {
                transposed[j * stride + i] = x;
            }
        }
        HeadRows {
            finite: all_finite(&data),
            data,
            transposed,
            width,
            stride,
        }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.width..(i + 1) * self.width]
    }

    /// `out[c] = dot(x, row c)` for each of the `out.len()` first rows.
    pub fn dots(&self, x: &[f32], out: &mut [f32]) {
        if !(self.finite && all_finite(x)) {
            for (c, o) in out.iter_mut().enumerate() {
                *o = dot(x, self.row(c));
            }
            return;
        }
        // Two or one blocks of rows at a time, their sums held in registers over the whole of
        // `x` (independent chains); the padding's sums are left out.
        let mut start = 0;
        while start < out.len() {
            let left = out.len() - start;
            if left > KEYS {
                let acc = self.block::<{ 2 * KEYS }>(x, start);
                let m = left.min(2 * KEYS);
                out[start..start + m].copy_from_slice(&acc[..m]);
                start += 2 * KEYS;
            } else {
                let acc = self.block::<KEYS>(x, start);
                out[start..].copy_from_slice(&acc[..left]);
                start += KEYS;
            }
        }
    }

    /// The sums of rows `start..start + W` (padding included), each from 0 in `x`'s order.
    fn block<const W: usize>(&self, x: &[f32], start: usize) -> [f32; W] {
        let mut acc = [0f32; W];
        for (j, &xj) in x.iter().enumerate() {
            let at = j * self.stride + start;
            let col = &self.transposed[at..at + W];
            for (a, &y) in acc.iter_mut().zip(col) {
                *a += xj * y;
            }
        }
        acc
    }
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().fold(true, |ok, v| ok & v.is_finite())
}

/// A dot product as a kernel's loop forms it: from 0, in order.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |acc, (x, y)| acc + x * y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_over_transposed_rows_equal_dot_bit_for_bit() {
        let be = CpuBackend::default();
        // Values whose sums round differently in another order.
        let mut t = ndarray::Array3::from_shape_fn((30, 2, 7), |(i, h, j)| {
            let x = (i * 31 + h * 7 + j * 13) as f32;
            (x * 0.37).sin() * 10f32.powi((j % 5) as i32 - 2)
        });
        let x: Vec<f32> = (0..7).map(|j| (j as f32 * 1.7).cos() * 1e3).collect();
        let check = |t: &ndarray::Array3<f32>| {
            // Fewer rows than a block, a block and a part, two blocks and more.
            for n in [4, 8, 9, 20, 29] {
                let rows = HeadRows::load(&be, Dtype::F32, &t.view(), 1, n, 1);
                let mut out = vec![0f32; n];
                rows.dots(&x, &mut out);
                for (c, o) in out.iter().enumerate() {
                    assert_eq!(o.to_bits(), dot(&x, rows.row(c)).to_bits(), "{n} rows");
                }
                rows.dots(&x, &mut []);
            }
        };
        check(&t);
        // A poisoned row: the same NaN as the loop's.
        t[(2, 1, 3)] = f32::NAN;
        t[(3, 1, 0)] = f32::INFINITY;
        t[(3, 1, 1)] = f32::NEG_INFINITY;
        check(&t);
    }
}
