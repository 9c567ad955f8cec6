//! The additive bias of the scores (`docs/semantics.md` §1.9): TE's post-scale bias, a tensor
//! `[1|b, 1|H, Sq, Sk]` broadcast over the slots and heads where its dimension is 1, and ALiBi,
//! one slope per query head.

use crate::layout::Layout;
use crate::types::{visible, Mask, Window};
use ndarray::Array4;
use std::sync::Arc;
use thiserror::Error;

/// What is added to `S = scale · Q Kᵀ` before the mask and the softmax.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum AttnBias {
    #[default]
    None,
    /// `[Bb, Hb, Sq, Sk]`, `Bb ∈ {1, b}`, `Hb ∈ {1, H}`, `Sq ≥ max Lq`, `Sk ≥ max Lk`; values
    /// of the input dtype (shared: a case is cloned for every relation, its bias is not).
    PostScale(Arc<Array4<f32>>),
    /// `[H]` f32 slopes: `bias[r, c] = −slope_h · |r + (Lk − Lq) − c|` within each slot.
    Alibi(Arc<Vec<f32>>),
}

/// A bias that does not fit its case; every message names the tensor, the index and the value.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum BiasError {
    #[error("tensor bias: shape {} does not fit the case: expected [{}, {}, at least {}, at least {}] (docs/semantics.md §1.9)", dims(.got), alts(*.slots), alts(*.heads), .sq, .sk)]
    Shape {
        got: Vec<usize>,
        slots: usize,
        heads: usize,
        sq: usize,
        sk: usize,
    },
    #[error("tensor bias{} = {value}: slot {slot}, head {head} reads it at a visible key, where +inf or NaN leaves the softmax undefined (docs/semantics.md §1.9)", dims(.index))]
    Entry {
        index: [usize; 4],
        value: f32,
        slot: usize,
        head: usize,
    },
    #[error(
        "tensor alibi_slopes: shape [{got}] does not match [{heads}] (one slope per query head)"
    )]
    Slopes { got: usize, heads: usize },
    #[error("tensor alibi_slopes[{index}] = {value}: must be finite")]
    Slope { index: usize, value: f32 },
}

fn dims(d: &[usize]) -> String {
    let parts: Vec<String> = d.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn alts(n: usize) -> String {
    if n == 1 {
        "1".into()
    } else {
        format!("1 or {n}")
    }
}

impl AttnBias {
    pub fn is_none(&self) -> bool {
        matches!(self, AttnBias::None)
    }

    /// The config's name of the bias type (§2.2 key `bias`).
    pub fn name(&self) -> &'static str {
        match self {
            AttnBias::None => "none",
            AttnBias::PostScale(_) => "post_scale_bias",
            AttnBias::Alibi(_) => "alibi",
        }
    }

    /// The tensor's `(batch, head)` index read by slot `slot`, head `head`, where a dimension
    /// of 1 broadcasts.
    #[inline]
    pub fn tensor_index(t: &Array4<f32>, slot: usize, head: usize) -> (usize, usize) {
        let (bb, hb, _, _) = t.dim();
        (
            if bb == 1 { 0 } else { slot },
            if hb == 1 { 0 } else { head },
        )
    }

    /// The f32 value kernels add to `S[r, c]` of slot `slot`, head `head`, a slot of `lq`
    /// queries and `lk` keys: the tensor's entry, or ALiBi's product rounded to f32.
    #[inline]
    pub fn at32(&self, slot: usize, head: usize, r: usize, c: usize, lq: usize, lk: usize) -> f32 {
        match self {
            AttnBias::None => 0.0,
            AttnBias::PostScale(t) => {
                let (b, h) = AttnBias::tensor_index(t, slot, head);
                t[[b, h, r, c]]
            }
            AttnBias::Alibi(s) => -(s[head] * alibi_distance(r, c, lq, lk) as f32),
        }
    }

    /// [`AttnBias::at32`] in f64, ALiBi's product exact.
    #[inline]
    pub fn at(&self, slot: usize, head: usize, r: usize, c: usize, lq: usize, lk: usize) -> f64 {
        match self {
            AttnBias::Alibi(s) => -(f64::from(s[head]) * alibi_distance(r, c, lq, lk) as f64),
            _ => f64::from(self.at32(slot, head, r, c, lq, lk)),
        }
    }

    /// The shape of dBias (`[Bb, Hb, Sq, Sk]`, the bias's own), for a post-scale bias: ALiBi's
    /// slopes take no gradient in TE.
    pub fn grad_shape(&self) -> Option<[usize; 4]> {
        match self {
            AttnBias::PostScale(t) => {
                let (a, b, c, d) = t.dim();
                Some([a, b, c, d])
            }
            _ => None,
        }
    }

    /// Checks the bias against the case: the shape, and no `+inf` or NaN entry where a slot
    /// reads it at a key its mask and window leave visible (unread entries may hold anything).
    ///
    /// # Errors
    /// The first offending shape or entry.
    pub fn check(
        &self,
        layout: &Layout,
        heads: usize,
        mask: Mask,
        window: Window,
    ) -> Result<(), BiasError> {
        match self {
            AttnBias::None => Ok(()),
            AttnBias::Alibi(s) => {
                if s.len() != heads {
                    return Err(BiasError::Slopes {
                        got: s.len(),
                        heads,
                    });
                }
                match s.iter().position(|x| !x.is_finite()) {
                    Some(index) => Err(BiasError::Slope {
                        index,
                        value: s[index],
                    }),
                    None => Ok(()),
                }
            }
            AttnBias::PostScale(t) => {
                let (bb, hb, sq, sk) = t.dim();
                let slots = layout.slots();
                let (mq, mk) = (layout.q.max_len(), layout.kv.max_len());
                let fits = (bb == 1 || bb == slots) && (hb == 1 || hb == heads);
                if !fits || sq < mq || sk < mk {
                    return Err(BiasError::Shape {
                        got: vec![bb, hb, sq, sk],
                        slots,
                        heads,
                        sq: mq,
                        sk: mk,
                    });
                }
                for slot in 0..slots {
                    let (lq, lk) = (layout.q.len(slot), layout.kv.len(slot));
                    for head in 0..heads {
                        let (b, h) = AttnBias::tensor_index(t, slot, head);
                        for r in 0..lq {
                            for c in 0..lk {
                                let value = t[[b, h, r, c]];
                                let bad = value.is_nan() || value == f32::INFINITY;
                                if bad && visible(mask, window, r, c, lq, lk) {
                                    return Err(BiasError::Entry {
                                        index: [b, h, r, c],
                                        value,
                                        slot,
                                        head,
                                    });
                                }
                            }
                        }
                    }
                }
                Ok(())
            }
        }
    }
}

