//! The CPU backend's fallback against its f32 emulation (`emulate_fallback`, design
//! `FallbackDesign::CPU`): `emulation_conformance` judges fallback outputs with the small-seq
//! budget on the claim that the two perform the same f32 operations in the same order, so
//! every element must agree bitwise, dropout and bias included. A change to either that
//! reorders a sum shows here first, as a count, before it shows as campaign failures.

use smallseq::backend::cpu::CpuBackend;
use smallseq::dispatch::Profile;
use smallseq::harness::campaign::case_seed;
use smallseq::harness::conformance::{self, Undecided};
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::{oracle, run_pair};
use smallseq::harness::rng::Rng;
use smallseq::wrapper::RunOptions;

#[test]
fn cpu_fallback_outputs_are_the_emulation_bit_for_bit() {
    let be = CpuBackend::default();
    let opts = RunOptions::default();
    let (mut cases, mut dropout, mut bias) = (0, 0, 0);
    let (mut elements, mut differ, mut off) = (0usize, 0usize, 0usize);
    let mut first_differing = None;
    for i in 0..300 {
        let cs = case_seed(7, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let Ok(pair) = run_pair(&be, &case, &opts) else {
            continue;
        };
        let on = pair.fallback();
        if !(on.0 || on.1) {
            continue;
        }
        cases += 1;
        let p = &case.config.params;
        dropout += usize::from(p.dropout.is_active() && on.1);
        bias += usize::from(!matches!(p.bias, smallseq_reference::AttnBias::None) && on.1);
        let y = oracle(&case).unwrap();
        let actual = pair.outputs();
        let emulated = y.fallback(&case).unwrap();
        for t in conformance::paired(&case, on, &actual, emulated) {
            for (x, e) in t.pairs() {
                elements += 1;
                if x.to_bits() != e.to_bits() && !(x.is_nan() && e.is_nan()) {
                    differ += 1;
                    first_differing.get_or_insert((i, t.tensor, x, e));
                }
            }
        }
        off += conformance::counts(&case, on, &actual, emulated, Undecided::default())
            .iter()
            .map(|c| c.off)
            .sum::<usize>();
    }
    eprintln!(
        "{cases} fallback cases ({dropout} with dropout, {bias} with bias in the backward): \
         {differ} of {elements} elements differ, {off} by more than one ulp"
    );
    assert!(
        cases >= 30 && dropout >= 1 && bias >= 1,
        "too few fallback cases drawn"
    );
    assert_eq!(differ, 0, "first: {first_differing:?}");
}

/// Issue 35 item 3's power: each one-ulp-loss mutant (a partial sum rounded to the input
/// dtype at every step of one reduction, either path) fails some property within 400 cases
/// on each of seeds 1, 2 and 3 (measured: within 50, `docs/judgement.md`).
#[test]
fn one_ulp_loss_mutants_are_killed_on_three_seeds() {
    use smallseq::harness::props::{Checker, Outcome};
    use smallseq::mutants::{Defects, Mutant};
    // Every one-ulp loss of the catalogue: a 16-bit rounding inside one reduction.
    let losses: Vec<Mutant> = Mutant::ALL
        .iter()
        .copied()
        .filter(|m| m.name().ends_with("half-accumulation"))
        .collect();
    assert_eq!(losses.len(), 12, "the one-ulp losses of both paths");
    for m in losses {
        let be = CpuBackend::mutant(Defects::of(&[m]));
        let checker = Checker::isolated(&be);
        for seed in 1..=3 {
            let killed = (0..400u64).find(|&i| {
                let cs = case_seed(seed, i);
                let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
                let case = build(&g, cs ^ 0xda7a).unwrap();
                checker.check(&case, i).is_ok_and(|run| {
                    run.outcomes
                        .iter()
                        .any(|(_, o)| matches!(o, Outcome::Fail(_)))
                })
            });
            eprintln!("{m} seed {seed}: killed at case {killed:?}");
            assert!(killed.is_some(), "{m} survives 400 cases on seed {seed}");
        }
    }
}
