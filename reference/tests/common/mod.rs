//! Shared case builder for the tests and the benchmark: a deterministic PRNG, random THD
//! geometries with pad-between tokens, tail slack and empty slots, and dtype-valued tensors.
#![allow(dead_code)]

use ndarray::{s, Array3};
use smallseq_reference::{AttnParams, Dropout, Dtype, Layout, Mask, Problem, Side, Window};

/// splitmix64: tiny, deterministic, good enough for test inputs.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.range(0, xs.len() - 1)]
    }
}

/// Everything that defines a case but the tensor values.
#[derive(Clone, Debug)]
pub struct Spec {
    /// `(Lq, Lk)` per slot.
    pub lens: Vec<(usize, usize)>,
    /// Pad-between tokens after each slot, `(q side, kv side)`; empty means none.
    pub pads: Vec<(usize, usize)>,
    /// Tail slack past `off[b]`, `(q side, kv side)`.
    pub tail: (usize, usize),
    pub heads: usize,
    pub kv_heads: usize,
    pub dqk: usize,
    pub dv: usize,
    pub mask: Mask,
    pub window: Window,
    pub scale: f64,
    pub dtype: Dtype,
    pub grads: bool,
    pub dropout: Dropout,
    pub bias: smallseq_reference::AttnBias,
}

impl Spec {
    /// Packed, no window, `scale = 1/sqrt(dqk)`, bf16, with gradients.
    pub fn packed(lens: &[(usize, usize)], heads: usize, kv_heads: usize, d: usize) -> Spec {
        Spec {
            lens: lens.to_vec(),
            pads: Vec::new(),
            tail: (0, 0),
            heads,
            kv_heads,
            dqk: d,
            dv: d,
            mask: Mask::NoMask,
            window: Window::NONE,
            scale: 1.0 / (d as f64).sqrt(),
            dtype: Dtype::Bf16,
            grads: true,
            dropout: Dropout::NONE,
            bias: smallseq_reference::AttnBias::None,
        }
    }

    /// A random small geometry: up to 4 slots (some empty), pads, tail slack, GQA/MQA,
    /// `Dqk != Dv`, any mask and window.
    pub fn random(rng: &mut Rng, max_len: usize, max_d: usize) -> Spec {
        let b = rng.range(0, 4);
        let lens = (0..b)
            .map(|_| {
                let empty = rng.range(0, 5);
                let lq = if empty == 0 { 0 } else { rng.range(1, max_len) };
                let lk = if empty == 1 { 0 } else { rng.range(1, max_len) };
                (lq, lk)
            })
            .collect();
        let pads = (0..b).map(|_| (rng.range(0, 2), rng.range(0, 2))).collect();
        let kv_heads = rng.range(1, 2);
        let heads = kv_heads * rng.pick(&[1, 2, 3]);
        let window = match rng.range(0, 3) {
            0 => Window::NONE,
            1 => Window {
                left: rng.range(0, 3) as i64,
                right: -1,
            },
            2 => Window {
                left: -1,
                right: rng.range(0, 3) as i64,
            },
            _ => Window {
                left: rng.range(0, 3) as i64,
                right: rng.range(0, 3) as i64,
            },
        };
        Spec {
            lens,
            pads,
            tail: (rng.range(0, 2), rng.range(0, 2)),
            heads,
            kv_heads,
            dqk: rng.range(1, max_d),
            dv: rng.range(1, max_d),
            mask: rng.pick(&Mask::ALL),
            window,
            scale: rng.pick(&[0.25, 0.5, 1.0, 0.3, 1.7]),
            dtype: rng.pick(&Dtype::ALL),
            grads: true,
            dropout: Dropout::NONE,
            bias: smallseq_reference::AttnBias::None,
        }
    }

    pub fn params(&self) -> AttnParams {
        AttnParams {
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim_qk: self.dqk,
            head_dim_v: self.dv,
            mask: self.mask,
            window: self.window,
            scale: self.scale,
            dropout: self.dropout,
            bias: self.bias.clone(),
        }
    }

    pub fn layout(&self) -> Layout {
        let side = |pick: fn(&(usize, usize)) -> usize, tail: usize| {
            let (mut cu, mut off) = (vec![0i32], vec![0i32]);
            for (i, l) in self.lens.iter().enumerate() {
                let pad = self.pads.get(i).map_or(0, pick);
                cu.push(cu.last().unwrap() + pick(l) as i32);
                off.push(off.last().unwrap() + (pick(l) + pad) as i32);
            }
            let tokens = *off.last().unwrap() as usize + tail;
            let padded = (!self.pads.is_empty()).then_some(off);
            Side { cu, padded, tokens }
        };
        Layout::new(side(|x| x.0, self.tail.0), side(|x| x.1, self.tail.1)).expect("valid layout")
    }
}

/// Owned inputs of one case.
#[derive(Clone, Debug)]
pub struct Case {
    pub params: AttnParams,
    pub layout: Layout,
    pub q: Array3<f32>,
    pub k: Array3<f32>,
    pub v: Array3<f32>,
    pub d_o: Option<Array3<f32>>,
    pub dtype: Dtype,
}

/// Fill value of don't-care rows in freshly built cases: any read of one shows up as NaN.
pub const DONT_CARE_FILL: f32 = f32::NAN;

