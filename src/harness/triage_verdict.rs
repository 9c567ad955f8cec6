//! One of three verdicts on a triage group's representative, with its evidence: a defect of
//! the implementation (and the clause of docs/semantics.md it breaks), a design or range
//! limit (and what reproduces it), or a harness error (the reference, the case or the replay is
//! at fault, not the implementation). The order of the tests is the order of trust: a case
//! outside the semantics or without a finite reference says nothing about the implementation;
//! a failure that does not come back on replay is not one to send upstream; one that
//! smallseq's emulation shares is the design's. `determinism` is the exception to "one
//! replay": a run-order difference comes on some reruns only, so its representative is
//! rerun until one differs ([`DETERMINISM_RERUNS`]), and a difference in outputs the
//! implementation declares nondeterministic is its design.

use super::props::{numeric, oracle, Checker, Outcome, Reruns};
use super::repro::{judge_stored, judged_from_stored};
use super::triage::Signature;
use super::triage_keys::one_key_off;
use crate::case::Case;
use serde::Serialize;

/// The three verdicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Defect,
    DesignOrRangeLimit,
    HarnessError,
    /// Triage stopped (its `--time`, or a signal) before the group was reached: no verdict.
    NotTriaged,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Defect => "defect",
            Verdict::DesignOrRangeLimit => "design or range limit",
            Verdict::HarnessError => "harness error",
            Verdict::NotTriaged => "not triaged (time)",
        }
    }
}

/// A verdict with what it rests on.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub verdict: Verdict,
    /// For a defect: the clause it breaks.
    pub clause: Option<String>,
    pub evidence: Vec<String>,
}

/// A backend to rerun the representative on, as the campaign ran it.
pub struct Replay<'r, 'c> {
    pub checker: &'r Checker<'c>,
    pub salt: u64,
    /// How it is named in the evidence ("the cpu backend with scale-twice planted").
    pub through: String,
}

/// How many reruns a `determinism` representative gets before its failure is called
/// irreproducible. A run-order race differs on some reruns and not on others: one passing
/// replay proves nothing (an H200 campaign of PyTorch's memory-efficient kernel: dQ differed
/// in 10 cases, and the one replay of its representative was bitwise equal).
pub const DETERMINISM_RERUNS: usize = 8;

/// The clause of docs/semantics.md (or, for what it does not define, the document that does)
/// that a failure of `property` on `tensor` breaks, with the case's mask and dropout where
/// they shape the clause.
pub fn clause(property: &str, tensor: &str, detail: &str, case: &Case) -> String {
    let p = &case.config.params;
    let equations = match tensor {
        "lse" => "docs/semantics.md §1.4 The LSE convention",
        "dq" | "dk" | "dv" => "docs/semantics.md §1.7 Backward",
        _ => "docs/semantics.md §1.2 Forward",
    };
    let mut c = match property {
        "numeric_agreement" => equations.to_string(),
        "fallback_equivalence" => format!(
            "docs/semantics.md §3.3 Both profiles (either path, and a mixed pair, computes §1), \
             here {}",
            equations.trim_start_matches("docs/semantics.md ")
        ),
        "dont_care" => "docs/semantics.md §1.6 Don't-care tokens".into(),
        "workspace" => "docs/semantics.md §3.3 Both profiles (the workspace sized and launched \
                        under different variables)"
            .into(),
        "eligibility" => match case.meta.get("smallseq.profile").map(String::as_str) {
            Some("te625") => "docs/semantics.md §3.2 Profile te625".into(),
            _ => "docs/semantics.md §3.1 Profile native".into(),
        },
        "metamorphic" if detail.contains("GQA") => {
            "docs/semantics.md §1.1 Tensors and the THD layout (a KV head serves its group of \
             query heads)"
                .into()
        }
        "metamorphic" if detail.contains("dropout") => "docs/semantics.md §1.8 Dropout".into(),
        "metamorphic" if detail.contains("scaling") => format!(
            "{equations} (the outputs are linear in V and dO, and a power of two commutes with \
             rounding)"
        ),
        "metamorphic" => "docs/semantics.md §1.1 Tensors and the THD layout (each slot is an \
                          attention of its own: its rows depend on its tokens alone)"
            .into(),
        "determinism" => "docs/harness.md, determinism (a rerun stores the same bits; \
                          docs/semantics.md defines the values, not their repeatability)"
            .into(),
        "emulation_conformance" | "rounding_bias" => format!(
            "docs/judgement.md, {property} (conformance to the design's emulation, beyond \
             docs/semantics.md's equations)"
        ),
        "crash" | "hang" => "docs/worker-protocol.md (every request gets a reply; \
                             docs/semantics.md does not cover a worker that dies)"
            .into(),
        other => format!("docs/harness.md, {other}"),
    };
    if matches!(property, "numeric_agreement" | "fallback_equivalence") {
        if !matches!(p.mask.name(), "no_mask" | "padding") {
            c += &format!(", under the mask {} of §1.5", p.mask.name());
        }
        if p.dropout.p > 0.0 {
            c += &format!(", with dropout p = {} of §1.8", p.dropout.p);
        }
    }
    c
}

