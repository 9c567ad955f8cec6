//! `numeric_agreement`: every output within the tolerance rule's threshold of the f64
//! reference (docs/judgement.md). Its judgements are also the yardstick of the properties
//! that compare two runs: each owes a multiple of these thresholds.

use super::verdict::{Failure, Outcome, Prop};
use super::yardstick::Yardstick;
use crate::case::{Case, Outputs};
use crate::harness::conditioning::Design;
use crate::harness::ftz::FtzAllowance;
use crate::harness::tolerance::{Judgement, Worst};

/// Judges outputs against the oracle: the `numeric_agreement` outcome and the judgements.
pub fn numeric(case: &Case, actual: &Outputs, y: &Yardstick) -> (Outcome, Vec<Judgement>) {
    let js = y.judge(case, actual, true);
    let worst = js
        .iter()
        .filter(|j| !j.passed())
        .max_by(|a, b| a.margin.total_cmp(&b.margin));
    let outcome = match worst {
        None => Outcome::Pass,
        Some(j) => Outcome::Fail(Failure {
            prop: Prop::NumericAgreement,
            detail: numeric_detail(j, y.design, y.order.ftz.as_ref()),
            worst: j.worst.clone(),
            margin: j.margin,
            range_limit: super::range_limit::range_limit(case, actual, y),
        }),
    };
    (outcome, js)
}

