//! Per-element rounding allowances of the gradients dQ and dK.
//!
//! dS = P·(dP − D) cancels where dP ≈ D, and there the f32 roundings of its terms (dP = dO·Vᵀ
//! and D = Σ P·dP) move dS by far more than `u · |dS|`. Two correct kernels
//! that sum in different orders then differ by many ulps of dQ or dK, and the emulation's own
//! error is one draw of that noise: a threshold from it alone failed a correct kernel by a
//! margin of 1.11 (f32 dQ on an H200, `proptests/tests/backends.proptest-regressions`).
//!
//! The allowance is a first-order forward-error bound of those intermediates. With
//! `a_ij = Σ_y |dO_iy·V_jy|` (the magnitude dP_ij's rounding scales with) and
//! `A_i = Σ_j P_ij·a_ij` (D_i's),
//!
//! ```text
//! cond(dQ[i, h, x]) = scale · Σ_j |K[j, x]| · P_ij · (a_ij + A_i)
//! cond(dK[j, g, x]) = scale · Σ_(i, h in group g) |Q[i, h, x]| · P_ij · (a_ij + A_i)
//! allowance        = 2 · (Dv + Lk) · u32 · cond
//! ```
//!
//! where `Lk` is the longest key side (the length of the sums feeding D and dS) and `u32` the
//! unit roundoff of f32, the precision every kernel computes P and dS in. Where dS does not
//! cancel, `cond ≈ |dQ|` and the allowance is a few hundred f32 ulps: far below the bf16/f16
//! noise floor, so it loosens nothing there.
//!
//! P itself carries the roundings of its exponent: `P = exp(S − lse)` with S and lse in f32 is
//! off by a relative `u32·(|S| + |lse|)` at least, and S's own sum by `u32·scale·Σ|q·k|` per
//! term, so each row's terms above are widened by `S_i = max_j scale·Σ_x |Q_ix·K_jx| + |lse_i|`:
//! `allowance = 2 · (Dv + Lk + S_i) · u32 · cond`. With logits of order one this adds a few
//! percent; with logits of order 1e5 (large values, scale 3) P is off by about 1 % in every
//! kernel, and a dK that cancels down to near the f16 limit moved by 8 % between two correct
//! paths (CPU fuzz seed 2043, cases 1564 and 1632, near-tied keys of large data).
//!
//! At 16 bits the kernels round dS to the input type before dS·K and dSᵀ·Q. Where dS lies
//! within its f32 noise `δ_ij = 2 · (Dv + Lk + S_i) · u32 · P_ij · (a_ij + A_i)` of a rounding
//! boundary, which neighbour it takes is noise too, a jump `J_ij` (the type's spacing there), so
//! `allowance(dQ[i, h, x]) += scale · Σ_j J_ij · |K[j, x]|` and likewise dK with |Q|.

use super::envelope_weights::{ds_rounded_to, envelope_ds_weight, p_rounded_to};
use super::ftz::{ftz_allowance, FtzAllowance};
use super::row_dots::{dots, dots_and_magnitudes, Columns};
use crate::case::Case;
use ndarray::{s, Array2, Array3};
use smallseq_reference::Dtype;

/// How far an f32 P in the subnormal range may lie from its value: a spacing (2^-149) for exp's
/// rounding and one for the division by Z. A bf16 fallback dK row of 1.5e-38, 22 spacings from
/// the reference on the H200 and the CPU alike (fuzz seed 3306, case 90561), had P there.
const P_SUBNORMAL_ERR: f64 = 2.0 * 1.401298464324817e-45;

/// `|a|` in f64, in standard layout (what [`row_of`] and [`row_mut`] read).
fn abs64(a: &Array3<f32>) -> Array3<f64> {
    let values: Vec<f64> = a.iter().map(|x| f64::from(*x).abs()).collect();
    Array3::from_shape_vec(a.dim(), values).expect("one value per element, in logical order")
}

/// Row `(i, j)` of an array in standard layout (every array the allowances build), as a slice.
fn row_of(a: &Array3<f64>, i: usize, j: usize) -> &[f64] {
    let (_, n1, n2) = a.dim();
    let start = (i * n1 + j) * n2;
    &a.as_slice().expect("built in standard layout")[start..start + n2]
}

/// [`row_of`], mutable.
fn row_mut(a: &mut Array3<f64>, i: usize, j: usize) -> &mut [f64] {
    let (_, n1, n2) = a.dim();
    let start = (i * n1 + j) * n2;
    &mut a.as_slice_mut().expect("built in standard layout")[start..start + n2]
}

/// Allowances of `dq [Tq, H, Dqk]` and `dk [Tk, Hkv, Dqk]`, in the tensors' units.
#[derive(Clone, Debug)]
pub struct GradAllowance {
    pub dq: Array3<f64>,
    pub dk: Array3<f64>,
    /// dBias's, as [`crate::case::dbias_rows`] lays it out: the sum of its dS terms' noise.
    pub dbias: Option<Array3<f64>>,
}

impl GradAllowance {
    /// The allowance of a comparison between two outputs that each carry this noise (two
    /// kernels, or a kernel and a sum of another's outputs): twice as wide.
    pub fn between_two_outputs(&self) -> GradAllowance {
        GradAllowance {
            dq: &self.dq * 2.0,
            dk: &self.dk * 2.0,
            dbias: self.dbias.as_ref().map(|d| d * 2.0),
        }
    }
}