/// `|r + (Lk − Lq) − c|`: the distance of key `c` from row `r`'s bottom-right diagonal
/// (FlashAttention's ALiBi, which TE passes its slopes to).
#[inline]
pub fn alibi_distance(r: usize, c: usize, lq: usize, lk: usize) -> u64 {
    (r as i64 + lk as i64 - lq as i64 - c as i64).unsigned_abs()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Side;

    fn layout(lq: &[i32], lk: &[i32]) -> Layout {
        let side = |l: &[i32]| {
            let mut cu = vec![0];
            for x in l {
                cu.push(cu.last().unwrap() + x);
            }
            Side {
                tokens: *cu.last().unwrap() as usize,
                cu,
                padded: None,
            }
        };
        Layout {
            q: side(lq),
            kv: side(lk),
        }
    }

    #[test]
    fn broadcast_reads_index_zero_on_a_dimension_of_one() {
        let mut t = Array4::<f32>::zeros((1, 3, 2, 2));
        t[[0, 2, 1, 0]] = 5.0;
        let b = AttnBias::PostScale(Arc::new(t));
        assert_eq!(b.at32(7, 2, 1, 0, 2, 2), 5.0);
        assert_eq!(b.at32(7, 1, 1, 0, 2, 2), 0.0);
    }

    #[test]
    fn alibi_is_the_distance_from_the_bottom_right_diagonal() {
        let b = AttnBias::Alibi(Arc::new(vec![0.5, 0.25]));
        // Lq = 2, Lk = 4: row 0's diagonal is key 2, row 1's key 3.
        assert_eq!(b.at(0, 0, 0, 2, 2, 4), 0.0);
        assert_eq!(b.at(0, 0, 0, 0, 2, 4), -1.0);
        assert_eq!(b.at(0, 1, 1, 0, 2, 4), -0.75);
        assert_eq!(b.at(0, 1, 0, 3, 2, 4), -0.25);
    }

    #[test]
    fn check_names_the_shape_and_the_entry() {
        let l = layout(&[2, 1], &[3, 2]);
        let ok = AttnBias::PostScale(Arc::new(Array4::zeros((2, 1, 2, 3))));
        assert_eq!(ok.check(&l, 4, Mask::NoMask, Window::NONE), Ok(()));
        let short = AttnBias::PostScale(Arc::new(Array4::zeros((2, 1, 2, 2))));
        let e = short.check(&l, 4, Mask::NoMask, Window::NONE).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor bias: shape [2, 1, 2, 2] does not fit the case: expected [1 or 2, 1 or 4, at least 2, at least 3] (docs/semantics.md §1.9)"
        );
        let mut t = Array4::<f32>::zeros((1, 4, 2, 3));
        // Slot 0's row 0 sees key 2 without a mask: +inf there is refused; under a causal
        // mask it is hidden and ignored, as is any -inf.
        t[[0, 3, 0, 2]] = f32::INFINITY;
        t[[0, 1, 1, 1]] = f32::NEG_INFINITY;
        let b = AttnBias::PostScale(Arc::new(t));
        let e = b.check(&l, 4, Mask::NoMask, Window::NONE).unwrap_err();
        assert_eq!(
            e,
            BiasError::Entry {
                index: [0, 3, 0, 2],
                value: f32::INFINITY,
                slot: 0,
                head: 3
            }
        );
        let msg = e.to_string();
        assert!(msg.starts_with("tensor bias[0, 3, 0, 2] = inf:"), "{msg}");
        assert_eq!(b.check(&l, 4, Mask::Causal, Window::NONE), Ok(()));
        let s = AttnBias::Alibi(Arc::new(vec![1.0, f32::NAN]));
        assert_eq!(
            s.check(&l, 2, Mask::NoMask, Window::NONE)
                .unwrap_err()
                .to_string(),
            "tensor alibi_slopes[1] = NaN: must be finite"
        );
    }
}
