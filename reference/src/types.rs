//! The vocabulary of `docs/semantics.md` §1: element types, masks and windows.

use crate::bias::AttnBias;
use crate::dropout::Dropout;
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// Element type of `q`, `k`, `v` and `d_o`.
///
/// Tensors travel through the whole project as `f32` values that are exactly representable in
/// their dtype (bf16 and f16 embed exactly into f32), so upcasting to f64 is always exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];

    /// Round an f32 to the nearest value of this dtype (round-to-nearest-even), returned as f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::Bf16 => bf16::from_f32(x).to_f32(),
            Dtype::F16 => f16::from_f32(x).to_f32(),
            Dtype::F32 => x,
        }
    }

    /// [`Dtype::round`] of every element, in place. f16 goes through the slice conversions of
    /// `half`, which use the same instruction as one value at a time (F16C where the CPU has
    /// it, else the same software rounding), so every bit is the same, eight values a step.
    pub fn round_in_place(self, xs: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        match self {
            Dtype::F32 => {}
            Dtype::Bf16 => xs.iter_mut().for_each(|x| *x = self.round(*x)),
            Dtype::F16 => {
                let mut buf = [f16::ZERO; 64];
                for chunk in xs.chunks_mut(64) {
                    let b = &mut buf[..chunk.len()];
                    b.convert_from_f32_slice(chunk);
                    b.convert_to_f32_slice(chunk);
                }
            }
        }
    }

    /// Round to this dtype, saturating at its largest finite value instead of overflowing to
    /// infinity (NaN stays NaN). The kernels round dS this way: an infinite dS of one key and
    /// the opposite infinity of another turn every dQ of the row into NaN.
    #[inline]
    pub fn round_saturating(self, x: f32) -> f32 {
        let m = self.max_finite();
        self.round(x.clamp(-m, m))
    }

    /// Round an f64 to this dtype, through f32 for the 16-bit types (as a device store does).
    #[inline]
    pub fn round_f64(self, x: f64) -> f32 {
        match self {
            Dtype::Bf16 => bf16::from_f64(x).to_f32(),
            Dtype::F16 => f16::from_f64(x).to_f32(),
            Dtype::F32 => x as f32,
        }
    }

    /// Unit roundoff `u = 2^-p` where `p` is the number of stored mantissa bits + 1.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::F32 => 2f64.powi(-24),
        }
    }

    /// Smallest positive value: the spacing of the subnormal range, where precision is
    /// absolute, not relative.
    pub fn smallest_subnormal(self) -> f64 {
        match self {
            Dtype::Bf16 => 2f64.powi(-133),
            Dtype::F16 => 2f64.powi(-24),
            Dtype::F32 => 2f64.powi(-149),
        }
    }

    /// Smallest positive normal value: below it precision is absolute (the subnormal range).
    pub fn smallest_normal(self) -> f64 {
        self.smallest_subnormal() / (2.0 * self.unit_roundoff())
    }

    /// Largest finite value.
    pub fn max_finite(self) -> f32 {
        match self {
            Dtype::Bf16 => bf16::MAX.to_f32(),
            Dtype::F16 => f16::MAX.to_f32(),
            Dtype::F32 => f32::MAX,
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The name used in case files (`"bf16"`, `"f16"`, `"f32"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype '{s}' (expected bf16, f16 or f32)"))
    }
}

/// Attention mask types of `docs/semantics.md` §1.5. The `padding_*` names are identical to their
/// plain counterparts for THD; both spellings exist because dispatch surfaces tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mask {
    NoMask,
    Padding,
    Causal,
    PaddingCausal,
    CausalBottomRight,
    PaddingCausalBottomRight,
}

impl Mask {
    pub const ALL: [Mask; 6] = [
        Mask::NoMask,
        Mask::Padding,
        Mask::Causal,
        Mask::PaddingCausal,
        Mask::CausalBottomRight,
        Mask::PaddingCausalBottomRight,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mask::NoMask => "no_mask",
            Mask::Padding => "padding",
            Mask::Causal => "causal",
            Mask::PaddingCausal => "padding_causal",
            Mask::CausalBottomRight => "causal_bottom_right",
            Mask::PaddingCausalBottomRight => "padding_causal_bottom_right",
        }
    }

    /// Causal alignment, if any.
    pub fn causal(self) -> Option<CausalAlign> {
        match self {
            Mask::NoMask | Mask::Padding => None,
            Mask::Causal | Mask::PaddingCausal => Some(CausalAlign::TopLeft),
            Mask::CausalBottomRight | Mask::PaddingCausalBottomRight => {
                Some(CausalAlign::BottomRight)
            }
        }
    }

    /// Whether the mask belongs to TE's "padding class".
    pub fn is_padding_class(self) -> bool {
        matches!(
            self,
            Mask::Padding | Mask::PaddingCausal | Mask::PaddingCausalBottomRight
        )
    }
}

impl fmt::Display for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mask {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Mask::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Mask::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mask '{s}' (expected {})", names.join(", "))
            })
    }
}

/// Where the causal diagonal sits when `Lq != Lk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalAlign {
    /// key `c` visible to row `r` iff `c <= r`
    TopLeft,
    /// key `c` visible to row `r` iff `c <= r + (Lk - Lq)`
    BottomRight,
}

/// Sliding window `(left, right)`, bottom-right aligned; a negative bound is unbounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    pub left: i64,
    pub right: i64,
}

impl Window {
    pub const NONE: Window = Window {
        left: -1,
        right: -1,
    };

    pub fn is_none(self) -> bool {
        self.left < 0 && self.right < 0
    }
}

impl Default for Window {
    fn default() -> Self {
        Window::NONE
    }
}

/// Whether key `c` is visible to query row `r` of a slot with `lq` queries and `lk` keys.
///
/// `visible(r, c) = c < lk ∧ causal(r, c) ∧ diag - left <= c <= diag + right`, with
/// `diag = r + (lk - lq)`.
#[inline]
pub fn visible(mask: Mask, window: Window, r: usize, c: usize, lq: usize, lk: usize) -> bool {
    if c >= lk || r >= lq {
        return false;
    }
    let (r, c, lq, lk) = (r as i64, c as i64, lq as i64, lk as i64);
    let diag = r + (lk - lq);
    let causal_ok = match mask.causal() {
        None => true,
        Some(CausalAlign::TopLeft) => c <= r,
        Some(CausalAlign::BottomRight) => c <= diag,
    };
    let left_ok = window.left < 0 || c >= diag - window.left;
    let right_ok = window.right < 0 || c <= diag + window.right;
    causal_ok && left_ok && right_ok
}

/// Attention parameters the math needs (the layout is separate, see [`crate::Layout`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim_qk: usize,
    pub head_dim_v: usize,
    pub mask: Mask,
    pub window: Window,
    pub scale: f64,
    /// Dropout of P (`docs/semantics.md` §1.8); [`Dropout::NONE`] leaves P as it is.
    pub dropout: Dropout,
    /// The scores' additive bias (`docs/semantics.md` §1.9); [`AttnBias::None`] adds nothing.
    pub bias: AttnBias,
}

impl AttnParams {
    /// Query heads per kv head (`g = H / Hkv`); `h` reads kv head `h / g`.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }
}

#[cfg(test)]
mod saturation_tests {
    use super::*;

    #[test]
    fn smallest_normal_is_each_types_own() {
        assert_eq!(Dtype::F16.smallest_normal(), 2f64.powi(-14));
        assert_eq!(Dtype::Bf16.smallest_normal(), 2f64.powi(-126));
        assert_eq!(Dtype::F32.smallest_normal(), f64::from(f32::MIN_POSITIVE));
    }

    #[test]
    fn round_saturating_stops_at_the_largest_finite_value() {
        assert_eq!(Dtype::F16.round(70000.0), f32::INFINITY);
        assert_eq!(Dtype::F16.round_saturating(70000.0), 65504.0);
        assert_eq!(Dtype::F16.round_saturating(-1e30), -65504.0);
        assert_eq!(Dtype::F16.round_saturating(f32::NEG_INFINITY), -65504.0);
        assert_eq!(
            Dtype::F16.round_saturating(1.0009766),
            Dtype::F16.round(1.0009766)
        );
        assert!(Dtype::Bf16.round_saturating(f32::NAN).is_nan());
        assert_eq!(
            Dtype::Bf16.round_saturating(f32::MAX),
            Dtype::Bf16.max_finite()
        );
        assert_eq!(Dtype::F32.round_saturating(f32::INFINITY), f32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::Dtype;

    #[test]
    fn rounding_in_place_is_rounding_one_value_at_a_time() {
        // A spread of f32 bit patterns (every sign, exponent and the low mantissa bits),
        // NaN and the infinities included, in a length that leaves a partial chunk.
        let xs: Vec<f32> = (0..200_003u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 65520.0, -0.0])
            .collect();
        for dt in Dtype::ALL {
            let mut ys = xs.clone();
            dt.round_in_place(&mut ys);
            for (x, y) in xs.iter().zip(&ys) {
                assert_eq!(dt.round(*x).to_bits(), y.to_bits(), "{dt:?} {x:e}");
            }
        }
    }
}
