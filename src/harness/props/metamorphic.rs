//! `metamorphic`: relations between the main run and runs of transformed cases, which catch
//! a kernel that is wrong the same way the reference cannot tell (a slot's rows leaking into
//! another's, a head mapping off by a group). Reversing the slots and splitting the batch
//! must leave each slot's rows unchanged; a GQA case must agree with its MHA equivalent; and
//! scaling V (and dO) by 2 must scale the outputs exactly (`super::scale`); dropout at
//! `p = 0` must be no dropout (`super::dropout`, which also keeps a split's mask); a zero
//! bias must be no bias and a bias constant along each row must change nothing but lse
//! (`super::score_bias`).

use super::checker::{CaseContext, Checker};
use super::dropout::{keep_mask, mask_follows_slots, zero_p_with_seed};
use super::relation::{bitwise_diff, mask_dont_care, scatter_rows, within_tolerance};
use super::score_bias;
use super::verdict::{fail, skip, Outcome, Prop};
use crate::case::{Case, Outputs};
use crate::dispatch::Path;
use crate::harness::transform::{repeat_kv, select_slots};
use crate::runner::Pair;

/// Metamorphic relations run per case (each applicable one on every case: `usize::MAX`).
/// All four on every case cost the CPU campaign 24 % of its throughput (120 cases, seed 42, in
/// the same minutes: 41.2 s against 33.3 s), which would take it below its 55 cases/s floor
/// at idle (55.7 before): so one per case, rotating with the case's salt. Each applicable
/// relation runs on 1/n of the cases it applies to (n ≤ 4), and any n consecutive salts run
/// every one of them (`the_rotation_runs_every_relation_over_n_salts`).
pub const METAMORPHIC_PER_CASE: usize = 1;

