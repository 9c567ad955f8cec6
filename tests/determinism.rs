//! Determinism failures end in findings (issue 31): a backend whose dQ (or dV) differs on
//! every other call fails `determinism` unless it declares that output nondeterministic
//! (`caps.nondeterministic`), in which case a rerun within tolerance passes and one beyond it
//! still fails; and triage reruns the representative until a rerun differs, saying how many
//! of how many did, before it calls the failure a defect, a design limit (declared) or, when
//! none differs, a harness error.

use smallseq::backend::cpu::CpuBackend;
use smallseq::backend::{BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use smallseq::dispatch::Arch;
use smallseq::harness::props::{Checker, Outcome, Prop};
use smallseq::harness::rng::Rng;
use smallseq::harness::triage::{pattern, signature_class, tensor_of, Signature};
use smallseq::harness::triage_verdict::{judge, Finding, Replay, Verdict, DETERMINISM_RERUNS};
use smallseq::reference::{Dtype, Layout, Mask};
use smallseq::runner::{InProcess, Runner};
use smallseq::{AttnConfig, Case};
use std::sync::atomic::{AtomicUsize, Ordering};

/// What the stand-in does to its backward's outputs on every other call.
#[derive(Clone, Copy)]
enum Edit {
    /// Nothing: a deterministic backend.
    None,
    /// The largest |dQ| one bf16 ulp away from zero: a sum in another order.
    DqUlp,
    /// The largest |dQ| doubled: far outside any tolerance.
    DqDoubled,
    /// The largest |dV| one bf16 ulp away from zero.
    DvUlp,
}

/// The CPU backend, its backward's output edited on every other rerun into NaN-filled
/// outputs (the first, third, ...): the reruns `determinism` and triage make. Counting those
/// alone keeps the main run unedited whatever other properties run in between.
struct Flaky {
    cpu: CpuBackend,
    edit: Edit,
    /// Backward calls, and those into NaN-filled outputs.
    calls: AtomicUsize,
    poisoned: AtomicUsize,
    /// Edit every other backward call instead (the third, fifth, ...; the main run is the
    /// first), poisoned or not.
    any_call: bool,
}

impl Flaky {
    fn new(edit: Edit) -> Self {
        Flaky {
            cpu: CpuBackend::default(),
            edit,
            calls: AtomicUsize::new(0),
            poisoned: AtomicUsize::new(0),
            any_call: false,
        }
    }

    /// Whether the launch's dQ buffer arrives NaN-filled (a determinism rerun).
    fn poisoned(out: &BwdBufs) -> bool {
        out.dq.body().first().is_some_and(|x| x.is_nan())
    }

    fn after_bwd(&self, out: &mut BwdBufs, poisoned: bool) {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let edited = if self.any_call {
            call > 0 && call.is_multiple_of(2)
        } else {
            poisoned
                && self
                    .poisoned
                    .fetch_add(1, Ordering::SeqCst)
                    .is_multiple_of(2)
        };
        if !edited {
            return;
        }
        let body = match self.edit {
            Edit::None => return,
            Edit::DqUlp | Edit::DqDoubled => out.dq.body_mut(),
            Edit::DvUlp => out.dv.body_mut(),
        };
        let Some(x) = body.iter_mut().max_by(|a, b| a.abs().total_cmp(&b.abs())) else {
            return;
        };
        *x = match self.edit {
            // A bf16 value in an f32: its last stored bit is bit 16.
            Edit::DqUlp | Edit::DvUlp => f32::from_bits(x.to_bits() + (1 << 16)),
            _ => *x * 2.0,
        };
    }
}

impl BackendInfo for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }
    fn arch(&self) -> Arch {
        self.cpu.arch()
    }
    fn has_small_seq(&self) -> bool {
        true
    }
}

impl MutationHooks for Flaky {}

impl Compute for Flaky {
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> smallseq::Result<()> {
        self.cpu.small_seq_fwd(args, out)
    }
    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> smallseq::Result<()> {
        self.cpu.fallback_fwd(args, out)
    }
    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> smallseq::Result<()> {
        let poisoned = Self::poisoned(out);
        self.cpu.small_seq_bwd(args, out)?;
        self.after_bwd(out, poisoned);
        Ok(())
    }
    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> smallseq::Result<()> {
        let poisoned = Self::poisoned(out);
        self.cpu.fallback_bwd(args, out)?;
        self.after_bwd(out, poisoned);
        Ok(())
    }
}

