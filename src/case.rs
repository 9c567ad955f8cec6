//! A case: configuration, THD layout, inputs and (optionally) stored outputs and provenance.

use crate::config::{AttnConfig, LayoutKind};
use crate::error::{Error, Result};
use ndarray::{Array2, Array3, Array4, ArrayView3};
use smallseq_reference::{visible, Dtype, Layout, Problem, Side};
use std::collections::BTreeMap;

/// Outputs of one run, widened to f64 (device values embed exactly). Any tensor may be absent
/// (a forward-only case, or a case file that stores only some outputs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outputs {
    pub o: Option<Array3<f64>>,
    pub lse: Option<Array2<f64>>,
    pub dq: Option<Array3<f64>>,
    pub dk: Option<Array3<f64>>,
    pub dv: Option<Array3<f64>>,
    /// The post-scale bias's gradient `[Bb, Hb, Sq, Sk]` (`docs/semantics.md` §1.9).
    pub dbias: Option<Array4<f64>>,
}

impl Outputs {
    /// Whether no tensor is present.
    pub fn is_empty(&self) -> bool {
        self.o.is_none()
            && self.lse.is_none()
            && self.dq.is_none()
            && self.dk.is_none()
            && self.dv.is_none()
            && self.dbias.is_none()
    }

    /// The `[T, heads, D]` tensors by name: o, dq, dk, dv.
    pub fn rows3(&self) -> [(&'static str, Option<&Array3<f64>>); 4] {
        [
            ("o", self.o.as_ref()),
            ("dq", self.dq.as_ref()),
            ("dk", self.dk.as_ref()),
            ("dv", self.dv.as_ref()),
        ]
    }

    /// [`Outputs::rows3`], mutable.
    pub fn rows3_mut(&mut self) -> [(&'static str, &mut Option<Array3<f64>>); 4] {
        [
            ("o", &mut self.o),
            ("dq", &mut self.dq),
            ("dk", &mut self.dk),
            ("dv", &mut self.dv),
        ]
    }

    /// Bitwise equality (NaN payloads included), tensor by tensor.
    pub fn bitwise_eq(&self, other: &Outputs) -> bool {
        fn eq<D: ndarray::Dimension>(
            a: &Option<ndarray::Array<f64, D>>,
            b: &Option<ndarray::Array<f64, D>>,
        ) -> bool {
            match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    a.shape() == b.shape()
                        && a.iter()
                            .zip(b.iter())
                            .all(|(x, y)| x.to_bits() == y.to_bits())
                }
                _ => false,
            }
        }
        eq(&self.o, &other.o)
            && eq(&self.lse, &other.lse)
            && eq(&self.dq, &other.dq)
            && eq(&self.dk, &other.dk)
            && eq(&self.dv, &other.dv)
            && eq(&self.dbias, &other.dbias)
    }
}

/// dBias `[Bb, Hb, Sq, Sk]` as rows `[Bb·Sq, Hb, Sk]`: the `[token, head, dim]` form the
/// judges read, a row per (plane, query row, head plane) of keys.
pub fn dbias_rows(d: &Array4<f64>) -> Array3<f64> {
    let (bb, hb, sq, sk) = d.dim();
    d.view()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order((bb * sq, hb, sk))
        .expect("the same number of elements")
}

/// One attention case.
#[derive(Clone)]
pub struct Case {
    pub config: AttnConfig,
    pub layout: Layout,
    /// `[Tq, H, Dqk]`, values exactly representable in `config.dtype`.
    pub q: Array3<f32>,
    pub k: Array3<f32>,
    pub v: Array3<f32>,
    pub d_o: Option<Array3<f32>>,
    /// Outputs stored with the case (capsules), if any.
    pub outputs: Outputs,
    /// Provenance metadata (`smallseq.seed`, `smallseq.backend`, ...), verbatim.
    pub meta: BTreeMap<String, String>,
}

