//! A query row's f64 dot products with every key of its slot at once.
//!
//! The allowances and the LSE floor's magnitude take, for every visible (query, key) pair, a
//! dot product over the head dimension in f64: a chain of dependent adds per pair, which was
//! most of the allowances' time. Here the keys (or values) of a kv head are laid out
//! transposed, `[D, T]`, and a row's sums against every key of its slot are formed side by
//! side: each sum still adds its terms in `d` order from the same start, so each is bit for bit
//! the sum `Iterator::sum` (which starts at -0.0) or a fold from 0.0 gives.

use ndarray::Array3;
use std::ops::Range;

/// One input tensor `[T, H, D]` mapped to f64 and laid out per head, transposed: `[H, D, T]`,
/// each column padded with [`KEYS`] zeros, so that a block of keys may read past the last.
pub(crate) struct Columns {
    data: Vec<f64>,
    dim: usize,
    stride: usize,
}

/// Keys whose sums are formed together, in registers.
const KEYS: usize = 8;

impl Columns {
    /// `f` of every element of `a`.
    pub fn of(a: &Array3<f32>, f: impl Fn(f32) -> f64) -> Self {
        let (tokens, heads, dim) = a.dim();
        let stride = tokens + KEYS;
        let mut data = vec![0f64; stride * heads * dim];
        for ((t, h, x), &v) in a.indexed_iter() {
            data[(h * dim + x) * stride + t] = f(v);
        }
        Columns { data, dim, stride }
    }

    /// Element `x` of tokens `keys` of head `h`.
    fn col(&self, h: usize, x: usize, keys: &Range<usize>) -> &[f64] {
        let start = (h * self.dim + x) * self.stride;
        &self.data[start + keys.start..start + keys.end]
    }
}

/// `out[c] = start + Σ_x row[x]·k[c, h, x]` for each key token `c` of `keys` (indexed from
/// `keys.start`), each sum in `x` order: `start` -0.0 gives `Iterator::sum`'s.
pub(crate) fn dots(
    row: &[f64],
    k: &Columns,
    h: usize,
    keys: Range<usize>,
    start: f64,
    out: &mut Vec<f64>,
) {
    out.clear();
    // A block of keys at a time, their sums held in registers over the whole row; a block
    // past the last key reads the padding, whose sums are left out.
    for first in keys.clone().step_by(KEYS) {
        let block = first..first + KEYS;
        let mut acc = [start; KEYS];
        for (x, &r) in row.iter().enumerate() {
            for (a, &y) in acc.iter_mut().zip(k.col(h, x, &block)) {
                *a += r * y;
            }
        }
        out.extend_from_slice(&acc[..KEYS.min(keys.end - first)]);
    }
}

/// `(Σ_x t, Σ_x |t|)` with `t = row[x]·v[c, h, x]` for each key token `c` of `keys`, both
/// sums from 0 in `x` order: a dot product and the magnitude its rounding scales with.
pub(crate) fn dots_and_magnitudes(
    row: &[f64],
    v: &Columns,
    h: usize,
    keys: Range<usize>,
    sums: &mut Vec<f64>,
    magnitudes: &mut Vec<f64>,
) {
    sums.clear();
    magnitudes.clear();
    // Blocks of keys in registers, as in [`dots`].
    for first in keys.clone().step_by(KEYS) {
        let block = first..first + KEYS;
        let (mut s, mut m) = ([0f64; KEYS], [0f64; KEYS]);
        for (x, &r) in row.iter().enumerate() {
            for ((s, m), &y) in s.iter_mut().zip(m.iter_mut()).zip(v.col(h, x, &block)) {
                let t = r * y;
                *s += t;
                *m += t.abs();
            }
        }
        let n = KEYS.min(keys.end - first);
        sums.extend_from_slice(&s[..n]);
        magnitudes.extend_from_slice(&m[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_keys_sums_are_those_of_its_own_loop_bit_for_bit() {
        // Terms of mixed signs and magnitudes, whose sums round differently in another order.
        let k = Array3::from_shape_fn((6, 2, 9), |(t, h, x)| {
            let v = ((t * 37 + h * 11 + x * 5) as f32 * 0.61).sin();
            v * 10f32.powi((x % 4) as i32 * 3 - 4)
        });
        let row: Vec<f64> = (0..9).map(|x| f64::from((x as f32 * 1.3).cos())).collect();
        let cols = Columns::of(&k, f64::from);
        let (mut out, mut sums, mut mags) = (vec![], vec![], vec![]);
        dots(&row, &cols, 1, 2..5, -0.0, &mut out);
        dots_and_magnitudes(&row, &cols, 1, 2..5, &mut sums, &mut mags);
        for (i, c) in (2..5).enumerate() {
            let key = k.slice(ndarray::s![c, 1, ..]);
            let summed: f64 = row.iter().zip(key).map(|(a, b)| a * f64::from(*b)).sum();
            assert_eq!(out[i].to_bits(), summed.to_bits());
            let (s, m) = row.iter().zip(key).fold((0.0, 0.0), |(s, m), (a, b)| {
                let t = a * f64::from(*b);
                (s + t, m + t.abs())
            });
            assert_eq!(
                (sums[i].to_bits(), mags[i].to_bits()),
                (s.to_bits(), m.to_bits())
            );
        }
        // A row of zeros sums to the start's sign where every term is -0, as `Iterator::sum`
        // does.
        let negative = Columns::of(&Array3::from_elem((1, 1, 3), -1.0), f64::from);
        dots(&[0.0; 3], &negative, 0, 0..1, -0.0, &mut out);
        assert!(out[0] == 0.0 && out[0].is_sign_negative());
    }
}