/// A bf16 case with a backward, two slots, no don't-care tokens (so `dont_care` makes no
/// rerun of its own between the main run and determinism's).
fn case() -> Case {
    case_with_tail(0)
}

/// The same with `tail` don't-care tokens after the slots on each side.
fn case_with_tail(tail: usize) -> Case {
    let (h, d) = (2, 16);
    let mut layout = Layout::packed(&[(5, 5), (3, 4)]);
    layout.q.tokens += tail;
    layout.kv.tokens += tail;
    let cfg = AttnConfig::new(Dtype::Bf16, h, d, Mask::Padding);
    let mut rng = Rng::new(11);
    let mut t = |n| {
        ndarray::Array3::from_shape_simple_fn((n, h, d), || Dtype::Bf16.round(rng.normal() as f32))
    };
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let (q, k, v, d_o) = (t(tq), t(tk), t(tk), t(tq));
    Case::new(cfg, layout, q, k, v, Some(d_o)).unwrap()
}

/// A checker of `be` that declares `nondeterministic` (none: exactly the in-tree caps).
fn checker<'a>(be: &'a Flaky, nondeterministic: &[&str]) -> Checker<'a> {
    let mut checker = Checker::isolated(be);
    let inner = InProcess::new(be);
    let mut caps = inner.caps().clone();
    caps.nondeterministic = nondeterministic.iter().map(|s| s.to_string()).collect();
    caps.nondeterministic_note =
        (!nondeterministic.is_empty()).then(|| "summed with atomics".to_string());
    checker.runner = Box::new(inner.with_caps(caps));
    checker
}

/// `determinism`'s outcome on the case.
fn determinism(checker: &Checker) -> Outcome {
    outcome(checker, &case(), Prop::Determinism)
}

/// `prop`'s outcome on `case`.
fn outcome(checker: &Checker, case: &Case, prop: Prop) -> Outcome {
    let run = checker.check(case, 0).unwrap();
    (run.outcomes.into_iter())
        .find(|(p, _)| *p == prop)
        .map(|(_, o)| o)
        .unwrap()
}

/// Triage's verdict on a determinism failure of the case recorded as `detail`, replayed
/// through `checker`.
fn triage(checker: &Checker, detail: &str) -> Finding {
    let case = case();
    let sig = Signature {
        implementation: "flaky".into(),
        property: "determinism".into(),
        tensor: tensor_of(detail),
        class: signature_class(&case),
        pattern: pattern(detail),
        range_limit: false,
    };
    let replay = Replay {
        checker,
        salt: 0,
        through: "the flaky backend".into(),
    };
    judge(&sig, detail, &case, Some(&replay), "")
}

fn evidence(f: &Finding) -> String {
    f.evidence.join("\n")
}

/// The "k of N reruns differed" of triage's evidence, as (k, N).
fn counted(ev: &str) -> (usize, usize) {
    let at = ev
        .find(" reruns differed")
        .unwrap_or_else(|| panic!("no count: {ev}"));
    let words: Vec<&str> = ev[..at].rsplit(' ').take(3).collect();
    assert_eq!(words[1], "of", "{ev}");
    (words[2].parse().unwrap(), words[0].parse().unwrap())
}

#[test]
fn an_undeclared_dq_that_differs_on_reruns_fails_and_triages_as_a_defect() {
    let be = Flaky::new(Edit::DqUlp);
    let c = checker(&be, &[]);
    let Outcome::Fail(f) = determinism(&c) else {
        panic!("dQ differs between runs: determinism must fail");
    };
    assert!(
        f.detail
            .starts_with("rerun into poisoned outputs differs: dq["),
        "{}",
        f.detail
    );
    // Undeclared: today's text, nothing about declarations.
    assert!(!f.detail.contains("declared"), "{}", f.detail);
    let finding = triage(&c, &f.detail);
    assert_eq!(finding.verdict, Verdict::Defect, "{finding:?}");
    let ev = evidence(&finding);
    eprintln!("{ev}");
    // The edit comes on every other rerun: the first or the second differs.
    let (k, n) = counted(&ev);
    assert!(k == 1 && (1..=2).contains(&n), "{ev}");
    assert!(ev.contains("dq at 1 element(s), first dq["), "{ev}");
    assert!(ev.contains("determinism fails again"), "{ev}");
    let clause = finding.clause.unwrap();
    assert!(
        clause.starts_with("docs/harness.md, determinism"),
        "{clause}"
    );
}

