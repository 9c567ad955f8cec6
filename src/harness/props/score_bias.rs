//! The bias's relations of `metamorphic` (`docs/semantics.md` §1.9).
//!
//! - `bias_zero`: a bias of zeros (a post-scale tensor of zeros, ALiBi slopes of 0) is no
//!   bias, bit for bit (`x + 0` is `x` in f32), both on the base run's path; within two
//!   thresholds of the unbiased case's reference where the bias takes another fallback kernel.
//! - `bias_shift`: softmax does not see a constant added along a row. The case's bias is
//!   replaced by its `-inf` pattern (0 elsewhere), and that case's run compared with the run of
//!   the same pattern plus a constant per bias row (exact: the constants are values of every
//!   dtype): `o`, `dq`, `dk`, `dv` and dBias agree within two thresholds, `lse` after the
//!   constant is taken off. It holds whatever plane a row is read from, so a broadcast on the
//!   wrong axis is `numeric_agreement`'s to catch; this one catches an LSE that leaves the bias
//!   out, and a backward that recomputes P without it (P then moves by `exp(−c)`).

use super::checker::{CaseContext, Checker};
use super::relation::{bitwise_diff, within_tolerance};
use super::verdict::{fail, skip, Outcome, Prop};
use super::yardstick::oracle_for;
use crate::case::{Case, Outputs};
use crate::config::Bias;
use crate::dispatch::Path;
use crate::wrapper::RunOptions;
use ndarray::Array4;
use smallseq_reference::AttnBias;
use std::sync::Arc;

/// Whether the case's bias has values for `bias_zero` to zero.
pub(super) fn has_values(case: &Case) -> bool {
    matches!(
        case.config.params.bias,
        AttnBias::PostScale(_) | AttnBias::Alibi(_)
    )
}

/// Whether `bias_shift` applies: a post-scale bias.
pub(super) fn shiftable(case: &Case) -> bool {
    matches!(case.config.params.bias, AttnBias::PostScale(_))
}

/// The constant of bias row `(b, h, r)`: small values exact in every dtype, different from
/// row to row (and from plane to plane) so that a row read in another's place moves.
fn shift_of(b: usize, h: usize, r: usize) -> f32 {
    const SHIFTS: [f32; 7] = [-3.0, 1.5, -0.75, 2.25, 0.5, -1.25, 3.5];
    SHIFTS[(b * 5 + h * 3 + r) % SHIFTS.len()]
}

fn with_tensor(case: &Case, t: Array4<f32>) -> Case {
    let mut c = case.clone();
    c.config.params.bias = AttnBias::PostScale(Arc::new(t));
    c.outputs = Outputs::default();
    c
}

