//! Slicing one slot out of the THD buffers.
//!
//! Every read of an input tensor goes through [`rows`], and it only ever touches the slot's
//! valid tokens `off..off+len`: this is what keeps don't-care tokens (pad-between, tail
//! slack, spans of empty slots) out of every computation.

use crate::layout::Layout;
use ndarray::{s, Array2, ArrayView3};

/// Where slot `i` lives in the q-side and kv-side buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotGeom {
    /// First token of the slot in `q`/`d_o`/`o`/`dq` (`off_q[i]`).
    pub off_q: usize,
    /// First token of the slot in `k`/`v`/`dk`/`dv` (`off_kv[i]`).
    pub off_kv: usize,
    /// `Lq_i`
    pub lq: usize,
    /// `Lk_i`
    pub lk: usize,
}

impl SlotGeom {
    /// Geometry of slot `i` of `layout`.
    pub fn of(layout: &Layout, i: usize) -> SlotGeom {
        SlotGeom {
            off_q: layout.q.offset(i),
            off_kv: layout.kv.offset(i),
            lq: layout.q.len(i),
            lk: layout.kv.len(i),
        }
    }

    /// Whether the slot has no query or no key: nothing to compute, its valid query rows (if
    /// any) keep `o = 0`, `lse = -inf`.
    pub fn is_empty(&self) -> bool {
        self.lq == 0 || self.lk == 0
    }
}

/// Rows `off..off+len` of head `head` of a `[T, heads, D]` buffer, as a contiguous f64
/// `[len, D]` array (the upcast is exact for f32 inputs).
pub fn rows<T: Copy + Into<f64>>(
    x: &ArrayView3<'_, T>,
    off: usize,
    len: usize,
    head: usize,
) -> Array2<f64> {
    let d = x.shape()[2];
    let mut out: Vec<f64> = Vec::with_capacity(len * d);
    for t in off..off + len {
        let row = x.slice(s![t, head, ..]);
        // A standard-layout buffer has contiguous rows; the slice path vectorizes.
        match row.as_slice() {
            Some(src) => out.extend(src.iter().map(|&e| e.into())),
            None => out.extend(row.iter().map(|&e| e.into())),
        }
    }
    Array2::from_shape_vec((len, d), out).expect("len * d elements")
}

/// The operands of one (slot, head) block, each `[rows, D]`.
#[derive(Clone, Debug)]
pub struct Block {
    /// `[Lq, Dqk]`
    pub q: Array2<f64>,
    /// `[Lk, Dqk]`, kv head `h / g`
    pub k: Array2<f64>,
    /// `[Lk, Dv]`, kv head `h / g`
    pub v: Array2<f64>,
    /// `[Lq, Dv]`
    pub d_o: Option<Array2<f64>>,
}

/// Slices query head `h` (kv head `hkv`) of slot `s` out of the buffers.
pub fn block<T: Copy + Into<f64>>(
    s: SlotGeom,
    h: usize,
    hkv: usize,
    q: &ArrayView3<'_, T>,
    k: &ArrayView3<'_, T>,
    v: &ArrayView3<'_, T>,
    d_o: Option<&ArrayView3<'_, T>>,
) -> Block {
    Block {
        q: rows(q, s.off_q, s.lq, h),
        k: rows(k, s.off_kv, s.lk, hkv),
        v: rows(v, s.off_kv, s.lk, hkv),
        d_o: d_o.map(|d| rows(d, s.off_q, s.lq, h)),
    }
}