/// Config, layout and shapes only: tensors are too large to read in a log, and every failure
/// leaves them in a capsule.
impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("config", &self.config.to_json())
            .field("cu_seqlens_q", &self.layout.q.cu)
            .field("cu_seqlens_q_padded", &self.layout.q.padded)
            .field("tokens_q", &self.layout.q.tokens)
            .field("cu_seqlens_kv", &self.layout.kv.cu)
            .field("cu_seqlens_kv_padded", &self.layout.kv.padded)
            .field("tokens_kv", &self.layout.kv.tokens)
            .field("q", &self.q.dim())
            .field("k", &self.k.dim())
            .field("v", &self.v.dim())
            .field("d_o", &self.d_o.as_ref().map(|d| d.dim()))
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

/// One query row of a case with the keys it sees (`Case::visible_rows`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisibleRow {
    /// The slot, and the row within it (the indices dropout's mask is keyed by).
    pub slot: usize,
    pub row: usize,
    /// Query token (row of `q`, `d_o`, `o`, `lse`).
    pub token: usize,
    pub head: usize,
    /// The K/V head of `head`'s group.
    pub kv_head: usize,
    /// Key tokens (rows of `k`, `v`) the mask and window leave visible; may be empty.
    pub keys: Vec<usize>,
}

impl Case {
    /// The key tokens of `row`'s slot, visible or not: the range its dot products with the
    /// keys are formed over (`harness::row_dots`).
    pub fn slot_keys(&self, row: &VisibleRow) -> std::ops::Range<usize> {
        let first = self.layout.kv.offset(row.slot);
        first..first + self.layout.kv.len(row.slot)
    }

