//! What the scalar fallback kernels add to the scores beyond `scale · Q Kᵀ`, as launch
//! arguments: dropout (`docs/semantics.md` §1.8) and the additive bias (§1.9). The other GPU
//! kernels take neither, so a call with either launches the scalar ones
//! ([`crate::backend::launch::LaunchDims::tiled_fwd`]).

use smallseq_reference::{AttnBias, Dropout};

/// The scalar fallback kernels' dropout arguments: the generator's key and offset, the
/// reference's keep threshold `⌈p · 2³²⌉` (0: no dropout) and the f32 factor of a kept element.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DropArgs {
    pub seed: u64,
    pub offset: u64,
    pub keep_at: i64,
    pub rescale: f32,
}

impl DropArgs {
    pub const NONE: DropArgs = DropArgs {
        seed: 0,
        offset: 0,
        keep_at: 0,
        rescale: 1.0,
    };

    pub fn of(d: &Dropout) -> DropArgs {
        if !d.is_active() {
            return DropArgs::NONE;
        }
        DropArgs {
            seed: d.seed,
            offset: d.offset,
            keep_at: d.threshold() as i64,
            rescale: d.rescale() as f32,
        }
    }

    pub fn is_active(&self) -> bool {
        self.keep_at > 0
    }
}

/// Which bias the kernels add (`FbBias::kind` in kernels/fallback.cu).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BiasKind {
    #[default]
    None = 0,
    /// A `[Bb, Hb, Sq, Sk]` f32 tensor (TE's `post_scale_bias`), with a gradient.
    PostScale = 1,
    /// One f32 slope per query head, no gradient.
    Alibi = 2,
}

/// The bias's kind and the dims of its tensor (`[Bb, Hb, Sq, Sk]`; ALiBi: `[1, 1, 1, H]`, the
/// slopes' length last). The tensor itself travels as a pointer ([`crate::backend::launch::Ptrs::bias`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BiasArgs {
    pub kind: BiasKind,
    pub dims: [i32; 4],
}

impl BiasArgs {
    pub const NONE: BiasArgs = BiasArgs {
        kind: BiasKind::None,
        dims: [0; 4],
    };

    pub fn of(b: &AttnBias) -> BiasArgs {
        let clip = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
        match b {
            AttnBias::None => BiasArgs::NONE,
            AttnBias::PostScale(t) => {
                let (bb, hb, sq, sk) = t.dim();
                BiasArgs {
                    kind: BiasKind::PostScale,
                    dims: [clip(bb), clip(hb), clip(sq), clip(sk)],
                }
            }
            AttnBias::Alibi(s) => BiasArgs {
                kind: BiasKind::Alibi,
                dims: [1, 1, 1, clip(s.len())],
            },
        }
    }

    pub fn is_active(&self) -> bool {
        self.kind != BiasKind::None
    }

    /// Rows of dBias (`Bb · Hb · Sq`), one work item each of the dBias kernel; 0 where the bias
    /// takes no gradient.
    pub fn grad_rows(&self) -> i64 {
        match self.kind {
            BiasKind::PostScale => self.dims[..3].iter().map(|&x| x as i64).product(),
            _ => 0,
        }
    }

    /// The f32 values the kernels read (row-major tensor, or the slopes), if any.
    pub fn host_values(b: &AttnBias) -> Option<std::borrow::Cow<'_, [f32]>> {
        match b {
            AttnBias::None => None,
            AttnBias::PostScale(t) => Some(match t.as_slice() {
                Some(s) => s.into(),
                None => t.iter().copied().collect::<Vec<f32>>().into(),
            }),
            AttnBias::Alibi(s) => Some(s.as_slice().into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array4;
    use std::sync::Arc;

    #[test]
    fn bias_args_carry_the_tensor_dims_and_the_gradient_rows() {
        let t = AttnBias::PostScale(Arc::new(Array4::zeros((1, 3, 5, 7))));
        let a = BiasArgs::of(&t);
        assert_eq!(
            (a.kind, a.dims, a.grad_rows()),
            (BiasKind::PostScale, [1, 3, 5, 7], 15)
        );
        assert_eq!(BiasArgs::host_values(&t).map(|v| v.len()), Some(105));
        let s = AttnBias::Alibi(Arc::new(vec![0.5, 0.25]));
        let a = BiasArgs::of(&s);
        assert_eq!(
            (a.kind, a.dims, a.grad_rows()),
            (BiasKind::Alibi, [1, 1, 1, 2], 0)
        );
        assert!(!BiasArgs::of(&AttnBias::None).is_active());
    }

    #[test]
    fn dropout_args_take_the_reference_threshold() {
        let mut d = Dropout::default();
        assert_eq!(DropArgs::of(&d), DropArgs::NONE);
        d.p = 0.5;
        d.seed = 7;
        let a = DropArgs::of(&d);
        assert_eq!((a.seed, a.keep_at, a.rescale), (7, 1 << 31, 2.0));
        d.p = 1.0;
        assert_eq!(DropArgs::of(&d).rescale, 0.0);
    }
}