#[test]
fn a_declared_dq_within_tolerance_passes_and_triages_as_a_design_limit() {
    let be = Flaky::new(Edit::DqUlp);
    let c = checker(&be, &["dq"]);
    assert_eq!(determinism(&c), Outcome::Pass);
    // A group recorded before the declaration (an older adapter) replayed through the
    // declaring one: the reruns still differ, and the difference is the declared one.
    let finding = triage(
        &c,
        "rerun into poisoned outputs differs: dq[0, 1, 2]: 1 vs 2",
    );
    assert_eq!(finding.verdict, Verdict::DesignOrRangeLimit, "{finding:?}");
    assert_eq!(finding.clause, None);
    let ev = evidence(&finding);
    eprintln!("{ev}");
    assert_eq!(counted(&ev).0, 1, "{ev}");
    assert!(
        ev.contains("declared nondeterministic: dq (summed with atomics)"),
        "{ev}"
    );
}

#[test]
fn a_declared_dq_beyond_tolerance_still_fails() {
    let be = Flaky::new(Edit::DqDoubled);
    let c = checker(&be, &["dq"]);
    let Outcome::Fail(f) = determinism(&c) else {
        panic!("a rerun whose dQ doubled is no summation order");
    };
    assert!(
        f.detail.starts_with(
            "rerun into poisoned outputs: dq, declared nondeterministic (dq), leaves the tolerance"
        ),
        "{}",
        f.detail
    );
    let finding = triage(&c, &f.detail);
    assert_eq!(finding.verdict, Verdict::Defect, "{finding:?}");
}

#[test]
fn an_undeclared_dv_that_differs_fails_beside_a_declared_dq() {
    let be = Flaky::new(Edit::DvUlp);
    let c = checker(&be, &["dq"]);
    let Outcome::Fail(f) = determinism(&c) else {
        panic!("dV is not declared: its bits must repeat");
    };
    assert!(
        f.detail
            .starts_with("rerun into poisoned outputs differs: dv[")
            && f.detail
                .contains("not declared nondeterministic; the declared dq held to tolerance"),
        "{}",
        f.detail
    );
    let finding = triage(&c, &f.detail);
    assert_eq!(finding.verdict, Verdict::Defect, "{finding:?}");
    assert!(
        evidence(&finding).contains("dv at 1 element(s)"),
        "{finding:?}"
    );
}

#[test]
fn reruns_that_never_differ_are_a_harness_error_with_their_count() {
    let be = Flaky::new(Edit::None);
    let c = checker(&be, &[]);
    assert_eq!(determinism(&c), Outcome::Pass);
    let finding = triage(
        &c,
        "rerun into poisoned outputs differs: dq[0, 1, 2]: 1 vs 2",
    );
    assert_eq!(finding.verdict, Verdict::HarnessError, "{finding:?}");
    let ev = evidence(&finding);
    assert_eq!(counted(&ev), (0, DETERMINISM_RERUNS), "{ev}");
    // Every rerun made: one main run and the reruns, each a forward and a backward.
    let calls = be.calls.load(Ordering::SeqCst);
    assert!(calls > DETERMINISM_RERUNS, "{calls}");
}

/// A dQ that moves between the re-poisoned run of `dont_care` and its plain rerun (the edit
/// comes on every other call, and falls on the first of them) was blamed on the don't-care
/// tokens; declared nondeterministic, it is not compared bitwise there.
#[test]
fn a_declared_dq_that_moves_between_runs_is_not_blamed_on_dont_care_tokens() {
    let dont_care = |declared: &[&str]| {
        let mut be = Flaky::new(Edit::DqUlp);
        be.any_call = true;
        let c = checker(&be, declared);
        outcome(&c, &case_with_tail(3), Prop::DontCare)
    };
    match dont_care(&[]) {
        Outcome::Fail(f) => assert!(
            f.detail
                .starts_with("valid output changed when don't-care inputs changed: dq["),
            "{}",
            f.detail
        ),
        other => panic!("undeclared, the moved dQ is blamed: {other:?}"),
    }
    assert_eq!(dont_care(&["dq"]), Outcome::Pass);
}