impl Case {
    /// Valid rows hold dtype-rounded normals; don't-care rows hold [`DONT_CARE_FILL`].
    pub fn build(spec: &Spec, rng: &mut Rng) -> Case {
        let layout = spec.layout();
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        let mut gen = |shape: (usize, usize, usize)| {
            Array3::from_shape_simple_fn(shape, || spec.dtype.round_f64(rng.normal()))
        };
        let q = gen((tq, spec.heads, spec.dqk));
        let k = gen((tk, spec.kv_heads, spec.dqk));
        let v = gen((tk, spec.kv_heads, spec.dv));
        let d_o = spec.grads.then(|| gen((tq, spec.heads, spec.dv)));
        let mut case = Case {
            params: spec.params(),
            layout,
            q,
            k,
            v,
            d_o,
            dtype: spec.dtype,
        };
        case.fill_dont_care(DONT_CARE_FILL);
        case
    }

    pub fn problem(&self) -> Problem<'_> {
        Problem::new(
            &self.params,
            &self.layout,
            self.q.view(),
            self.k.view(),
            self.v.view(),
            self.d_o.as_ref().map(|d| d.view()),
        )
        .expect("valid problem")
    }

    /// Writes `x` into every don't-care token of q, k, v and d_o.
    pub fn fill_dont_care(&mut self, x: f32) {
        let (vq, vk) = (self.layout.q.valid_tokens(), self.layout.kv.valid_tokens());
        let fill = |a: &mut Array3<f32>, valid: &[bool]| {
            for (t, &ok) in valid.iter().enumerate() {
                if !ok {
                    a.slice_mut(s![t, .., ..]).fill(x);
                }
            }
        };
        fill(&mut self.q, &vq);
        fill(&mut self.k, &vk);
        fill(&mut self.v, &vk);
        if let Some(d) = self.d_o.as_mut() {
            fill(d, &vq);
        }
    }

    /// f64 copies of q, k, v, d_o (exact).
    pub fn to_f64(&self) -> [Array3<f64>; 4] {
        let up = |a: &Array3<f32>| a.mapv(f64::from);
        [
            up(&self.q),
            up(&self.k),
            up(&self.v),
            self.d_o
                .as_ref()
                .map_or_else(|| Array3::zeros((0, 0, 0)), up),
        ]
    }

    /// Number of don't-care tokens (q side, kv side).
    pub fn dont_care_tokens(&self) -> (usize, usize) {
        let n = |v: Vec<bool>| v.iter().filter(|&&x| !x).count();
        (
            n(self.layout.q.valid_tokens()),
            n(self.layout.kv.valid_tokens()),
        )
    }
}

/// The standard benchmark case: 16 slots, `Lq`, `Lk` uniform in `1..=17`, `H = Hkv = 16`,
/// `D = 128`, bf16, with `d_o`.
pub fn standard_case(rng: &mut Rng) -> Case {
    let lens: Vec<_> = (0..16)
        .map(|_| (rng.range(1, 17), rng.range(1, 17)))
        .collect();
    Case::build(&Spec::packed(&lens, 16, 16, 128), rng)
}

/// `max |a - b| / max(max |b|, floor)` over two same-shape arrays; non-finite entries must
/// agree exactly (both `-inf`, say), else the error is infinite.
pub fn rel_err<D: ndarray::Dimension>(
    a: ndarray::ArrayView<f64, D>,
    b: ndarray::ArrayView<f64, D>,
    floor: f64,
) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let mut norm = floor;
    let mut err = 0.0f64;
    for (&x, &y) in a.iter().zip(b.iter()) {
        if !x.is_finite() || !y.is_finite() {
            if x != y {
                return f64::INFINITY;
            }
            continue;
        }
        norm = norm.max(y.abs());
        err = err.max((x - y).abs());
    }
    err / norm
}

/// Bitwise equality of two f64 or f32 arrays (NaN-aware, sign-of-zero-aware).
pub fn same_bits<A: Copy + Into<f64>, D: ndarray::Dimension>(
    a: ndarray::ArrayView<A, D>,
    b: ndarray::ArrayView<A, D>,
) -> bool {
    a.shape() == b.shape()
        && a.iter()
            .zip(b.iter())
            .all(|(&x, &y)| x.into().to_bits() == y.into().to_bits())
}

/// A post-scale bias for `spec`: `[b or 1, H or 1, max Lq + 1, max Lk]` (one spare row, which
/// no slot reads) of normal values in the dtype, about one entry in `1/inf_every` at `-inf`
/// (never, for 0), and `+inf` in the spare row (unread: ignored).
pub fn post_scale_bias(
    rng: &mut Rng,
    spec: &Spec,
    per_slot: bool,
    per_head: bool,
    inf_every: usize,
) -> smallseq_reference::AttnBias {
    let sq = spec.lens.iter().map(|l| l.0).max().unwrap_or(0);
    let sk = spec.lens.iter().map(|l| l.1).max().unwrap_or(0);
    let bb = if per_slot { spec.lens.len().max(1) } else { 1 };
    let hb = if per_head { spec.heads } else { 1 };
    let mut t = ndarray::Array4::from_shape_simple_fn((bb, hb, sq + 1, sk), || {
        if inf_every > 0 && rng.range(0, inf_every) == 0 {
            f32::NEG_INFINITY
        } else {
            spec.dtype.round_f64(rng.normal())
        }
    });
    t.slice_mut(ndarray::s![.., .., sq, ..]).fill(f32::INFINITY);
    smallseq_reference::AttnBias::PostScale(std::sync::Arc::new(t))
}

/// ALiBi with FlashAttention's test draw of slopes (`rand · 0.3`) for `spec`'s heads.
pub fn alibi(rng: &mut Rng, spec: &Spec) -> smallseq_reference::AttnBias {
    let s = (0..spec.heads)
        .map(|_| (rng.uniform() * 0.3) as f32)
        .collect();
    smallseq_reference::AttnBias::Alibi(std::sync::Arc::new(s))
}