fn finding(verdict: Verdict, clause: Option<String>, evidence: Vec<String>) -> Finding {
    Finding {
        verdict,
        clause,
        evidence,
    }
}

/// The verdict on `case`, the representative of a group of `sig` whose recorded detail is
/// `detail`; `replay` reruns it where the recorded backend is at hand, else `not_replayed`
/// says why not.
pub fn judge(
    sig: &Signature,
    detail: &str,
    case: &Case,
    replay: Option<&Replay>,
    not_replayed: &str,
) -> Finding {
    let mut ev = vec![format!("recorded: {}: {detail}", sig.property)];
    if sig.range_limit {
        ev.push(
            "smallseq's emulation (P and dS rounded to the dtype) holds the same out-of-range \
             values, and with them set to the reference the outputs pass"
                .into(),
        );
        return finding(Verdict::DesignOrRangeLimit, None, ev);
    }
    if matches!(sig.property.as_str(), "crash" | "hang") {
        let clause = Some(clause(&sig.property, "-", detail, case));
        let Some(r) = replay else {
            ev.push(format!("not rerun: {not_replayed}"));
            return finding(Verdict::Defect, clause, ev);
        };
        return match r.checker.check(case, r.salt) {
            Ok(run) => match run.fault {
                Some(f) => {
                    ev.push(format!(
                        "rerun through {}: it {} again: {}",
                        r.through,
                        f.kind.past(),
                        f.detail
                    ));
                    finding(Verdict::Defect, clause, ev)
                }
                None => {
                    ev.push(format!(
                        "rerun through {}: no fault this time (irreproducible)",
                        r.through
                    ));
                    finding(Verdict::HarnessError, None, ev)
                }
            },
            Err(e) => {
                ev.push(format!("rerun through {} could not run: {e}", r.through));
                finding(Verdict::HarnessError, None, ev)
            }
        };
    }
    if let Err(e) = case.validate() {
        ev.push(format!(
            "the case violates the preconditions of docs/semantics.md §1.1: {e}"
        ));
        return finding(Verdict::HarnessError, None, ev);
    }
    let y = match oracle(case) {
        Ok(y) => y,
        Err(e) => {
            ev.push(format!("the f64 reference cannot be computed: {e}"));
            return finding(Verdict::HarnessError, None, ev);
        }
    };
    // lse is -inf on a row without keys by §1.4; the other outputs are finite for finite
    // inputs, so a non-finite one is the reference's own failure.
    let bad: Vec<String> = (y.reference.rows3().into_iter())
        .filter_map(|(name, t)| {
            let n = t?.iter().filter(|x| !x.is_finite()).count();
            (n > 0).then(|| format!("{name} at {n} element(s)"))
        })
        .collect();
    if !bad.is_empty() {
        ev.push(format!(
            "the f64 reference itself is non-finite ({}): there is nothing to measure against",
            bad.join(", ")
        ));
        return finding(Verdict::HarnessError, None, ev);
    }
    if let (Some(r), "determinism") = (replay, sig.property.as_str()) {
        return match r.checker.rerun_determinism(case, DETERMINISM_RERUNS) {
            Ok(reruns) => determinism_finding(sig, detail, case, r, &reruns, ev),
            Err(e) => {
                ev.push(format!(
                    "the replay through {} could not run: {e}",
                    r.through
                ));
                finding(Verdict::HarnessError, None, ev)
            }
        };
    }
    match replay {
        Some(r) => match r.checker.check(case, r.salt) {
            Err(e) => {
                ev.push(format!(
                    "the replay through {} could not run: {e}",
                    r.through
                ));
                return finding(Verdict::HarnessError, None, ev);
            }
            Ok(run) => {
                let again = run.outcomes.iter().find_map(|(p, o)| match o {
                    Outcome::Fail(f) if p.name() == sig.property => Some(f.clone()),
                    _ => None,
                });
                let Some(f) = again else {
                    ev.push(format!(
                        "replayed through {}: {} passes (irreproducible: a flaky verdict, or \
                         a capsule written by another build or device)",
                        r.through, sig.property
                    ));
                    return finding(Verdict::HarnessError, None, ev);
                };
                if let Some(what) = &f.range_limit {
                    ev.push(format!("replayed through {}: {what}", r.through));
                    return finding(Verdict::DesignOrRangeLimit, None, ev);
                }
                ev.push(format!(
                    "replayed through {}: {} fails again: {}",
                    r.through, sig.property, f.detail
                ));
            }
        },
        None => {
            ev.push(format!("not replayed: {not_replayed}"));
            if judged_from_stored(&sig.property) {
                match judge_stored(case) {
                    Ok(d) if !d.failed => {
                        ev.push(
                            "re-judged here, the stored outputs pass: the verdict came from \
                             another judge (another build of smallseq)"
                                .into(),
                        );
                        return finding(Verdict::HarnessError, None, ev);
                    }
                    Ok(_) => ev.push("re-judged here, the stored outputs fail again".into()),
                    Err(e) => ev.push(format!("the stored outputs cannot be re-judged: {e}")),
                }
            }
        }
    }
    if sig.property == "numeric_agreement" {
        if let (Outcome::Fail(f), _) = numeric(case, &y.emulated, &y) {
            if f.worst.as_ref().is_some_and(|w| w.tensor == sig.tensor) {
                ev.push(format!(
                    "smallseq's emulation of its small-seq design (smallseq_reference::emulate: \
                     P and dS rounded to the dtype, f32 accumulation) fails the same way: {}",
                    f.detail
                ));
                return finding(Verdict::DesignOrRangeLimit, None, ev);
            }
        }
        if let (Outcome::Fail(f), _) = numeric(case, &case.outputs, &y) {
            if let Some(w) = f.worst.as_ref().filter(|w| w.tensor == sig.tensor) {
                if let Some(line) = no_key_evidence(case, &w.tensor, w.token, w.head) {
                    ev.push(line);
                    if matches!(w.tensor.as_str(), "o" | "lse" | "dq") {
                        let c = format!(
                            "docs/semantics.md §1.3 A row with no visible key (o = 0, lse = −∞, \
                             nothing in the gradients), {}",
                            clause(&sig.property, &sig.tensor, detail, case)
                                .trim_start_matches("docs/semantics.md ")
                        );
                        return finding(Verdict::Defect, Some(c), ev);
                    }
                }
                // A stored LSE that is the reference's with one key flipped names the key
                // (its O follows from the same P).
                if matches!(w.tensor.as_str(), "o" | "lse") {
                    if let Some(line) = one_key_off(case, w.token, w.head) {
                        ev.push(line);
                        let c = format!(
                            "docs/semantics.md §1.5 Masks and windows (which keys a row sees), {}",
                            clause(&sig.property, &sig.tensor, detail, case)
                                .trim_start_matches("docs/semantics.md ")
                        );
                        return finding(Verdict::Defect, Some(c), ev);
                    }
                }
                if w.design_shares() {
                    ev.push(format!(
                        "the stored {} holds the value of smallseq's emulation at its worst \
                         element (token {}, head {}: {} where the reference is {}): the design \
                         emulated there loses the value",
                        w.tensor, w.token, w.head, w.value, w.expected
                    ));
                    return finding(Verdict::DesignOrRangeLimit, None, ev);
                }
            }
        }
        ev.push("smallseq's emulation does not reproduce it".into());
    }
    let c = clause(&sig.property, &sig.tensor, detail, case);
    finding(Verdict::Defect, Some(c), ev)
}

