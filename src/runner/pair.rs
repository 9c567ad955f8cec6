//! What one run of a case returns: its forward and, where the case has `d_o`, the backward
//! from that forward. Every runner returns it, in this process or from a worker, so it lives
//! here below the properties that judge it and the workers that serve it.

use crate::backend::Backend;
use crate::case::{Case, Outputs};
use crate::dispatch::Path;
use crate::error::Result;
use crate::wrapper::{self, BwdResult, FwdResult, RunOptions};

/// One forward (+ backward) run.
pub struct Pair {
    pub fwd: FwdResult,
    pub bwd: Option<BwdResult>,
    /// Whether the implementation returned the log-sum-exp (a worker may not).
    pub has_lse: bool,
}

impl Pair {
    /// Whether the forward and the backward ran on the small-seq path.
    pub fn small_seq(&self) -> (bool, bool) {
        (
            self.fwd.path == Some(Path::SmallSeq),
            self.bwd.as_ref().and_then(|b| b.path) == Some(Path::SmallSeq),
        )
    }

    /// Whether the forward and the backward ran on the fallback path.
    pub fn fallback(&self) -> (bool, bool) {
        (
            self.fwd.path == Some(Path::Fallback),
            self.bwd.as_ref().and_then(|b| b.path) == Some(Path::Fallback),
        )
    }

    pub fn outputs(&self) -> Outputs {
        Outputs {
            o: Some(self.fwd.o.mapv(f64::from)),
            lse: self.has_lse.then(|| self.fwd.lse.mapv(f64::from)),
            dq: self.bwd.as_ref().map(|b| b.dq.mapv(f64::from)),
            dk: self.bwd.as_ref().map(|b| b.dk.mapv(f64::from)),
            dv: self.bwd.as_ref().map(|b| b.dv.mapv(f64::from)),
            dbias: self
                .bwd
                .as_ref()
                .and_then(|b| b.dbias.as_ref())
                .map(|d| d.mapv(f64::from)),
        }
    }
}

/// Runs forward, then backward from that forward's outputs when the case has `d_o`.
///
/// # Errors
/// Anything the wrappers return.
pub fn run_pair(be: &dyn Backend, case: &Case, opts: &RunOptions) -> Result<Pair> {
    let fwd = wrapper::fwd(be, case, opts)?;
    let bwd = match case.d_o {
        Some(_) => Some(wrapper::bwd(be, case, &fwd.o, &fwd.lse, opts)?),
        None => None,
    };
    Ok(Pair {
        fwd,
        bwd,
        has_lse: true,
    })
}