/// The metamorphic relations a case of `slots` slots (with GQA or not) runs under `salt`:
/// [`METAMORPHIC_PER_CASE`] of the applicable ones, rotating from the one the salt draws.
/// `dropout`: the case's mask follows its slot order (no "permute"), or it is `p = 0` with a
/// seed (the "dropout_zero" relation applies). `bias`: the case has bias values (the
/// "bias_zero" relation applies), and a post-scale bias ("bias_shift").
fn chosen_relations(
    slots: usize,
    gqa: bool,
    (dropout, bias): ((bool, bool), (bool, bool)),
    salt: u64,
) -> Vec<&'static str> {
    let (follows_slots, zero_p) = dropout;
    let (bias_values, bias_tensor) = bias;
    let relations: Vec<&str> = [
        (slots >= 2 && !follows_slots).then_some("permute"),
        (slots >= 2).then_some("split"),
        gqa.then_some("gqa"),
        Some("scale"),
        zero_p.then_some("dropout_zero"),
        bias_values.then_some("bias_zero"),
        bias_tensor.then_some("bias_shift"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let n = relations.len();
    let first = (salt % n as u64) as usize;
    (0..n.min(METAMORPHIC_PER_CASE))
        .map(|i| relations[(first + i) % n])
        .collect()
}

impl Checker<'_> {
    pub(super) fn metamorphic(&self, cx: &CaseContext<'_>) -> Outcome {
        let case = cx.case;
        let b = case.layout.slots();
        let gqa = case.config.params.num_heads != case.config.params.num_kv_heads;
        // The first failure is the verdict; a skip only where every relation run skipped.
        let dropout = (mask_follows_slots(case), zero_p_with_seed(case));
        let bias = (score_bias::has_values(case), score_bias::shiftable(case));
        let run = chosen_relations(b, gqa, (dropout, bias), cx.salt);
        let relation_count = run.len();
        let mut skipped = Vec::new();
        for rel in run {
            let outcome = match rel {
                "permute" => {
                    let order: Vec<usize> = (0..b).rev().collect();
                    let parts = [order];
                    self.slot_relation(cx, &parts, "reversing the slots")
                }
                "split" => {
                    let cut = b / 2;
                    let parts = [(0..cut).collect(), (cut..b).collect()];
                    let what = "splitting the batch in two launches";
                    self.slot_relation(cx, &parts, what)
                }
                "gqa" => self.gqa_relation(cx),
                "dropout_zero" => self.dropout_zero_relation(cx),
                "bias_zero" => self.bias_zero_relation(cx),
                "bias_shift" => self.bias_shift_relation(cx),
                _ => self.scale_relation(cx),
            };
            match outcome {
                Outcome::Fail(f) => return Outcome::Fail(f),
                Outcome::Skip { reason } => skipped.push(reason),
                Outcome::Pass => {}
            }
        }
        if skipped.len() == relation_count {
            skip(skipped.join("; "))
        } else {
            Outcome::Pass
        }
    }

    /// Runs `parts` (slot subsets) as separate launches; their outputs must equal the
    /// corresponding rows of the base run bitwise when the path (and the fallback kernel) is
    /// unchanged, and be within the sum of two thresholds of it otherwise (each path is
    /// within one threshold of the reference).
    pub(super) fn slot_relation(
        &self,
        cx: &CaseContext<'_>,
        parts: &[Vec<usize>],
        what: &str,
    ) -> Outcome {
        let (case, base, js, y) = (cx.case, cx.base, cx.judgements, cx.y);
        // Rows the implementation declares to hold something other than the semantics' zeros
        // carry no promise, and may depend on the launch's batch (JAX XLA averages V over
        // the whole padded key length there): compared as declared, on both sides.
        let declared = self.no_key_rows_as_declared(case, cx.actual);
        let actual = declared.as_ref().unwrap_or(cx.actual);
        for order in parts {
            let (sub, rows_q, rows_k) = select_slots(case, order, true);
            let Some(sub) = keep_mask(case, order, sub) else {
                return skip(format!("{what}: the dropout mask follows the slot order"));
            };
            let p = match self.runner.run_pair(&sub, &self.opts) {
                Ok(p) => p,
                Err(e) => {
                    return self.run_failed(Prop::Metamorphic, &format!("{what}: run failed"), &e)
                }
            };
            let kernel = |c: &Case| self.runner.fallback_fwd_kernel(&c.config, &c.layout);
            let bwd_path = |p: &Pair| p.bwd.as_ref().map(|b| b.path);
            let changed = if p.fwd.path != base.fwd.path || bwd_path(&p) != bwd_path(base) {
                Some("the path")
            } else if (p.fwd.path == Some(Path::Fallback)
                || bwd_path(&p) == Some(Some(Path::Fallback)))
                && kernel(&sub) != kernel(case)
            {
                Some("the fallback kernel")
            } else if self.runner.external() {
                // A framework may pick another kernel or GEMM blocking for another batch
                // (PyTorch's math path sums in another order): bitwise equality is ours alone.
                Some("the batch an external implementation sees")
            } else {
                None
            };
            let pick3 = |t: &Option<ndarray::Array3<f64>>, rows: &[usize]| {
                t.as_ref().map(|t| t.select(ndarray::Axis(0), rows))
            };
            let want = Outputs {
                o: pick3(&actual.o, &rows_q),
                lse: actual
                    .lse
                    .as_ref()
                    .map(|t| t.select(ndarray::Axis(0), &rows_q)),
                dq: pick3(&actual.dq, &rows_q),
                dk: pick3(&actual.dk, &rows_k),
                dv: pick3(&actual.dv, &rows_k),
                // A launch of some slots sums dBias over those alone.
                dbias: None,
            };
            let mut got = p.outputs();
            got.dbias = None;
            if let Some(d) = self.no_key_rows_as_declared(&sub, &got) {
                got = d;
            }
            mask_dont_care(&sub, &mut got, &want);
            if let Some(changed) = changed {
                let full = scatter_rows(actual, &got, &rows_q, &rows_k);
                let o = within_tolerance(
                    case,
                    actual,
                    &full,
                    js,
                    y,
                    |_| 2.0,
                    |t, e, l| {
                        format!(
                        "{what} changed {changed}, and {t} of the launches differs from the base \
                         run by {e:.3e} > {l:.3e} (two thresholds)"
                    )
                    },
                );
                if matches!(o, Outcome::Fail(_)) {
                    return o;
                }
            } else if let Some(d) = bitwise_diff(&want, &got) {
                return fail(
                    Prop::Metamorphic,
                    format!("{what} changed a valid output: {d}"),
                );
            }
        }
        Outcome::Pass
    }

    pub(super) fn gqa_relation(&self, cx: &CaseContext<'_>) -> Outcome {
        let (case, base, actual, js, y) = (cx.case, cx.base, cx.actual, cx.judgements, cx.y);
        let mha = repeat_kv(case);
        let p = match self.runner.run_pair(&mha, &self.opts) {
            Ok(p) => p,
            Err(e) => return self.run_failed(Prop::Metamorphic, "MHA equivalent failed", &e),
        };
        let m = p.outputs();
        let g = case.config.params.group_size();
        let sum_group = |t: &Option<ndarray::Array3<f64>>| {
            t.as_ref().map(|t| {
                let (tk, h, d) = t.dim();
                ndarray::Array3::from_shape_fn((tk, h / g, d), |(x, y, z)| {
                    (0..g).map(|j| t[(x, y * g + j, z)]).sum()
                })
            })
        };
        let summed = Outputs {
            o: m.o.clone(),
            lse: m.lse.clone(),
            dq: m.dq.clone(),
            dk: sum_group(&m.dk),
            dv: sum_group(&m.dv),
            dbias: m.dbias.clone(),
        };
        // Summing the group before or after rounding decides whether a value next to the
        // dtype's limit overflows; such cases say nothing about the relation.
        let limit = f64::from(case.config.dtype.max_finite()) / 2.0;
        let near_overflow = |o: &Outputs| {
            [&o.dk, &o.dv]
                .into_iter()
                .flatten()
                .any(|t| t.iter().any(|x| x.abs() > limit))
        };
        if near_overflow(actual) || near_overflow(&summed) {
            return skip("dK/dV next to the dtype's overflow");
        }
        // Both sides are within tolerance of the reference; summing dK/dV over the group adds
        // at most g roundings of the MHA side. o, lse and dq are never summed: on the same
        // path they owe one threshold (the same arithmetic per row), on another path two
        // (each within one of the reference).
        let same_path = p.fwd.path == base.fwd.path
            && p.bwd.as_ref().map(|b| b.path) == base.bwd.as_ref().map(|b| b.path);
        let factor = |t: &str| match t {
            "dk" | "dv" => 1.0 + g as f64,
            _ if same_path => 1.0,
            _ => 2.0,
        };
        within_tolerance(case, actual, &summed, js, y, factor, |t, e, l| {
            format!("GQA vs MHA with repeated K/V: {t} differs by {e:.3e} > {l:.3e}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_backends::{bf16_case, HookedCpu, Judged};
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::config::AttnConfig;
    use crate::dispatch::gate::Dispatcher;
    use crate::error::Result;
    use crate::runner::{run_pair, Caps, InProcess, NoKeyRow, Runner};
    use crate::wrapper::{BwdResult, RunOptions};
    use ndarray::Array3;
    use smallseq_reference::{Dtype, Layout, Mask};
    use std::collections::BTreeMap;

    /// A second fallback forward kernel, as CUDA and HIP have: launches whose longest query
    /// side reaches 3 take it, and it rounds `o` differently; `names_kernel`: whether the
    /// backend says which kernel a launch takes.
    fn two_fallback_kernels(names_kernel: bool) -> HookedCpu {
        let mut be = HookedCpu::new();
        if names_kernel {
            be.kernel_name = Some(|_, l| {
                if l.q.max_len() >= 3 {
                    "tiled"
                } else {
                    "scalar"
                }
                .into()
            });
        }
        be.after_fwd = Box::new(|args, out| {
            if args.layout.q.max_len() >= 3 {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * (1.0 + 1.0 / 64.0));
                }
            }
        });
        be
    }

    #[test]
    fn slot_relations_compare_only_launches_of_one_fallback_kernel() {
        // Head dim 32: the fallback path. The first half has 5 queries (the "tiled" kernel),
        // the second 1 (the "scalar" one), the whole batch 5.
        let layout = Layout::packed(&[(5, 5), (1, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 32, Mask::Padding);
        let case = bf16_case(cfg, layout, 7);
        let split = |names_kernel| {
            let be = two_fallback_kernels(names_kernel);
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::Fallback));
            let parts = [vec![0], vec![1]];
            let judged = Judged::new(&case, base);
            checker.slot_relation(&judged.cx(&case), &parts, "splitting")
        };
        // Unnamed, the second launch's other kernel reads as a changed output; named, the
        // launch is compared to tolerance (two thresholds) instead of bitwise.
        assert!(matches!(split(false), Outcome::Fail(_)));
        assert_eq!(split(true), Outcome::Pass);
    }

    /// An external implementation that declares `no_key_row: other` and writes, in a row with
    /// no visible key, 1 / (the launch's longest key side): like JAX XLA, whose such rows
    /// average V over the whole padded key length, so they change when a batch is split.
    struct LaunchDependentNoKeyRows<'a> {
        inner: InProcess<'a>,
        caps: Caps,
    }

    impl Runner for LaunchDependentNoKeyRows<'_> {
        fn name(&self) -> &str {
            "launch-dependent"
        }
        fn caps(&self) -> &Caps {
            &self.caps
        }
        fn provenance(&self) -> BTreeMap<String, String> {
            BTreeMap::new()
        }
        fn dispatcher(&self, _: &RunOptions) -> Option<Dispatcher> {
            None
        }
        fn rounding_budget(&self, _: &str) -> Option<f64> {
            None
        }
        fn fallback_fwd_kernel(&self, _: &AttnConfig, _: &Layout) -> Option<String> {
            None
        }
        fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
            let mut p = self.inner.run_pair(case, opts)?;
            let fill = 1.0 / case.layout.kv.max_len() as f32;
            for (t, h) in case.no_key_rows() {
                p.fwd.o.slice_mut(ndarray::s![t, h, ..]).fill(fill);
            }
            Ok(p)
        }
        fn run_bwd_from(
            &self,
            case: &Case,
            o: &Array3<f32>,
            lse: &ndarray::Array2<f32>,
            opts: &RunOptions,
        ) -> Result<BwdResult> {
            self.inner.run_bwd_from(case, o, lse, opts)
        }
        fn external(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_split_compares_rows_without_keys_as_the_implementation_declares_them() {
        // Slot 0: 3 queries, 1 key, bottom-right causal: rows 0 and 1 see no key. The whole
        // batch's longest key side is 6, the first half's 1 (JAX XLA seed 17, cases 31, 42:
        // `o[0, 0, 0]` exactly 2x off after a split).
        let layout = Layout::packed(&[(3, 1), (4, 6)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 8, Mask::CausalBottomRight);
        let case = bf16_case(cfg, layout, 5);
        let cpu = CpuBackend::default();
        let split = |declared: NoKeyRow| {
            let inner = InProcess::new(&cpu);
            let mut caps = inner.caps().clone();
            caps.no_key_row = declared;
            let checker = Checker::new(
                Box::new(LaunchDependentNoKeyRows { inner, caps }),
                Checker::isolated(&cpu).opts,
            );
            let base = checker.runner.run_pair(&case, &checker.opts).unwrap();
            let judged = Judged::new(&case, base);
            let parts = [vec![0], vec![1]];
            checker.slot_relation(&judged.cx(&case), &parts, "splitting")
        };
        assert_eq!(split(NoKeyRow::Other), Outcome::Pass);
        // Declared as zeros, the same rows are wrong values, and the split shows it.
        assert!(matches!(split(NoKeyRow::Zero), Outcome::Fail(_)));
    }

    #[test]
    fn a_launch_on_another_kernel_is_compared_to_tolerance_not_skipped() {
        // The tiled kernel 25 % off: the base run (5 queries) and the one-slot launch of 5
        // queries carry it, the launch of 1 query does not; the difference is far beyond two
        // thresholds.
        let layout = Layout::packed(&[(5, 5), (1, 4)]);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 32, Mask::Padding);
        let case = bf16_case(cfg, layout, 7);
        let mut be = two_fallback_kernels(true);
        be.after_fwd = Box::new(|args, out| {
            if args.layout.q.max_len() >= 3 {
                for x in out.o.body_mut() {
                    *x = Dtype::Bf16.round(*x * 1.25);
                }
            }
        });
        let checker = Checker::isolated(&be);
        let judged = Judged::new(&case, run_pair(&be, &case, &checker.opts).unwrap());
        let parts = [vec![0], vec![1]];
        match checker.slot_relation(&judged.cx(&case), &parts, "splitting") {
            Outcome::Fail(f) => assert!(f.detail.contains("fallback kernel"), "{}", f.detail),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn the_rotation_runs_every_relation_over_n_salts() {
        let none = ((false, false), (false, false));
        for (slots, gqa, dropout, n) in [
            (3, true, none, 4),
            (2, false, none, 3),
            (1, true, none, 2),
            (1, false, none, 1),
            // A mask that follows the slots: no reversal; p = 0 with a seed: one more.
            (3, true, ((true, false), (false, false)), 3),
            (2, false, ((false, true), (false, false)), 4),
            // Bias values: one more; a post-scale tensor: two.
            (1, false, ((false, false), (true, false)), 2),
            (2, true, ((false, false), (true, true)), 6),
        ] {
            let mut seen: Vec<&str> = (0..n as u64)
                .flat_map(|salt| chosen_relations(slots, gqa, dropout, salt))
                .collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), n, "{slots} slots, gqa {gqa}: {seen:?}");
            assert_eq!(
                chosen_relations(slots, gqa, dropout, 7).len(),
                METAMORPHIC_PER_CASE.min(n)
            );
        }
    }

    #[test]
    fn the_gqa_relation_allows_the_group_sum_only_on_summed_tensors() {
        // H = 2 on one kv head (g = 2), head dim 32: every run on the fallback path. The MHA
        // equivalent's O is `off` high; O is never summed over the group, so it owes one
        // threshold, not 1 + g.
        let layout = Layout::packed(&[(3, 3)]);
        let mut cfg = AttnConfig::new(Dtype::Bf16, 2, 32, Mask::Padding);
        cfg.params.num_kv_heads = 1;
        let case = bf16_case(cfg, layout, 5);
        let verdict = |off: f32| {
            let mut be = HookedCpu::new();
            be.after_fwd = Box::new(move |args, out| {
                let p = &args.config.params;
                if p.num_heads == p.num_kv_heads {
                    for x in out.o.body_mut() {
                        *x = Dtype::Bf16.round(*x * (1.0 + off));
                    }
                }
            });
            let checker = Checker::isolated(&be);
            let base = run_pair(&be, &case, &checker.opts).unwrap();
            assert_eq!(base.fwd.path, Some(Path::Fallback));
            checker.gqa_relation(&Judged::new(&case, base).cx(&case))
        };
        assert_eq!(verdict(0.0), Outcome::Pass);
        // About 1.5 thresholds off: within the (1 + g) = 3 once allowed, beyond the one owed.
        match verdict(0.05) {
            Outcome::Fail(f) => {
                assert!(f.detail.contains("o differs"), "{}", f.detail);
                assert!(
                    f.margin < 3.0,
                    "margin {} (the old rule passed it)",
                    f.margin
                );
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
}