/// Per-element allowances of the per-row rule for a correct implementation that rounds in
/// another order, or rounds its intermediates (P, dS, D) to the input type at other points,
/// than the emulation (docs/judgement.md §2, "Another order"). The emulation's error on a row
/// is one draw of that noise; where a row's terms cancel, it is no yardstick for another draw.
/// With `u` the input type's unit roundoff, `u32` f32's, `S_i` row i's exponent magnitude (as
/// for [`GradAllowance`]), `Lk` the longest key side and `Nq` the longest query side times the
/// group size (the terms a dK/dV element sums):
///
/// ```text
/// o [i, h, d]  = 2 · (u + (Lk + S_i)·u32) · Σ_j P_ij·|V_jd|
/// dv[j, g, d]  = 2 · Σ_(i, h in g) (u + (Nq + S_i)·u32) · P_ij·|dO_id|
/// W_ij         = |dS_ij| + P_ij · (|dP_ij| + |D_i| + Σ_d |dO_id|·|O_id|)
/// dq[i, h, x]  = 2 · (u + Lk·u32) · scale · Σ_j W_ij·|K_jx|
/// dk[j, g, x]  = 2 · (u + Nq·u32) · scale · Σ_(i, h in g) W_ij·|Q_ix|
/// ```
///
/// For the envelope, `S_i` of o and dv counts the score's sum `Dqk` times
/// (`S_i + (Dqk − 1) · max_j scale·Σ|q·k|`): a GEMM sums a score's Dqk products in an order
/// of up to that many rounding levels, where smallseq's kernels and emulation sum in one order
/// (PyTorch's math path in f32: a dV row 1.4 to 2 times past the one-level bound at D = 128,
/// H100 and CPU alike, and 3.6 times past `⌈log2 Dqk⌉` levels at D = 256).
///
/// That `W` is the envelope of the common designs ([`Design::Envelope`]). The project's own
/// kernels ([`Design::Project`]) keep dP and D in f32 with `D = Σ_j P·dP`, so of `W` only
/// dS's rounding remains, `W_ij = |dS_ij|`: with the envelope's terms a dQ row whose terms
/// cancel got an allowance above its own values, and a zeroed row passed (issue 38). With D
/// from the stored O ([`Design::ProjectDFromO`]) D carries O's rounding to the input type:
/// `W_ij = |dS_ij| + P_ij · Σ_d |dO_id|·|O_id|`.
#[derive(Clone, Debug)]
pub struct OrderAllowance {
    pub o: Array3<f64>,
    pub dq: Option<Array3<f64>>,
    pub dk: Option<Array3<f64>>,
    pub dv: Option<Array3<f64>>,
    /// dBias `= Σ dS`: `2 · (u + Nq·u32) · Σ W_ij / scale`, laid out as [`GradAllowance::dbias`].
    pub dbias: Option<Array3<f64>>,
    /// Whether the tensor rule takes the allowance off each element's error too: for an
    /// undeclared design ([`Design::Envelope`]), whose rounding points the emulation does not
    /// follow, so its error is no yardstick of the implementation's (a correct FlashAttention-2
    /// design, `adapters/design_model.py`, recomputes P from the stored LSE with exponents of
    /// 10⁵ and lands 12 f16 units of P from an emulation that is exact there).
    pub in_tensor_rule: bool,
    /// The same for dQ and dK alone: set for a backward that takes D from the stored O
    /// ([`crate::harness::props::Yardstick::for_backward`]), where which way each element of
    /// O rounded moves D and no emulation can follow it (the implementation's O is not the
    /// emulation's); the allowance's `P_ij · Σ_d |dO_id|·|O_id|` term is that rounding.
    pub grads_in_tensor_rule: bool,
    /// The share of the arrays above that flush-to-zero of f32 intermediates can lose
    /// ([`super::ftz`]): the envelope's only, and `None` where no value of the case can flush.
    pub ftz: Option<FtzAllowance>,
}

impl OrderAllowance {
    /// The allowance of a comparison between two runs that may each round in their own order
    /// ([`GradAllowance::between_two_outputs`]'s twin): twice as wide. The flush-to-zero share
    /// is left out: only numeric_agreement's wording reads it.
    pub fn between_two_outputs(&self) -> OrderAllowance {
        let twice = |a: &Array3<f64>| a * 2.0;
        OrderAllowance {
            o: twice(&self.o),
            dq: self.dq.as_ref().map(twice),
            dk: self.dk.as_ref().map(twice),
            dv: self.dv.as_ref().map(twice),
            dbias: self.dbias.as_ref().map(twice),
            in_tensor_rule: self.in_tensor_rule,
            grads_in_tensor_rule: self.grads_in_tensor_rule,
            ftz: None,
        }
    }
}

/// The metadata key of the [`Design`] a capsule's outputs were judged under.
pub const DESIGN_KEY: &str = "smallseq.design";

pub use crate::design::Design;