    /// The rows of [`Case::visible_rows`] whose `lse [Tq, H]` entry is finite (those with a
    /// visible key), each with that entry.
    pub fn live_rows<'a>(
        &'a self,
        lse: &'a Array2<f64>,
    ) -> impl Iterator<Item = (VisibleRow, f64)> + 'a {
        self.visible_rows().filter_map(move |r| {
            let l = lse[(r.token, r.head)];
            l.is_finite().then_some((r, l))
        })
    }

    /// `P = exp(scale · q·k + bias − lse)` of `row` and key token `key`, in f64.
    pub fn probability(&self, row: &VisibleRow, key: usize, lse: f64) -> f64 {
        (self.score(row, key) - lse).exp()
    }

    /// The score `scale · q·k + bias` of `row` and key token `key`, in f64.
    pub fn score(&self, row: &VisibleRow, key: usize) -> f64 {
        let q = self.q.slice(ndarray::s![row.token, row.head, ..]);
        let k = self.k.slice(ndarray::s![key, row.kv_head, ..]);
        dot64(q, k) * self.config.params.scale + self.bias_at(row, key)
    }

    /// The bias added to the score of `row` and key token `key` (`docs/semantics.md` §1.9;
    /// 0 without one).
    pub fn bias_at(&self, row: &VisibleRow, key: usize) -> f64 {
        let l = &self.layout;
        let (lq, lk) = (l.q.len(row.slot), l.kv.len(row.slot));
        let c = key - l.kv.offset(row.slot);
        self.config
            .params
            .bias
            .at(row.slot, row.head, row.row, c, lq, lk)
    }

    /// Dropout's factor of `row` and key token `key` (`docs/semantics.md` §1.8): `1/(1 − p)`
    /// where kept, 0 where dropped, 1 without dropout.
    pub fn dropout_factor(&self, row: &VisibleRow, key: usize) -> f64 {
        let p = &self.config.params;
        let c = key - self.layout.kv.offset(row.slot);
        p.dropout
            .factor(row.slot, p.num_heads, row.head, row.row, c)
    }

    /// Where `row`'s dS lands in dBias (`docs/semantics.md` §1.9), as the judges view dBias
    /// ([`dbias_rows`]): the row `b·Sq + r` and the head plane; `None` without a post-scale bias.
    pub fn dbias_row(&self, row: &VisibleRow) -> Option<(usize, usize)> {
        match &self.config.params.bias {
            smallseq_reference::AttnBias::PostScale(t) => {
                let (b, h) = smallseq_reference::AttnBias::tensor_index(t, row.slot, row.head);
                Some((b * t.dim().2 + row.row, h))
            }
            _ => None,
        }
    }

    /// `(token, head)` of every valid query row that sees no key (`docs/semantics.md` §1.3).
    pub fn no_key_rows(&self) -> Vec<(usize, usize)> {
        self.visible_rows()
            .filter(|r| r.keys.is_empty())
            .map(|r| (r.token, r.head))
            .collect()
    }

    /// Every valid query row of every slot and head, with its visible keys (mask and window of
    /// `docs/semantics.md` §1.5, less the keys a `-inf` bias hides, §1.9), in slot, head, row
    /// order.
    pub fn visible_rows(&self) -> impl Iterator<Item = VisibleRow> + '_ {
        let p = &self.config.params;
        let l = &self.layout;
        let g = p.group_size();
        (0..l.slots()).flat_map(move |slot| {
            let (lq, lk, oq, ok) = (
                l.q.len(slot),
                l.kv.len(slot),
                l.q.offset(slot),
                l.kv.offset(slot),
            );
            (0..p.num_heads).flat_map(move |head| {
                (0..lq).map(move |r| VisibleRow {
                    slot,
                    row: r,
                    token: oq + r,
                    head,
                    kv_head: head / g,
                    keys: (0..lk)
                        .filter(|&c| visible(p.mask, p.window, r, c, lq, lk))
                        .filter(|&c| p.bias.at(slot, head, r, c, lq, lk) != f64::NEG_INFINITY)
                        .map(|c| ok + c)
                        .collect(),
                })
            })
        })
    }

    /// Builds a case and validates config, layout and shapes together.
    ///
    /// # Errors
    /// The first inconsistency, naming the tensor or field.
    pub fn new(
        config: AttnConfig,
        layout: Layout,
        q: Array3<f32>,
        k: Array3<f32>,
        v: Array3<f32>,
        d_o: Option<Array3<f32>>,
    ) -> Result<Case> {
        let case = Case {
            config,
            layout,
            q,
            k,
            v,
            d_o,
            outputs: Outputs::default(),
            meta: BTreeMap::new(),
        };
        case.validate()?;
        Ok(case)
    }

    /// Re-checks every invariant (layout, shapes, BSHD uniformity, input dtype exactness).
    ///
    /// # Errors
    /// The first inconsistency, naming the tensor or field.
    pub fn validate(&self) -> Result<()> {
        self.validate_structure()?;
        let dt = self.config.dtype;
        if dt == Dtype::F32 {
            // Every f32 is a value of f32.
            return Ok(());
        }
        for (name, t) in self.inputs() {
            let bad = match t.as_slice() {
                Some(s) => first_unrepresentable(dt, s),
                None => t.iter().position(|x| !representable(dt, *x)),
            };
            if let Some(i) = bad {
                let x = t.iter().nth(i).copied().unwrap_or(f32::NAN);
                return Err(Error::Tensor {
                    tensor: name.into(),
                    detail: format!("element {i} = {x:e} is not representable in {dt}"),
                });
            }
        }
        // A post-scale bias holds values of the input dtype, as TE's does.
        if let smallseq_reference::AttnBias::PostScale(t) = &self.config.params.bias {
            if let Some((i, x)) = t.iter().enumerate().find(|(_, x)| !representable(dt, **x)) {
                return Err(Error::Tensor {
                    tensor: "bias".into(),
                    detail: format!("element {i} = {x:e} is not representable in {dt}"),
                });
            }
        }
        Ok(())
    }

    /// The invariants of [`Case::validate`] but the elements' exactness: what a case decoded
    /// from a case file needs checked, its elements having been read as values of its dtype.
    ///
    /// # Errors
    /// As [`Case::validate`].
    pub(crate) fn validate_structure(&self) -> Result<()> {
        let layout = Layout::new(self.layout.q.clone(), self.layout.kv.clone())?;
        debug_assert_eq!(layout, self.layout);
        self.config.check_bias_values(self.layout.slots())?;
        self.problem()?;
        if self.config.layout == LayoutKind::Bshd {
            bshd_seq_lens(&self.layout)?;
        }
        Ok(())
    }

    /// The inputs by name.
    pub fn inputs(&self) -> Vec<(&'static str, &Array3<f32>)> {
        let mut v = vec![("q", &self.q), ("k", &self.k), ("v", &self.v)];
        if let Some(d) = &self.d_o {
            v.push(("d_o", d));
        }
        v
    }

    /// The reference's view of this case.
    ///
    /// # Errors
    /// Shape or parameter mismatches.
    pub fn problem(&self) -> Result<Problem<'_>> {
        Ok(Problem::new(
            &self.config.params,
            &self.layout,
            self.q.view(),
            self.k.view(),
            self.v.view(),
            self.d_o.as_ref().map(ArrayView3::from),
        )?)
    }
}