impl Checker<'_> {
    /// Zero bias against no bias: equal bitwise (dBias aside, which only one of them has).
    pub(super) fn bias_zero_relation(&self, cx: &CaseContext<'_>) -> Outcome {
        if self.runner.external() {
            // A framework may take another kernel without the bias: bitwise equality is ours.
            return skip("bias_zero: an external implementation is not bitwise");
        }
        let mut zero = cx.case.clone();
        zero.config.params.bias = match &cx.case.config.params.bias {
            AttnBias::PostScale(t) => AttnBias::PostScale(Arc::new(Array4::zeros(t.dim()))),
            AttnBias::Alibi(s) => AttnBias::Alibi(Arc::new(vec![0.0; s.len()])),
            AttnBias::None => return Outcome::Pass,
        };
        let mut plain = cx.case.clone();
        plain.config.bias = Bias::None;
        plain.config.params.bias = AttnBias::None;
        // Without a bias a case may be eligible for the small-seq path: both runs on the
        // path the base run took (the fallback, where a bias sends every case).
        let opts = RunOptions {
            force: cx.base.fwd.path,
            ..self.opts.clone()
        };
        let run = |c: &Case| {
            self.runner.run_pair(c, &opts).map(|p| {
                let mut o = p.outputs();
                o.dbias = None;
                o
            })
        };
        let z = match run(&zero) {
            Ok(z) => z,
            Err(e) => {
                return self.run_failed(Prop::Metamorphic, "the run with a zero bias failed", &e)
            }
        };
        let n = match run(&plain) {
            Ok(n) => n,
            Err(e) => return self.run_failed(Prop::Metamorphic, "the run without bias failed", &e),
        };
        // A backend may send every biased launch to another fallback kernel (the GPU's tiled
        // kernels leave a bias to the scalar ones): then both runs are held to the reference
        // of the case without bias, within two of its thresholds, not to each other's bits.
        let kernel = |c: &Case| self.runner.fallback_fwd_kernel(&c.config, &c.layout);
        if cx.base.fwd.path == Some(Path::Fallback) && kernel(&zero) != kernel(&plain) {
            let y = match oracle_for(&plain, cx.y.design) {
                Ok(y) => y,
                Err(e) => {
                    return self.run_failed(Prop::Metamorphic, "the unbiased case's oracle", &e)
                }
            };
            let js = y.judge(&plain, &n, true);
            return within_tolerance(
                &plain,
                &n,
                &z,
                &js,
                &y,
                |_| 2.0,
                |t, e, l| {
                    format!(
                        "a zero bias ({}) took another fallback kernel and moved {t} by \
                         {e:.3e} > {l:.3e} from no bias (two thresholds)",
                        cx.case.config.bias
                    )
                },
            );
        }
        match bitwise_diff(&n, &z) {
            None => Outcome::Pass,
            Some(d) => fail(
                Prop::Metamorphic,
                format!(
                    "a zero bias ({}) differs from no bias: {d}",
                    cx.case.config.bias
                ),
            ),
        }
    }

    /// The bias's `-inf` pattern with and without a constant per bias row.
    pub(super) fn bias_shift_relation(&self, cx: &CaseContext<'_>) -> Outcome {
        let AttnBias::PostScale(t) = &cx.case.config.params.bias else {
            return Outcome::Pass;
        };
        // Unread entries keep what they hold (NaN, +inf): still ignored.
        let pattern = t.mapv(|x| if x.is_finite() { 0.0 } else { x });
        let mut shifted = pattern.clone();
        for ((b, h, r, _), x) in shifted.indexed_iter_mut() {
            *x += shift_of(b, h, r);
        }
        let (c1, c2) = (with_tensor(cx.case, pattern), with_tensor(cx.case, shifted));
        let run = |c: &Case| self.runner.run_pair(c, &self.opts).map(|p| p.outputs());
        let a = match run(&c1) {
            Ok(a) => a,
            Err(e) => {
                let what = "the run of the bias's -inf pattern failed";
                return self.run_failed(Prop::Metamorphic, what, &e);
            }
        };
        let mut b = match run(&c2) {
            Ok(b) => b,
            Err(e) => {
                let what = "the run of the shifted bias failed";
                return self.run_failed(Prop::Metamorphic, what, &e);
            }
        };
        let y = match oracle_for(&c1, cx.y.design) {
            Ok(y) => y,
            Err(e) => return self.run_failed(Prop::Metamorphic, "the pattern's oracle", &e),
        };
        let js = y.judge(&c1, &a, true);
        // lse of the shifted run, the row's constant taken off.
        if let Some(lse) = b.lse.as_mut() {
            for row in c2.visible_rows() {
                let (bb, hb) = AttnBias::tensor_index(t, row.slot, row.head);
                let v = &mut lse[(row.token, row.head)];
                if v.is_finite() {
                    *v -= f64::from(shift_of(bb, hb, row.row));
                }
            }
        }
        within_tolerance(
            &c1,
            &a,
            &b,
            &js,
            &y,
            |_| 2.0,
            |t, e, l| {
                format!(
                    "a bias constant along each row ({}) moved {t} by {e:.3e} > {l:.3e} (two \
                     thresholds)",
                    cx.case.config.bias
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_backends::{bf16_case, HookedCpu, Judged};
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::config::{AttnConfig, BiasShape};
    use crate::mutants::{Defects, Mutant};
    use crate::runner::run_pair;
    use smallseq_reference::{Dtype, Layout, Mask};

    /// A case of two slots and two heads with a post-scale bias of `shape` (a few `-inf`).
    fn biased(shape: BiasShape) -> Case {
        let mut cfg = AttnConfig::new(Dtype::Bf16, 2, 16, Mask::Padding);
        cfg.bias = Bias::PostScale(shape);
        let layout = Layout::packed(&[(3, 4), (5, 5)]);
        let (bb, hb) = (
            if shape.per_slot() { 2 } else { 1 },
            if shape.per_head() { 2 } else { 1 },
        );
        let mut t = Array4::from_shape_fn((bb, hb, 5, 5), |(b, h, r, c)| {
            Dtype::Bf16.round(((b * 7 + h * 5 + r * 3 + c) % 9) as f32 * 0.75 - 3.0)
        });
        t[[0, 0, 1, 2]] = f32::NEG_INFINITY;
        cfg.params.bias = AttnBias::PostScale(Arc::new(t));
        let mut case = bf16_case(cfg, layout, 3);
        case.d_o = Some(case.q.mapv(|x| Dtype::Bf16.round(x * 0.5 + 0.25)));
        case
    }

    fn has_values_of(b: &AttnBias) -> bool {
        !matches!(b, AttnBias::None)
    }

    /// A backend whose biased fallback launches take a second kernel (as the GPU's scalar
    /// kernels take every bias) that scales `o` by `factor`.
    fn bias_on_another_kernel(factor: f32) -> HookedCpu {
        let mut be = HookedCpu::new();
        be.computes_bias = true;
        be.kernel_name = Some(|c, _| {
            if has_values_of(&c.params.bias) {
                "scalar"
            } else {
                "tiled"
            }
            .into()
        });
        be.after_fwd = Box::new(move |args, out| {
            if has_values_of(&args.config.params.bias) {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * factor);
                }
            }
        });
        be
    }

    #[test]
    fn a_zero_bias_on_another_kernel_is_held_to_tolerance_not_bits() {
        let case = biased(BiasShape::ALL[0]);
        let zero = |factor: f32| {
            let be = bias_on_another_kernel(factor);
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &RunOptions::default()).unwrap();
            assert_eq!(base.fwd.path, Some(Path::Fallback));
            checker.bias_zero_relation(&Judged::new(&case, base).cx(&case))
        };
        // One bf16 unit apart: another kernel's rounding, not a defect.
        assert_eq!(zero(1.0 + 1.0 / 256.0), Outcome::Pass);
        match zero(1.25) {
            Outcome::Fail(f) => {
                assert!(f.detail.contains("another fallback kernel"), "{}", f.detail)
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn both_relations_hold_on_the_cpu_for_every_broadcast_shape() {
        let be = CpuBackend::default();
        let checker = Checker::isolated(&be);
        for shape in BiasShape::ALL {
            let case = biased(shape);
            let judged = Judged::new(&case, run_pair(&be, &case, &RunOptions::default()).unwrap());
            assert_eq!(judged.numeric, Outcome::Pass, "{}", shape.name());
            let cx = judged.cx(&case);
            assert_eq!(checker.bias_zero_relation(&cx), Outcome::Pass);
            assert_eq!(checker.bias_shift_relation(&cx), Outcome::Pass);
            assert!(judged.actual.dbias.is_some());
        }
    }

    /// The planted broadcast on the wrong axis fails `numeric_agreement` on a bias that
    /// broadcasts over one axis of two slots and two heads.
    #[test]
    fn a_bias_read_on_the_wrong_axis_fails_numeric_agreement() {
        let be = CpuBackend::mutant(Defects::of(&[Mutant::BiasBroadcastWrongAxis]));
        for shape in [BiasShape::OneHss, BiasShape::BOneSs] {
            let case = biased(shape);
            let judged = Judged::new(&case, run_pair(&be, &case, &RunOptions::default()).unwrap());
            assert!(
                matches!(judged.numeric, Outcome::Fail(_)),
                "{}: {:?}",
                shape.name(),
                judged.numeric
            );
        }
    }

    /// A backend that does not compute bias refuses it with a typed error, and the checker
    /// skips such a case under `unsupported bias` without running it.
    #[test]
    fn a_backend_without_bias_refuses_it_and_its_cases_are_skipped() {
        let case = biased(BiasShape::Bhss);
        let hooked = HookedCpu::new();
        match run_pair(&hooked, &case, &RunOptions::default()) {
            Err(crate::error::Error::Unsupported(why)) => {
                assert!(why.contains("bias = post_scale_bias"), "{why}")
            }
            other => panic!("expected unsupported, got {:?}", other.map(|_| ())),
        }
        let run = Checker::isolated(&hooked).check(&case, 0).unwrap();
        let numeric = run
            .outcomes
            .iter()
            .find(|(p, _)| *p == Prop::NumericAgreement)
            .map(|(_, o)| o.clone());
        match numeric {
            Some(Outcome::Skip { reason }) => assert!(
                reason.starts_with(
                    "unsupported bias: bias = post_scale_bias: this implementation does not compute bias"
                ),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