impl Design {
    /// The design a case file's outputs were judged under: the one its capsule records
    /// ([`DESIGN_KEY`]), else that of the backend that produced them, else the envelope.
    pub fn of_case(case: &Case) -> Design {
        let recorded = case.meta.get(DESIGN_KEY);
        recorded.and_then(|r| r.parse().ok()).unwrap_or_else(|| {
            case.meta
                .get("smallseq.backend")
                .map_or(Design::Envelope, |b| Design::of_backend(b))
        })
    }
}

/// Per-element noise of `o` and `dv` from P's roundings to the input type, where f32 noise of
/// P (its exponent's, and the score sums', as for [`GradAllowance`]: a relative
/// `ρ_i = 2 · (Lk + S_i) · u32`) can decide them. Each P whose interval `P · (1 ± ρ_i)` holds a
/// rounding boundary of the input type may round to either side, a jump `J_ij` (the spacing
/// there); beside it P moves continuously by `ρ_i · P_ij`:
///
/// ```text
/// o [i, h, d]  = Σ_j (J_ij + ρ_i · P_ij) · |V_jd|
/// dv[j, g, d]  = Σ_(i, h in g) (J_ij + ρ_i · P_ij) · |dO_id|
/// ```
///
/// Where this exceeds half an ulp of the output, which value the output rounds to is decided by
/// noise every correct kernel carries, not by the kernel's own roundings, so conformance and the
/// bias test leave the element out; so do they where the emulation's value before rounding lies
/// within the noise of a rounding boundary ([`noise_decides`]). Over generated
/// standard-normal f16/bf16 cases the half-ulp test leaves out 6.4 % of o's elements and the
/// whole rule 20 %: the jump needs a P within `ρ ≈ 3e-6` of a boundary, and moves an output by
/// one P's ulp, which is often enough to reach the output's own boundary.
/// Two near-tied keys of large logits (`S_i` in the thousands,
/// `ρ ≈ 1e-4`, both P near 1/2, `O = (V_1 + V_2) / 2` cancelling) leave most of them out: an H200
/// campaign failed 48 cases of that class on conformance and 10 on bias (`bench/NOTES.md` v11).
#[derive(Clone, Debug)]
pub struct PNoise {
    pub o: Array3<f64>,
    pub dv: Option<Array3<f64>>,
}

/// Whether noise `noise` decides the rounding of an output whose emulated value is `y` (and
/// `acc` before its rounding, where known) in `dtype`: `acc ± noise`
/// round to different values (a boundary lies within the noise: at an exact midpoint any
/// noise decides), or without `acc` the noise exceeds half an ulp at `y`. NaN on either
/// side is no proof that the noise is small.
pub fn noise_decides(noise: f64, acc: Option<f64>, y: f64, dtype: Dtype) -> bool {
    let above_half_ulp = !matches!(
        noise.partial_cmp(&(dtype.unit_roundoff() * y.abs())),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    );
    match acc {
        Some(a) if a.is_finite() && noise.is_finite() => {
            above_half_ulp || dtype.round_f64(a - noise) != dtype.round_f64(a + noise)
        }
        _ => above_half_ulp,
    }
}

/// The distance between the input type's roundings of `lo` and `hi` (0 when both round alike),
/// each saturated at the type's limit, as the kernels saturate what they round.
fn rounding_jump(dtype: Dtype, lo: f64, hi: f64) -> f64 {
    let max = f64::from(dtype.max_finite());
    let r = |x: f64| f64::from(dtype.round_f64(x)).clamp(-max, max);
    let j = (r(hi) - r(lo)).abs();
    if j.is_finite() {
        j
    } else {
        0.0
    }
}

/// The jump and drift of one P: `J + ρ·P`, with `J` the distance between the input type's
/// roundings of `P·(1 − ρ)` and `P·(1 + ρ)` (0 when both round alike).
fn p_noise(dtype: Dtype, p: f64, rho: f64) -> f64 {
    rounding_jump(dtype, p * (1.0 - rho), p * (1.0 + rho)) + rho * p
}

/// The jump of dS's rounding to a 16-bit input type (the small-seq kernels, the tiled fallback
/// and the emulation round it before dS·K and dSᵀ·Q) where its f32 noise `delta` can decide
/// it: which neighbour a dS within `delta` of a rounding boundary takes is noise, and it moves
/// every dQ and dK element the pair feeds by one ulp of dS times |K| or |Q|. Two tied keys put
/// both dS of a row on boundaries at once (dS = ±(dP₁ − dP₂)/4): an H200 campaign (seed 2097,
/// case 43630) had the small-seq dQ one bf16 ulp of dS = 5.484375 (a midpoint) from a zero
/// that the emulation's symmetric roundings kept, at 18 times the threshold.
fn ds_jump(dtype: Dtype, ds: f64, delta: f64) -> f64 {
    if dtype == Dtype::F32 {
        return 0.0; // nothing rounds dS
    }
    rounding_jump(dtype, ds - delta, ds + delta)
}

