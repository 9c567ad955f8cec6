//! Slicing one slot out of the THD buffers.
//!
//! Every read of an input tensor goes through [`rows`], and it only ever touches the slot's
//! valid tokens `off..off+len`: this is what keeps don't-care tokens (pad-between, tail
//! slack, spans of empty slots) out of every computation.

use crate::layout::Layout;
use ndarray::{s, ArrayView2, ArrayView3, ArrayViewMut2};

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

/// Rows `off..off+len` of head `head` of a `[T, heads, D]` buffer, as a `[len, D]` view: the
/// products read the input in place and upcast on load (exact for f32), so no f64 copy of
/// the inputs is ever made.
pub fn rows<'a, T>(
    x: &'a ArrayView3<'_, T>,
    off: usize,
    len: usize,
    head: usize,
) -> ArrayView2<'a, T> {
    x.slice(s![off..off + len, head, ..])
}

/// `out[d, c] = x[c, d]` in f64 for `x [L, D]`, with columns `L..` of `out` set to 0.
///
/// The score products `Q Kᵀ` and `dO Vᵀ` read the transposed operand row by row; the zero
/// columns let them run whole vector tiles past `L` (those score columns are never read).
pub fn transpose_into<T: Copy + Into<f64>>(x: &ArrayView2<'_, T>, mut out: ArrayViewMut2<'_, f64>) {
    let (l, d) = x.dim();
    assert_eq!(out.nrows(), d, "transpose rows");
    assert!(out.ncols() >= l, "transpose columns");
    out.slice_mut(s![.., l..]).fill(0.0);
    let ld = out.ncols();
    let rows: Option<Vec<&[T]>> = (0..l).map(|c| x.row(c).to_slice()).collect();
    match (rows, out.as_slice_mut()) {
        (Some(rows), Some(o)) => {
            // Four source rows at a time: four streams read in order, four adjacent values
            // written.
            let mut quads = rows.chunks_exact(4);
            for (q, quad) in quads.by_ref().enumerate() {
                let c = 4 * q;
                let cols = quad[0].iter().zip(quad[1]).zip(quad[2].iter().zip(quad[3]));
                for (dst, ((&a, &b), (&e, &f))) in o.chunks_exact_mut(ld).zip(cols) {
                    dst[c..c + 4].copy_from_slice(&[a.into(), b.into(), e.into(), f.into()]);
                }
            }
            let c0 = l - quads.remainder().len();
            for (c, row) in quads.remainder().iter().enumerate() {
                for (dst, &e) in o.chunks_exact_mut(ld).zip(row.iter()) {
                    dst[c0 + c] = e.into();
                }
            }
        }
        _ => {
            for (c, row) in x.rows().into_iter().enumerate() {
                for (o, &e) in out.column_mut(c).iter_mut().zip(&row) {
                    *o = e.into();
                }
            }
        }
    }
}

/// The operands of one (slot, head) block, views into the THD buffers.
#[derive(Clone, Debug)]
pub struct Block<'a, T> {
    /// `[Lq, Dqk]`
    pub q: ArrayView2<'a, T>,
    /// `[Lk, Dqk]`, kv head `h / g`
    pub k: ArrayView2<'a, T>,
    /// `[Lk, Dv]`, kv head `h / g`
    pub v: ArrayView2<'a, T>,
    /// `[Lq, Dv]`
    pub d_o: Option<ArrayView2<'a, T>>,
}

/// Slices query head `h` (kv head `hkv`) of slot `s` out of the buffers.
pub fn block<'a, T>(
    s: SlotGeom,
    h: usize,
    hkv: usize,
    q: &'a ArrayView3<'_, T>,
    k: &'a ArrayView3<'_, T>,
    v: &'a ArrayView3<'_, T>,
    d_o: Option<&'a ArrayView3<'_, T>>,
) -> Block<'a, T> {
    Block {
        q: rows(q, s.off_q, s.lq, h),
        k: rows(k, s.off_kv, s.lk, hkv),
        v: rows(v, s.off_kv, s.lk, hkv),
        d_o: d_o.map(|d| rows(d, s.off_q, s.lq, h)),
    }
}
