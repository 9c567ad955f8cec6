//! `fallback_equivalence`: where a case is eligible for the small-seq path, the forced
//! fallback is right by itself, the two paths agree to the sum of their thresholds, and a
//! fallback backward from the small-seq forward's LSE is right too. A framework may run the
//! two directions on different paths (the environment read at trace time and at run time),
//! so each pairing must hold, not just each path alone.

use super::checker::{CaseContext, Checker};
use super::numeric::numeric;
use super::relation::paths_agree;
use super::verdict::{fail, skip, Outcome, Prop};
use crate::case::Outputs;
use crate::dispatch::Path;
use crate::wrapper::RunOptions;

impl Checker<'_> {
    pub(super) fn fallback_equivalence(&self, cx: &CaseContext<'_>) -> Outcome {
        let (case, base, actual, y, judgements) =
            (cx.case, cx.base, cx.actual, cx.y, cx.judgements);
        if !self.runner.caps().harness_options {
            return skip("the implementation cannot be forced onto its fallback");
        }
        if base.fwd.path != Some(Path::SmallSeq) {
            return skip("not eligible for small-seq");
        }
        let opts = RunOptions {
            force: Some(Path::Fallback),
            ..self.opts.clone()
        };
        let fb = match self.runner.run_pair(case, &opts) {
            Ok(p) => p,
            Err(e) => {
                return fail(
                    Prop::FallbackEquivalence,
                    format!("fallback run failed: {e}"),
                )
            }
        };
        let fb_out = fb.outputs();
        // The forced-fallback run is judged against the reference like the base run: its own
        // verdict is the sharpest this property has (a failure of it is a failure).
        let fb_y = match y.for_backward(case, fb.fallback().1) {
            Ok(fy) => fy,
            Err(e) => {
                return fail(
                    Prop::FallbackEquivalence,
                    format!("fallback yardstick: {e}"),
                )
            }
        };
        let (fb_num, fb_js) = numeric(case, &fb_out, &fb_y);
        if let Outcome::Fail(mut f) = fb_num {
            f.prop = Prop::FallbackEquivalence;
            f.detail = format!("forced fallback against the reference: {}", f.detail);
            return Outcome::Fail(f);
        }
        if let fail @ Outcome::Fail(_) =
            paths_agree(case, y, (actual, judgements), (&fb_out, &fb_js))
        {
            return fail;
        }
        // Forward and backward on different paths must still agree: backward on the
        // fallback from the small-seq forward's LSE.
        if case.d_o.is_some() {
            match self
                .runner
                .run_bwd_from(case, &base.fwd.o, &base.fwd.lse, &opts)
            {
                Err(e) => {
                    return fail(
                        Prop::FallbackEquivalence,
                        format!("mixed-path backward failed: {e}"),
                    )
                }
                Ok(b) => {
                    let mixed = Outputs {
                        dq: Some(b.dq.mapv(f64::from)),
                        dk: Some(b.dk.mapv(f64::from)),
                        dv: Some(b.dv.mapv(f64::from)),
                        ..Outputs::default()
                    };
                    // The mixed backward ran the fallback: its yardstick is the forced run's.
                    if let (Outcome::Fail(mut f), _) = numeric(case, &mixed, &fb_y) {
                        f.prop = Prop::FallbackEquivalence;
                        f.detail = format!("small-seq forward + fallback backward: {}", f.detail);
                        return Outcome::Fail(f);
                    }
                }
            }
        }
        Outcome::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_backends::{bf16_case, HookedCpu, Judged};
    use super::*;
    use crate::config::AttnConfig;
    use crate::runner::run_pair;
    use smallseq_reference::{Dtype, Layout, Mask};

    #[test]
    fn the_forced_fallbacks_own_verdict_fails_fallback_equivalence() {
        // bf16, one slot of 4: small-seq eligible; the fallback's O is 3 % off, within the
        // sum of both paths' thresholds of the small-seq run only if the small-seq path's
        // threshold is large, never within its own.
        let layout = Layout::packed(&[(4, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 64, Mask::Padding);
        let case = bf16_case(cfg, layout, 3);
        let verdict = |off: f32| {
            let mut be = HookedCpu::new();
            be.after_fwd = Box::new(move |_, out| {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * (1.0 + off));
                }
            });
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::SmallSeq));
            checker.fallback_equivalence(&Judged::new(&case, base).cx(&case))
        };
        assert_eq!(verdict(0.0), Outcome::Pass);
        match verdict(0.03) {
            Outcome::Fail(f) => assert!(
                f.detail.contains("forced fallback against the reference"),
                "{}",
                f.detail
            ),
            other => panic!("expected a failure, got {other:?}"),
        }
    }
}