/// The relative error of the exp that forms P which the envelope allows where the inputs are
/// 16-bit. PyTorch's CPU flash kernel evaluates P of a bf16 or f16 case with its vectorised
/// `fexp_u20`, an exp "intended for outputs downcast to FP16 / BF16": its exp(0) is
/// 1 − 5.3e-5, and its worst error over [−12, 0] measured 1.2e-4 (2^-13.1; torch 2.11 on
/// this project's x86-64 development machine). The LSE it stores is off by up to that much
/// (with O exact: the 16-bit P hides it). 2^-12 stays under half f16's unit roundoff, so a
/// backward that recomputes P from such an LSE loses nothing a 16-bit P holds. f32 cases get
/// none: that kernel's f32 path takes an exact exp.
pub const ENVELOPE_EXP16_RELATIVE: f64 = 1.0 / 4096.0;

/// The error of LSE that [`ENVELOPE_EXP16_RELATIVE`] allows under `design`: an exp whose
/// relative error is ε moves LSE = log Σ P by at most ε. Zero where no such exp is allowed.
pub fn lse_exp_error(case: &Case, design: Design) -> f64 {
    match design {
        Design::Envelope if case.config.dtype != Dtype::F32 => ENVELOPE_EXP16_RELATIVE,
        _ => 0.0,
    }
}

/// All allowances of a case, computed in one pass over its visible (query, key) pairs.
#[derive(Clone, Debug)]
pub struct Allowances {
    /// The f32 noise of dS's terms where it cancels (tensor and row rule, and conformance).
    pub grads: Option<GradAllowance>,
    /// Another order's noise (the row rule only).
    pub order: OrderAllowance,
    /// P's rounding noise in `o` and `dv` (conformance and bias).
    pub p_noise: PNoise,
}

/// The rounding levels of a score's own sum in another order ([`OrderAllowance`]): `Dqk`
/// for the envelope, the bound of any order (an f32 GEMM may chain a score's products through
/// one accumulator: PyTorch's math path at D = 256 put a score 28 units off, seed 71 group
/// 61; tensor cores' f32 accumulation does not round to nearest within a block), one for the
/// project's designs, which sum in the emulation's order. LSE's noise floor takes them too
/// (the yardstick's `lse_magnitude`).
pub fn score_sum_levels(case: &Case, design: Design) -> f64 {
    match design {
        Design::Envelope => case.config.params.head_dim_qk.max(1) as f64,
        Design::Project | Design::ProjectDFromO => 1.0,
    }
}