/// Sequence lengths `(s_q, s_kv)` of a BSHD case: every slot holds exactly `s_q` queries and
/// `s_kv` keys, packed without gaps.
///
/// # Errors
/// [`Error::Tensor`] naming the slot whose length or offset differs.
pub fn bshd_seq_lens(layout: &Layout) -> Result<(usize, usize)> {
    let mut lens = [0usize; 2];
    for (n, (name, side)) in [("cu_seqlens_q", &layout.q), ("cu_seqlens_kv", &layout.kv)]
        .into_iter()
        .enumerate()
    {
        let s = if side.slots() == 0 { 0 } else { side.len(0) };
        lens[n] = s;
        for i in 0..side.slots() {
            if side.len(i) != s || side.span(i) != s || side.offset(i) != i * s {
                return Err(Error::Tensor {
                    tensor: name.into(),
                    detail: format!(
                        "layout bshd needs every slot to hold s = {s} tokens at offset {}; slot {i} has length {} at offset {}",
                        i * s,
                        side.len(i),
                        side.offset(i)
                    ),
                });
            }
        }
    }
    Ok((lens[0], lens[1]))
}

/// Whether `x` is a value of `dt`, NaN and infinities included (they are not checked). By
/// bits, since every case is validated on every launch: a rounding per element was 16 % of a
/// worker's time (bench/NOTES.md v8). A bf16 is an f32 whose low 16 bits are zero (the same
/// exponent range); an f16 is an f32 whose exponent lies in f16's range and whose mantissa
/// bits below f16's precision at that exponent are zero. The same as `dt.round(x) == x`
/// bitwise for every finite f32 (`representable_is_rounding_to_itself`).
#[inline]
fn representable(dt: Dtype, x: f32) -> bool {
    let b = x.to_bits();
    let exp = (b >> 23) & 0xff;
    if exp == 0xff {
        return true;
    }
    match dt {
        Dtype::F32 => true,
        Dtype::Bf16 => b & 0xffff == 0,
        Dtype::F16 => {
            let mant = b & 0x7f_ffff;
            if exp == 0 {
                // Zero, or an f32 subnormal (far below f16's smallest, 2^-24).
                return mant == 0;
            }
            let e = exp as i32 - 127;
            // Low mantissa bits below f16's quantum 2^max(e - 10, -24) must be zero.
            let dropped = match e {
                -14..=15 => 13,
                -24..=-15 => (-1 - e) as u32,
                _ => return false,
            };
            mant & ((1u32 << dropped) - 1) == 0
        }
    }
}

/// Elements per block of [`first_unrepresentable`]'s quick pass.
const BLOCK: usize = 512;

/// The index of the first element of `s` that is not a value of `dt`. A quick pass per
/// block, branch-free so that it vectorises, passes the elements that are plainly values
/// (bf16: low 16 bits zero; f16: a normal f16's exponent and low 13 bits zero; zeros, NaNs,
/// infinities); only a block with another element (an f16 subnormal, or a bad one) is
/// looked at element by element with [`representable`].
fn first_unrepresentable(dt: Dtype, s: &[f32]) -> Option<usize> {
    let quick_bad = |b: u32| -> u32 {
        let exp = (b >> 23) & 0xff;
        let special = u32::from(exp == 0xff) | u32::from(b << 1 == 0);
        let plain = match dt {
            Dtype::F32 => 1,
            Dtype::Bf16 => u32::from(b & 0xffff == 0),
            // f16 normals: unbiased exponents -14..=15, biased 113..=142.
            Dtype::F16 => u32::from(b & 0x1fff == 0) & u32::from(exp.wrapping_sub(113) < 30),
        };
        (special | plain) ^ 1
    };
    s.chunks(BLOCK).enumerate().find_map(|(n, block)| {
        let any_bad = block
            .iter()
            .fold(0u32, |acc, x| acc | quick_bad(x.to_bits()));
        if any_bad == 0 {
            return None;
        }
        block
            .iter()
            .position(|x| !representable(dt, *x))
            .map(|i| n * BLOCK + i)
    })
}