/// A failed tensor's line: its error against the threshold and the emulation's error, and
/// where the emulation itself is non-finite (its error leaves those elements out) or holds the
/// kernel's value at the worst element, so a limit of the kernel design does not read as a
/// kernel straying from it. Where the envelope's flush-to-zero allowance (`ftz`) of the row
/// printed is at least a tenth of the threshold printed, the line says how much of it the
/// row's elements were allowed, so a failure in the subnormal range reads as one beyond what
/// fast math can lose.
fn numeric_detail(j: &Judgement, design: Design, ftz: Option<&FtzAllowance>) -> String {
    // The figure printed is the rule that failed: where the tensor's error is inside its
    // threshold, a row of it failed the per-row rule.
    let row = j
        .row
        .as_ref()
        .filter(|r| r.margin > 1.0 && j.err <= j.threshold);
    let mut s = match row {
        Some(r) => format!(
            "{}: row (token {}, head {}) error {:.3e} > its threshold {:.3e} (row scale {:.3e}, \
             emulation error {:.3e}; the tensor's max error {:.3e} is inside its threshold \
             {:.3e}",
            j.tensor, r.token, r.head, r.err, r.threshold, r.scale, r.emu_err, j.err, j.threshold
        ),
        None => format!(
            "{}: max error {:.3e} > threshold {:.3e} (emulation error {:.3e}",
            j.tensor, j.err, j.threshold, j.emu_err
        ),
    };
    if j.emu_non_finite > 0 {
        s += &format!(
            " over its finite elements; it is non-finite at {} where the reference is finite",
            j.emu_non_finite
        );
    }
    s.push(')');
    // The row the line names: the failing row, else the worst element's.
    let at = row
        .map(|r| (r.token, r.head))
        .or_else(|| j.worst.as_ref().map(|w| (w.token, w.head)));
    let flushed = ftz
        .zip(at)
        .map_or(0.0, |(f, (t, h))| f.row_max(&j.tensor, t, h));
    // Named only where it weighed in the verdict: beside an error of inf against a threshold
    // of 2e3, a flushing allowance of 3e-35 says nothing.
    let threshold = row.map_or(j.threshold, |r| r.threshold);
    if flushed > 0.0 && flushed >= threshold / 10.0 {
        s += &format!(
            "; flush-to-zero allowance used: up to {flushed:.3e} per element of this row for \
             f32 intermediates below 2^-126 flushed to zero"
        );
    }
    if j.worst.as_ref().is_some_and(Worst::design_shares) {
        s += match design {
            Design::Project | Design::ProjectDFromO => {
                "; the emulation holds the same value at the worst element: the kernel follows \
                 its design, and the design loses the value there"
            }
            Design::Envelope => {
                "; smallseq's emulation holds the same value at the worst element (the \
                 implementation declared no design, so no design limit is claimed)"
            }
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::tolerance::RowVerdict;

    fn judgement(err: f64, threshold: f64, row_margin: f64, shares: bool) -> Judgement {
        Judgement {
            tensor: "dv".into(),
            err,
            emu_err: 1e-4,
            threshold,
            margin: row_margin.max(err / threshold),
            worst: Some(Worst {
                tensor: "dv".into(),
                token: 3,
                head: 1,
                dim: Some(0),
                value: 2.0,
                expected: 1.0,
                emulated: if shares { 2.0 } else { 1.0 },
            }),
            row: Some(RowVerdict {
                token: 5,
                head: 2,
                scale: 0.25,
                err: 0.01,
                emu_err: 1e-5,
                threshold: 0.01 / row_margin,
                margin: row_margin,
            }),
            blind: false,
            emu_non_finite: 0,
            indeterminate: false,
        }
    }

    #[test]
    fn a_row_rule_failure_prints_the_rows_figures_not_the_passing_tensors() {
        // Issue 31: "dv: max error 1.507e-2 > threshold 1.385e-1 … margin 34.70".
        let d = numeric_detail(
            &judgement(1.507e-2, 1.385e-1, 34.7, false),
            Design::Project,
            None,
        );
        assert!(
            d.starts_with("dv: row (token 5, head 2) error 1.000e-2 > its threshold 2.882e-4"),
            "{d}"
        );
        assert!(d.contains("inside its threshold 1.385e-1"), "{d}");
        let d = numeric_detail(&judgement(0.5, 0.1, 2.0, false), Design::Project, None);
        assert!(
            d.starts_with("dv: max error 5.000e-1 > threshold 1.000e-1"),
            "{d}"
        );
    }

    #[test]
    fn only_the_projects_design_is_told_it_meets_a_limit_of_its_design() {
        let j = judgement(0.5, 0.1, 2.0, true);
        assert!(numeric_detail(&j, Design::Project, None).contains("the kernel follows its design"));
        let d = numeric_detail(&j, Design::Envelope, None);
        assert!(!d.contains("follows its design"), "{d}");
        assert!(d.contains("declared no design"), "{d}");
    }

    mod flush_to_zero {
        use crate::case::{Case, Outputs};
        use crate::harness::conditioning::Design;
        use crate::harness::ftz::tests::flushing_case;
        use crate::harness::props::{numeric, oracle_for, Outcome};
        use ndarray::Array3;

        /// What a correct kernel built with flush-to-zero returns: the f64 reference rounded to
        /// f32, with every value that P_1 alone carries flushed to zero.
        fn flushed_outputs(c: &Case) -> Outputs {
            let y = oracle_for(c, Design::Envelope).unwrap();
            let f32s = |a: &Array3<f64>| a.mapv(|x| f64::from(x as f32));
            let mut out = Outputs {
                o: y.reference.o.as_ref().map(f32s),
                lse: y
                    .reference
                    .lse
                    .as_ref()
                    .map(|a| a.mapv(|x| f64::from(x as f32))),
                dq: y.reference.dq.as_ref().map(f32s),
                dk: y.reference.dk.as_ref().map(f32s),
                dv: y.reference.dv.as_ref().map(f32s),
                dbias: None,
            };
            let reference = y.reference.dk.as_ref().unwrap();
            assert!(
                reference[(1, 0, 0)].abs() > 1e-37 && reference[(1, 0, 0)].abs() < 1e-35,
                "the flushed dK row is {:e}",
                reference[(1, 0, 0)]
            );
            out.dq.as_mut().unwrap()[(0, 0, 0)] = 0.0;
            out.dk.as_mut().unwrap()[(1, 0, 0)] = 0.0;
            out.dv.as_mut().unwrap()[(1, 0, 0)] = 0.0;
            out
        }

        fn verdict(c: &Case, out: &Outputs, design: Design) -> Outcome {
            numeric(c, out, &oracle_for(c, design).unwrap()).0
        }

        #[test]
        fn a_row_flush_to_zero_zeroes_passes_the_envelope_and_fails_the_project_design() {
            let c = flushing_case();
            let out = flushed_outputs(&c);
            assert!(
                matches!(verdict(&c, &out, Design::Envelope), Outcome::Pass),
                "{:?}",
                verdict(&c, &out, Design::Envelope)
            );
            match verdict(&c, &out, Design::Project) {
                Outcome::Fail(f) => assert!(!f.detail.contains("flush-to-zero"), "{}", f.detail),
                other => panic!("the project's design keeps subnormals: {other:?}"),
            }
        }

        #[test]
        fn an_error_far_above_what_flushing_loses_still_fails_and_says_so() {
            let c = flushing_case();
            let mut out = flushed_outputs(&c);
            // 1e-33 is above a thousand times anything the row's f32 terms can flush.
            out.dk.as_mut().unwrap()[(1, 0, 0)] = -1e-33;
            match verdict(&c, &out, Design::Envelope) {
                Outcome::Fail(f) => {
                    // Both of dK's rows are tiny here, so the tensor rule is the one that fails.
                    assert!(f.detail.starts_with("dk: max error 9.99"), "{}", f.detail);
                    assert!(
                        f.detail.contains("flush-to-zero allowance used"),
                        "{}",
                        f.detail
                    );
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