/// The allowances of a case from its inputs and the f64 reference's `o` (`[Tq, H, Dv]`) and
/// LSE (`[Tq, H]`); the gradients' only for a forward+backward case. The order allowance of
/// dq and dk is that of `design`.
pub fn allowances(case: &Case, o: &Array3<f64>, lse: &Array2<f64>, design: Design) -> Allowances {
    let p = &case.config.params;
    let u = case.config.dtype.unit_roundoff();
    let u32 = Dtype::F32.unit_roundoff();
    let longest_kv = case.layout.kv.max_len();
    let lk = longest_kv as f64;
    let nq = (case.layout.q.max_len() * p.group_size()) as f64;
    let terms = (p.head_dim_v + longest_kv) as f64;
    let factor = 2.0 * terms * u32;
    let scale = p.scale.abs();
    let score_sums = score_sum_levels(case, design);
    let mut ord_o = Array3::<f64>::zeros(o.dim());
    let mut noise_o = Array3::<f64>::zeros(o.dim());
    let d_o = case.d_o.as_ref();
    let mut noise_dv = d_o.map(|_| Array3::<f64>::zeros(case.v.dim()));
    // dq, dk (f32 noise of dS), then another order's dq, dk, dv.
    let mut g = d_o.map(|_| {
        (
            Array3::<f64>::zeros(case.q.dim()),
            Array3::<f64>::zeros(case.k.dim()),
            Array3::<f64>::zeros(case.q.dim()),
            Array3::<f64>::zeros(case.k.dim()),
            Array3::<f64>::zeros(case.v.dim()),
        )
    });
    // dBias's allowances, `[Bb·Sq, Hb, Sk]` (crate::case::dbias_rows).
    let dbias_dim = p.bias.grad_shape().map(|[b, h, q, k]| (b * q, h, k));
    let mut db = d_o
        .and(dbias_dim)
        .map(|dim| (Array3::<f64>::zeros(dim), Array3::<f64>::zeros(dim)));
    // The inputs' magnitudes in f64, once per case, in rows the loops below walk as slices
    // (which vectorise): converting per (query, key) pair was most of the allowances' time.
    let (qa, ka, va) = (abs64(&case.q), abs64(&case.k), abs64(&case.v));
    let doa = d_o.map(abs64);
    // Keys and values transposed per kv head: a row's dot products with every key of its slot
    // run side by side (the same sums, row_dots.rs).
    let ka_cols = Columns::of(&case.k, |x| f64::from(x).abs());
    let k_cols = Columns::of(&case.k, f64::from);
    let v_cols = d_o.map(|_| Columns::of(&case.v, f64::from));
    let (mut mags, mut qk, mut dps, mut dp_mags) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // P as another order's allowances weigh it: the envelope's designs may round it to 16 bits.
    let envelope_p = |prob: f64| match design {
        Design::Envelope => p_rounded_to(case.config.dtype, prob),
        Design::Project | Design::ProjectDFromO => prob,
    };
    for (row, lse_r) in case.live_rows(lse) {
        let (t, h, hk) = (row.token, row.head, row.kv_head);
        let first_key = case.layout.kv.offset(row.slot);
        let slot_keys = first_key..first_key + case.layout.kv.len(row.slot);
        let qa_r = row_of(&qa, t, h);
        dots(qa_r, &ka_cols, hk, slot_keys.clone(), -0.0, &mut mags);
        let score_mag = row
            .keys
            .iter()
            .map(|&c| scale * mags[c - first_key])
            .fold(0.0f64, f64::max);
        // A bias's own magnitude is part of the score its f32 rounding scales with.
        let bias_mag = row
            .keys
            .iter()
            .map(|&c| case.bias_at(&row, c).abs())
            .fold(0.0f64, f64::max);
        let s_i = score_mag + bias_mag + lse_r.abs();
        // Another order's O and dV: the score sums' rounding levels of the design. P's own
        // noise (`rho`, which decides roundings) keeps one level: it is the emulation's.
        let s_order = s_i + (score_sums - 1.0) * score_mag;
        // P as `Case::probability` forms it.
        let q_r: Vec<f64> = case
            .q
            .slice(s![t, h, ..])
            .iter()
            .map(|&x| x.into())
            .collect();
        dots(&q_r, &k_cols, hk, slot_keys.clone(), -0.0, &mut qk);
        let probs: Vec<f64> = row
            .keys
            .iter()
            .map(|&c| (qk[c - first_key] * p.scale + case.bias_at(&row, c) - lse_r).exp())
            .collect();
        // Dropout's factors: O and dV take P·Z, dP is Z times the product (1 without dropout).
        let zs: Vec<f64> = row
            .keys
            .iter()
            .map(|&c| case.dropout_factor(&row, c))
            .collect();
        let w_o = 2.0 * (u + (lk + s_order) * u32);
        let rho = 2.0 * (lk + s_i) * u32;
        let p_noises: Vec<f64> = probs
            .iter()
            .map(|&pr| p_noise(case.config.dtype, pr, rho))
            .collect();
        for (((&c, &prob), &pn), &z) in row.keys.iter().zip(&probs).zip(&p_noises).zip(&zs) {
            let p_ord = z * envelope_p(prob);
            let pn = pn * z;
            let va_c = row_of(&va, c, hk);
            let noise_r = row_mut(&mut noise_o, t, h);
            for (n, v) in noise_r.iter_mut().zip(va_c) {
                *n += pn * v;
            }
            for (x, v) in row_mut(&mut ord_o, t, h).iter_mut().zip(va_c) {
                *x += w_o * p_ord * v;
            }
            if let (Some(doa), Some(ndv)) = (doa.as_ref(), noise_dv.as_mut()) {
                for (n, y) in row_mut(ndv, c, hk).iter_mut().zip(row_of(doa, t, h)) {
                    *n += pn * y;
                }
            }
        }
        let (Some(d_o), Some(doa), Some(v_cols), Some((dq, dk, odq, odk, odv))) =
            (d_o, doa.as_ref(), v_cols.as_ref(), g.as_mut())
        else {
            continue;
        };
        let doa_r = row_of(doa, t, h);
        let d_o_r = d_o.slice(s![t, h, ..]);
        // (dP_ij, a_ij) of the row's visible keys: `Σ dO·V` and `Σ |dO·V|`.
        let d_o64: Vec<f64> = d_o_r.iter().map(|&x| x.into()).collect();
        dots_and_magnitudes(&d_o64, v_cols, hk, slot_keys, &mut dps, &mut dp_mags);
        let dpa: Vec<(f64, f64)> = row
            .keys
            .iter()
            .zip(&zs)
            .map(|(&c, &z)| (z * dps[c - first_key], z * dp_mags[c - first_key]))
            .collect();
        let big_a: f64 = probs.iter().zip(&dpa).map(|(pr, (_, a))| pr * a).sum();
        let big_d: f64 = probs.iter().zip(&dpa).map(|(pr, (dp, _))| pr * dp).sum();
        // D formed from the stored output (Σ dO·O) is off by its rounding.
        let d_from_o: f64 = d_o_r
            .iter()
            .zip(o.slice(s![t, h, ..]))
            .map(|(x, y)| (f64::from(*x) * y).abs())
            .sum();
        // The envelope's stored O is off by its own computation too, not only by its rounding
        // (in units of `u`, as `d_from_o`): where O's terms cancel, a design that rounds P to
        // 16 bits before P·V leaves O far from `u·|O|` (SDPA flash, bf16: O = −3e-8 stored as
        // 1.9e-6 beside a key of V = 162; D from it moved a dQ row by 15 %, seed 71 group 58).
        // Half of O's order allowance is one computation's error; it stands in for |O| where
        // it is the larger (O cancels), and leaves the D term as it was elsewhere: the sum of
        // both let a dQ element with its sign flipped pass beside an f16 dS past the range
        // (`a_value_past_the_range_the_emulation_does_not_share_is_a_defect`).
        // Only the envelope's weight takes it.
        let d_from_computed_o: f64 = match design {
            Design::Envelope => d_o_r
                .iter()
                .zip(o.slice(s![t, h, ..]))
                .zip(row_of(&ord_o, t, h))
                .map(|((x, y), e)| f64::from(*x).abs() * y.abs().max(e / (2.0 * u)))
                .sum(),
            Design::Project | Design::ProjectDFromO => 0.0,
        };
        let widen = 1.0 + s_i / terms;
        let w_dv = 2.0 * (u + (nq + s_order) * u32);
        for (((&c, &prob), &(dp, a)), &z) in row.keys.iter().zip(&probs).zip(&dpa).zip(&zs) {
            // P in f32's subnormal range is off by its absolute spacing, not by a relative
            // amount: exp's rounding and the division by Z, a spacing each.
            let noise = (widen * prob + P_SUBNORMAL_ERR / factor) * (a + big_a);
            let ds = prob * (dp - big_d);
            // dq and dk are multiplied by `factor` below: the jump (already in gradient units)
            // is divided by it here.
            // dS's own noise and its order allowance; dQ and dK take them times the scale,
            // dBias (the sum of dS) as they are.
            let w_ds = noise + ds_jump(case.config.dtype, ds, factor * noise) / factor;
            let w = scale * w_ds;
            // The envelope's weight of this dS, with P's rounding past its relative one (below
            // the smallest normal), which moves dS by that much times dP − D.
            let w_envelope = || {
                envelope_ds_weight(ds, prob, dp, big_d, d_from_computed_o)
                    + (envelope_p(prob) - prob) * (dp - big_d).abs()
                    + (ds_rounded_to(case.config.dtype, ds, p.scale) - ds.abs())
            };
            let w_ord = match design {
                Design::Project => scale * ds.abs(),
                // D from the stored O is off by O's rounding: the D term of the envelope.
                Design::ProjectDFromO => scale * (ds.abs() + prob * d_from_o),
                Design::Envelope => scale * w_envelope(),
            };
            if let (Some((dbn, dbo)), Some((at, hb))) = (db.as_mut(), case.dbias_row(&row)) {
                let col = c - case.layout.kv.offset(row.slot);
                dbn[(at, hb, col)] += w_ds;
                dbo[(at, hb, col)] += match design {
                    Design::Project => ds.abs(),
                    Design::ProjectDFromO => ds.abs() + prob * d_from_o,
                    Design::Envelope => w_envelope(),
                };
            }
            let ka_c = row_of(&ka, c, hk);
            for (x, (dq_x, odq_x)) in ka_c.iter().zip(
                row_mut(dq, t, h)
                    .iter_mut()
                    .zip(row_mut(odq, t, h).iter_mut()),
            ) {
                *dq_x += w * x;
                *odq_x += w_ord * x;
            }
            for (x, (dk_x, odk_x)) in qa_r.iter().zip(
                row_mut(dk, c, hk)
                    .iter_mut()
                    .zip(row_mut(odk, c, hk).iter_mut()),
            ) {
                *dk_x += w * x;
                *odk_x += w_ord * x;
            }
            for (x, y) in row_mut(odv, c, hk).iter_mut().zip(doa_r) {
                *x += w_dv * envelope_p(prob) * z * y;
            }
        }
    }
    let p_noise = PNoise {
        o: noise_o,
        dv: noise_dv,
    };
    // Fast-math builds flush what the project's kernels keep as subnormals: the envelope's
    // designs include them, the project's design does not.
    let ftz = match design {
        Design::Project | Design::ProjectDFromO => None,
        Design::Envelope => ftz_allowance(case, o, lse),
    };
    let with_ftz = |mut a: Array3<f64>, name: &str| {
        if let Some(f) = ftz.as_ref().and_then(|f| f.of(name)) {
            a += f;
        }
        a
    };
    match g {
        None => Allowances {
            p_noise,
            grads: None,
            order: OrderAllowance {
                o: with_ftz(ord_o, "o"),
                dq: None,
                dk: None,
                dv: None,
                dbias: None,
                in_tensor_rule: design == Design::Envelope,
                grads_in_tensor_rule: false,
                ftz,
            },
        },
        Some((mut dq, mut dk, mut odq, mut odk, odv)) => {
            dq.mapv_inplace(|x| x * factor);
            dk.mapv_inplace(|x| x * factor);
            odq.mapv_inplace(|x| x * 2.0 * (u + lk * u32));
            odk.mapv_inplace(|x| x * 2.0 * (u + nq * u32));
            let (dbn, dbo) = match db {
                Some((mut n, mut o)) => {
                    n.mapv_inplace(|x| x * factor);
                    o.mapv_inplace(|x| x * 2.0 * (u + nq * u32));
                    (Some(n), Some(o))
                }
                None => (None, None),
            };
            Allowances {
                p_noise,
                grads: Some(GradAllowance { dq, dk, dbias: dbn }),
                order: OrderAllowance {
                    o: with_ftz(ord_o, "o"),
                    dq: Some(with_ftz(odq, "dq")),
                    dk: Some(with_ftz(odk, "dk")),
                    dv: Some(with_ftz(odv, "dv")),
                    dbias: dbo.map(|d| with_ftz(d, "dbias")),
                    in_tensor_rule: design == Design::Envelope,
                    grads_in_tensor_rule: false,
                    ftz,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::samples::one_query_two_keys as case;
    use crate::harness::data_class::DataClass;
    use smallseq_reference::forward_backward;

    fn allowance(c: &Case) -> GradAllowance {
        let (f, _) = forward_backward(&c.problem().unwrap());
        allowances(c, &f.o, &f.lse, Design::Envelope).grads.unwrap()
    }

    #[test]
    fn cancelling_ds_gets_an_allowance_far_above_its_gradient() {
        // Equal scores, so P = 1/2 each; dP = 1000 and 1000 + 2^-10: dS = ±2^-12, a cancellation
        // of 1000 against 2^-12.
        let c = case(1.0, [0.5, 0.5], [1000.0, 1000.0 + 1.0 / 1024.0], 1.0);
        let al = allowance(&c);
        let (_, g) = forward_backward(&c.problem().unwrap());
        // cond(dQ) = Σ_j |k_j| · P_j · (a_j + A) ≈ 2 · 0.5 · 0.5 · 2000 = 1000, and
        // allowance = 2 · (Dv + Lk + S) · u32 · cond with S = max|S_j| + |lse| = 0.5 + 0.5 + ln 2.
        let s = 0.5 + 0.5 + std::f64::consts::LN_2;
        let want = 2.0 * (3.0 + s) * Dtype::F32.unit_roundoff() * 1000.0;
        assert!(
            (al.dq[(0, 0, 0)] / want - 1.0).abs() < 1e-5,
            "{}",
            al.dq[(0, 0, 0)]
        );
        // dK_0 = q · dS_0 = -2^-12 sits inside the noise its f32 terms of 1000 carry.
        let dk = g.unwrap().dk[(0, 0, 0)];
        assert_eq!(dk, -1.0 / 4096.0);
        assert!(dk.abs() < al.dk[(0, 0, 0)], "{dk} vs {}", al.dk[(0, 0, 0)]);
    }

    #[test]
    fn a_ds_on_a_rounding_boundary_gets_one_ulp_of_it() {
        // Tied keys (P = 1/2 each), dP = v = 2 and -2.015625: dS = ±1.00390625, the midpoint
        // between the bf16 values 1 and 1 + 2^-7, so either rounding is correct, and dQ moves by
        // 2^-7 · |k| per key from the emulation's symmetric pair (dQ = 0).
        let mut c = case(1.0, [0.5, 0.5], [2.0, -2.015625], 1.0);
        c.config.dtype = Dtype::Bf16;
        let al = allowance(&c);
        let jump = 2.0f64.powi(-7) * 0.5;
        assert!(al.dq[(0, 0, 0)] >= 2.0 * jump, "{}", al.dq[(0, 0, 0)]);
        assert!(al.dk[(0, 0, 0)] >= jump, "{}", al.dk[(0, 0, 0)]);
        // A dS a quarter of an ulp from the boundary (v0 = 2.0078125: dS = 1.005859375) has no
        // jump: the allowance stays at f32 noise.
        let mut far = case(1.0, [0.5, 0.5], [2.0078125, -2.015625], 1.0);
        far.config.dtype = Dtype::Bf16;
        let al = allowance(&far);
        assert!(al.dq[(0, 0, 0)] < 1e-4, "{}", al.dq[(0, 0, 0)]);
        // f32 rounds nothing: no jump.
        let al = allowance(&case(1.0, [0.5, 0.5], [2.0, -2.015625], 1.0));
        assert!(al.dq[(0, 0, 0)] < 1e-4, "{}", al.dq[(0, 0, 0)]);
    }

    #[test]
    fn without_cancellation_the_allowance_is_a_few_hundred_f32_ulps() {
        let c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        let al = allowance(&c);
        let (_, g) = forward_backward(&c.problem().unwrap());
        let g = g.unwrap();
        for (allow, grad) in [
            (al.dq[(0, 0, 0)], g.dq[(0, 0, 0)]),
            (al.dk[(1, 0, 0)], g.dk[(1, 0, 0)]),
        ] {
            let ulps = allow / (grad.abs() * Dtype::F32.unit_roundoff());
            assert!(ulps > 1.0 && ulps < 500.0, "{ulps} ulps");
            // Below one bf16 rounding of the gradient: no loosening at 16 bits.
            assert!(allow < grad.abs() * Dtype::Bf16.unit_roundoff());
        }
    }

    #[test]
    fn a_comparison_of_two_noisy_outputs_gets_both_allowances() {
        let c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        let one = allowance(&c);
        let two = one.between_two_outputs();
        assert_eq!(two.dq, &one.dq * 2.0);
        assert_eq!(two.dk, &one.dk * 2.0);
    }

    #[test]
    fn a_p_on_a_rounding_boundary_decides_an_output_that_cancels() {
        // Scores 2^-10 apart: P_0 = 1/(1 + e^-2^-10) sits 4e-12 below 0.5 + 2^-12, the f16
        // midpoint between 0.5 and its next value, so f32 noise rounds it either way: a jump of
        // 2^-11. P_1 = 1 - P_0 is next to 0.5 - 2^-12, an f16 value: no jump, only drift.
        let u = Dtype::F16.unit_roundoff();
        let noise = |v: [f32; 2]| {
            let mut c = case(1.0, [0.5 + 1.0 / 1024.0, 0.5], v, 1.0);
            c.config.dtype = Dtype::F16;
            let (f, _) = forward_backward(&c.problem().unwrap());
            let a = allowances(&c, &f.o, &f.lse, Design::Envelope);
            (a.p_noise.o[(0, 0, 0)], f.o[(0, 0, 0)])
        };
        // V = (1, -1): O = P_0 - P_1 = 2^-11 cancels, and the jump is 2^11 of its half ulps.
        let (n, o) = noise([1.0, -1.0]);
        assert!(n > 1000.0 * u * o.abs(), "noise {n:e}, o {o:e}");
        // The jump, and the drift ρ · (P_0 + P_1) · 1 with ρ = 2 · (2 + S) · u32.
        assert!((n - 1.0 / 2048.0).abs() < 1e-6, "noise {n:e}");
        // Scores far from a boundary: drift only, far below half an ulp of an O that does not
        // cancel.
        let mut c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        c.config.dtype = Dtype::F16;
        let (f, _) = forward_backward(&c.problem().unwrap());
        let a = allowances(&c, &f.o, &f.lse, Design::Envelope);
        let (n, o) = (a.p_noise.o[(0, 0, 0)], f.o[(0, 0, 0)]);
        assert!(n < 0.01 * u * o.abs(), "noise {n:e}, o {o:e}");
        // dV of each key: its P's noise times |dO|.
        let dv = a.p_noise.dv.unwrap();
        assert!(
            dv[(0, 0, 0)] > 0.0 && dv[(0, 0, 0)] < 1e-4,
            "{}",
            dv[(0, 0, 0)]
        );
    }

    /// The shares of valid o elements whose rounding P's noise decides, over generated cases of
    /// one data distribution and class: by the half-ulp part of the judge's rule alone
    /// ([`noise_decides`] without the emulation's value before rounding), and by the whole
    /// rule.
    fn share_undecided(dist: crate::harness::gen::DataDist, data: DataClass) -> (f64, f64) {
        use crate::harness::gen::{build, draw_geometry};
        use crate::harness::rng::Rng;
        let mut rng = Rng::new(7);
        let (mut half_ulp, mut whole, mut all) = (0usize, 0usize, 0usize);
        for i in 0..40u64 {
            let mut g = draw_geometry(&mut rng);
            if g.config.dtype == Dtype::F32 {
                g.config.dtype = Dtype::F16;
            }
            g.dist = dist;
            g.data = data;
            let Ok(c) = build(&g, 1000 + i) else {
                continue;
            };
            let problem = c.problem().unwrap();
            let (f, _) = forward_backward(&problem);
            let a = allowances(&c, &f.o, &f.lse, Design::Envelope);
            let (e, _) = smallseq_reference::emulate::forward_backward(&problem, c.config.dtype);
            let acc = e.o_acc.iter().map(|x| f64::from(*x));
            for ((n, y), acc) in a.p_noise.o.iter().zip(f.o.iter()).zip(acc) {
                if *y != 0.0 {
                    all += 1;
                    let dt = c.config.dtype;
                    half_ulp += usize::from(noise_decides(*n, None, *y, dt));
                    whole += usize::from(noise_decides(*n, Some(acc), *y, dt));
                }
            }
        }
        let all = all.max(1) as f64;
        (half_ulp as f64 / all, whole as f64 / all)
    }

    #[test]
    fn typical_logits_leave_most_outputs_decided_and_large_near_ties_do_not() {
        use crate::harness::gen::DataDist;
        let (randn, randn_whole) = share_undecided(DataDist::Randn, DataClass::Plain);
        let (tied, tied_whole) = share_undecided(DataDist::Large, DataClass::NearTieOnEdge);
        eprintln!(
            "o elements P's noise decides (half ulp / whole rule): randn {randn:.3} / \
             {randn_whole:.3}, large near ties {tied:.3} / {tied_whole:.3}"
        );
        assert!(randn < 0.1, "randn: {randn}");
        assert!(
            tied > 3.0 * randn,
            "large near ties: {tied}, randn: {randn}"
        );
    }

    #[test]
    fn a_capsule_is_judged_under_the_design_it_records_else_its_backends() {
        let mut c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        assert_eq!(Design::of_case(&c), Design::Envelope);
        c.meta.insert("smallseq.backend".into(), "cuda".into());
        assert_eq!(Design::of_case(&c), Design::Project);
        c.meta
            .insert(DESIGN_KEY.into(), Design::Envelope.name().into());
        assert_eq!(Design::of_case(&c), Design::Envelope);
        c.meta
            .insert("smallseq.backend".into(), "torch_sdpa".into());
        c.meta.remove(DESIGN_KEY);
        assert_eq!(Design::of_case(&c), Design::Envelope);
    }

    #[test]
    fn rows_without_keys_and_forward_only_cases_get_nothing() {
        let mut c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        let lse = Array2::from_elem((1, 1), f64::NEG_INFINITY);
        let o = Array3::zeros((1, 1, 1));
        let a = allowances(&c, &o, &lse, Design::Envelope);
        assert_eq!(a.grads.unwrap().dq[(0, 0, 0)], 0.0);
        assert_eq!(a.order.o[(0, 0, 0)], 0.0);
        c.d_o = None;
        let a = allowances(&c, &o, &lse, Design::Envelope);
        assert!(a.grads.is_none() && a.order.dv.is_none());
    }
}
