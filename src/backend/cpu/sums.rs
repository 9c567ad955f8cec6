//! The f32 reductions of both CPU paths (P·V, the softmax row sum, D = Σ P·dP, dQ, dK, dV)
//! and the one-ulp losses the mutant catalogue plants in them: a partial sum rounded to the
//! input dtype at every step. Which reductions lose is decided once per launch ([`Losses`]),
//! and each helper picks its loop once per call, so a correct run's inner loops are the plain
//! f32 ones (no per-element check of the defects).

use super::CpuBackend;
use crate::mutants::Mutant;
use smallseq_reference::Dtype;

/// Per reduction, the dtype its partial sums are rounded to (None: kept in f32).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Losses {
    pub pv: Option<Dtype>,
    pub rowsum: Option<Dtype>,
    pub delta: Option<Dtype>,
    pub dq: Option<Dtype>,
    pub dk: Option<Dtype>,
    pub dv: Option<Dtype>,
}

impl Losses {
    /// The losses of `be`'s small-seq path for inputs of type `dt`.
    pub fn small_seq(be: &CpuBackend, dt: Dtype) -> Self {
        let at = |m| be.has(m).then_some(dt);
        Losses {
            pv: at(Mutant::PvHalfAccumulation),
            rowsum: at(Mutant::RowsumHalfAccumulation),
            delta: at(Mutant::DeltaHalfAccumulation),
            dq: at(Mutant::DqHalfAccumulation),
            dk: at(Mutant::DkHalfAccumulation),
            dv: at(Mutant::DvHalfAccumulation),
        }
    }

    /// The losses of `be`'s fallback path for inputs of type `dt`.
    pub fn fallback(be: &CpuBackend, dt: Dtype) -> Self {
        let at = |m| be.has(m).then_some(dt);
        Losses {
            pv: at(Mutant::FallbackPvHalfAccumulation),
            rowsum: at(Mutant::FallbackRowsumHalfAccumulation),
            delta: at(Mutant::FallbackDeltaHalfAccumulation),
            dq: at(Mutant::FallbackDqHalfAccumulation),
            dk: at(Mutant::FallbackDkHalfAccumulation),
            dv: at(Mutant::FallbackDvHalfAccumulation),
        }
    }
}

/// `dst += w·src`, element by element; under `loss`, each new partial sum rounded to it.
pub(super) fn axpy(dst: &mut [f32], w: f32, src: &[f32], loss: Option<Dtype>) {
    match loss {
        None => dst.iter_mut().zip(src).for_each(|(x, s)| *x += w * s),
        Some(dt) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(x, s)| *x = dt.round(*x + w * s)),
    }
}

/// The sum of `terms` in order; under `loss`, each partial sum rounded to it.
pub(super) fn sum(terms: impl Iterator<Item = f32>, loss: Option<Dtype>) -> f32 {
    match loss {
        None => terms.sum(),
        Some(dt) => terms.fold(0.0, |acc, t| dt.round(acc + t)),
    }
}

/// `acc + t`, under `loss` rounded to it.
pub(super) fn add(acc: f32, t: f32, loss: Option<Dtype>) -> f32 {
    match loss {
        None => acc + t,
        Some(dt) => dt.round(acc + t),
    }
}