/// A BSHD layout of `batch` rows of `s_q` queries and `s_kv` keys, as THD offsets.
pub fn bshd_layout(batch: usize, s_q: usize, s_kv: usize) -> Layout {
    let side = |s: usize| Side {
        cu: (0..=batch).map(|i| (i * s) as i32).collect(),
        padded: None,
        tokens: batch * s,
    };
    Layout {
        q: side(s_q),
        kv: side(s_kv),
    }
}

/// `Σ a·b` of two f32 rows, in f64 (each product exact).
pub fn dot64(a: ndarray::ArrayView1<'_, f32>, b: ndarray::ArrayView1<'_, f32>) -> f64 {
    a.iter()
        .zip(b.iter())
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

/// Cases for unit tests.
#[cfg(test)]
pub(crate) mod samples {
    use super::Case;
    use crate::config::AttnConfig;
    use ndarray::Array3;
    use smallseq_reference::{Dtype, Layout, Mask};

    /// f32, one head of dimension 1, scale 1: one query `q` against two keys `k` with values
    /// `v`, and the output gradient `d_o`.
    pub(crate) fn one_query_two_keys(q: f32, k: [f32; 2], v: [f32; 2], d_o: f32) -> Case {
        let layout = Layout::packed(&[(1, 2)]);
        let mut cfg = AttnConfig::new(Dtype::F32, 1, 1, Mask::Padding);
        cfg.params.scale = 1.0;
        let a = |x: &[f32]| Array3::from_shape_vec((x.len(), 1, 1), x.to_vec()).unwrap();
        Case::new(cfg, layout, a(&[q]), a(&k), a(&v), Some(a(&[d_o]))).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::representable;
    use smallseq_reference::Dtype;

    /// The bit test agrees with rounding on every sign, exponent and top 10 mantissa bits,
    /// under low-bit patterns that straddle each dtype's precision
    /// (`representable_on_every_f32` sweeps all 2^32 patterns).
    #[test]
    fn representable_is_rounding_to_itself() {
        let lows = [
            0u32, 1, 0x0fff, 0x1000, 0x1fff, 0x0800, 0x2000, 0x4000, 0x8000, 0xffff, 0x1_0000,
        ];
        for top in 0u32..1 << 19 {
            for low in lows {
                let x = f32::from_bits((top << 13) ^ low);
                for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
                    let want = !x.is_finite() || dt.round(x).to_bits() == x.to_bits();
                    assert_eq!(representable(dt, x), want, "{dt} {:#010x}", x.to_bits());
                }
            }
        }
    }

    /// The block scan finds the first bad element wherever it lies, and passes f16
    /// subnormals, zeros, NaNs and infinities.
    #[test]
    fn the_block_scan_finds_the_first_bad_element() {
        use super::first_unrepresentable;
        let sub = f32::from_bits(0x3380_0000); // 2^-24, f16's smallest subnormal
        let mut s: Vec<f32> = (0..2000)
            .map(|i| ((i % 256) as f32 - 128.0) / 8.0)
            .collect();
        s.extend([0.0, -0.0, f32::NAN, f32::INFINITY, sub, 61440.0]);
        for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            assert_eq!(first_unrepresentable(dt, &s), None, "{dt}");
        }
        for at in [0, 511, 512, 1999, 2003] {
            let mut t = s.clone();
            t[at] = 1.0 + f32::EPSILON;
            t[at + 1] = 1.0 + f32::EPSILON;
            assert_eq!(first_unrepresentable(Dtype::F16, &t), Some(at));
            assert_eq!(first_unrepresentable(Dtype::Bf16, &t), Some(at));
            assert_eq!(first_unrepresentable(Dtype::F32, &t), None);
        }
    }

    /// Every f32 bit pattern: too slow for every `cargo test`
    /// (`cargo test --release --lib representable_on_every_f32 -- --ignored`).
    #[test]
    #[ignore]
    fn representable_on_every_f32() {
        for b in 0..=u32::MAX {
            let x = f32::from_bits(b);
            for dt in [Dtype::Bf16, Dtype::F16] {
                let want = !x.is_finite() || dt.round(x).to_bits() == x.to_bits();
                assert_eq!(representable(dt, x), want, "{dt} {b:#010x}");
            }
        }
    }
}