/// Rows that see no key (§1.3) are where implementations most often depart from the
/// semantics (cuDNN SDPA lets their dO into dK and dV, FINDINGS.md item 4): a line of evidence
/// where the case has such rows, saying whether the worst element of `tensor` lies in one
/// (o, lse, dq: row `(token, head)`) or which rows' dO a dK or dV may have taken in.
fn no_key_evidence(case: &Case, tensor: &str, token: usize, head: usize) -> Option<String> {
    let rows = case.no_key_rows();
    if rows.is_empty() {
        return None;
    }
    let n = rows.len();
    match tensor {
        "o" | "lse" | "dq" if rows.contains(&(token, head)) => Some(format!(
            "the worst element (token {token}, head {head}) lies in a row that sees no key, one \
             of {n} in the case: §1.3 holds it at o = 0, lse = −∞, dq = 0"
        )),
        "dk" | "dv" => Some(format!(
            "the case has {n} row(s) that see no key; by §1.3 their dO adds nothing to dK or dV, \
             and an implementation that gives them a nonzero P lets it in"
        )),
        _ => None,
    }
}

/// The verdict on a determinism group from its reruns: none differed, a harness error; only
/// outputs the implementation declares nondeterministic differed, within tolerance, a design
/// limit; anything else, a defect.
fn determinism_finding(
    sig: &Signature,
    detail: &str,
    case: &Case,
    r: &Replay,
    reruns: &Reruns,
    mut ev: Vec<String>,
) -> Finding {
    let counted = format!("{} of {} reruns differed", reruns.differed(), reruns.made);
    let Some(d) = &reruns.difference else {
        ev.push(format!(
            "replayed through {}: run once, then rerun into NaN-filled outputs: {counted} \
             (irreproducible: a difference rarer than 1 in {}, or a capsule written by another \
             build or device)",
            r.through, reruns.limit
        ));
        return finding(Verdict::HarnessError, None, ev);
    };
    let at: Vec<String> = (d.tensors.iter())
        .map(|t| {
            format!(
                "{} at {} element(s), first {}",
                t.tensor, t.elements, t.first
            )
        })
        .collect();
    ev.push(format!(
        "replayed through {}: run once, then rerun into NaN-filled outputs until one differed \
         (up to {}): {counted}: {}",
        r.through,
        reruns.limit,
        at.join("; ")
    ));
    if let Outcome::Fail(f) = &d.verdict {
        ev.push(format!("determinism fails again: {}", f.detail));
        let c = clause(&sig.property, &sig.tensor, detail, case);
        return finding(Verdict::Defect, Some(c), ev);
    }
    // The rerun passed: what differed is declared nondeterministic and within tolerance.
    let caps = r.checker.runner.caps();
    let names: Vec<&str> = (d.tensors.iter())
        .map(|t| t.tensor)
        .filter(|t| caps.declares_nondeterministic(t))
        .collect();
    let why = (caps.nondeterministic_note.as_deref()).map_or(String::new(), |n| format!(" ({n})"));
    ev.push(format!(
        "declared nondeterministic: {}{why}, by the implementation's caps.nondeterministic; \
         the rerun stays within numeric_agreement's tolerance",
        names.join(", ")
    ));
    finding(Verdict::DesignOrRangeLimit, None, ev)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AttnConfig;
    use ndarray::Array3;
    use smallseq_reference::{Dtype, Layout, Mask};

    #[test]
    fn each_property_and_tensor_names_its_clause() {
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 8, Mask::CausalBottomRight);
        let t = || Array3::zeros((2, 1, 8));
        let case = Case::new(cfg, Layout::packed(&[(2, 2)]), t(), t(), t(), None).unwrap();
        let c = |p: &str, t: &str, d: &str| clause(p, t, d, &case);
        assert_eq!(
            c("numeric_agreement", "o", ""),
            "docs/semantics.md §1.2 Forward, under the mask causal_bottom_right of §1.5"
        );
        assert!(c("numeric_agreement", "lse", "").contains("§1.4 The LSE convention"));
        assert!(c("numeric_agreement", "dk", "").contains("§1.7 Backward"));
        assert!(c("fallback_equivalence", "dq", "").contains("§3.3 Both profiles"));
        assert_eq!(
            c("dont_care", "o", ""),
            "docs/semantics.md §1.6 Don't-care tokens"
        );
        assert!(c("metamorphic", "o", "splitting the batch").contains("§1.1"));
        assert!(c("metamorphic", "dk", "GQA vs MHA").contains("group of query heads"));
        assert!(c("eligibility", "-", "").contains("§3.1 Profile native"));
        assert!(c("hang", "-", "").starts_with("docs/worker-protocol.md"));
    }

    #[test]
    fn rows_without_keys_are_named_where_the_worst_element_lies_in_one() {
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 8, Mask::CausalBottomRight);
        let t = |n| Array3::zeros((n, 1, 8));
        // Lq = 3 > Lk = 2 under bottom-right causal: row 0 sees no key.
        let case = Case::new(
            cfg.clone(),
            Layout::packed(&[(3, 2)]),
            t(3),
            t(2),
            t(2),
            None,
        );
        let case = case.unwrap();
        let o = no_key_evidence(&case, "o", 0, 0).unwrap();
        assert!(
            o.contains("lies in a row that sees no key, one of 1"),
            "{o}"
        );
        assert_eq!(no_key_evidence(&case, "o", 1, 0), None);
        let dk = no_key_evidence(&case, "dk", 0, 0).unwrap();
        assert!(dk.contains("1 row(s) that see no key"), "{dk}");
        let every_row_sees_a_key =
            Case::new(cfg, Layout::packed(&[(2, 2)]), t(2), t(2), t(2), None);
        assert_eq!(
            no_key_evidence(&every_row_sees_a_key.unwrap(), "dk", 0, 0),
            None
        );
    }
}
