//! The CPU backend's fallback against its f32 emulation (`emulate_fallback`, design
//! `FallbackDesign::CPU`): `emulation_conformance` judges fallback outputs with the small-seq
//! budget on the claim that the two perform the same f32 operations in the same order, so
//! every element must agree bitwise, dropout and bias included. A change to either that
//! reorders a sum shows here first, as a count, before it shows as campaign failures.

use smallseq::backend::cpu::CpuBackend;
use smallseq::backend::BackendInfo;
use smallseq::design::Design;
use smallseq::dispatch::Profile;
use smallseq::harness::campaign::case_seed;
use smallseq::harness::conformance::{self, Undecided};
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::{oracle_for, run_pair};
use smallseq::harness::rng::Rng;
use smallseq::wrapper::RunOptions;
use smallseq_reference::Dtype;

#[test]
fn cpu_fallback_outputs_are_the_emulation_bit_for_bit() {
    agrees_bit_for_bit(&CpuBackend::default(), Design::Project);
}

/// The same with D = rowsum(dO∘O) from the stored O on both sides (`docs/semantics.md` §1.7;
/// the design the GPU kernels built with `FTB_D_FROM_O=1` declare).
#[test]
fn d_from_o_cpu_fallback_outputs_are_the_emulation_bit_for_bit() {
    let be = CpuBackend::default().with_d_from_o();
    assert_eq!(be.design(), Design::ProjectDFromO);
    agrees_bit_for_bit(&be, Design::ProjectDFromO);
}

/// Fallback-path outputs of `be` on 300 campaign cases (seed 7) against the emulation of
/// `design`, element by element.
fn agrees_bit_for_bit(be: &CpuBackend, design: Design) {
    let opts = RunOptions::default();
    let (mut cases, mut dropout, mut bias) = (0, 0, 0);
    let (mut elements, mut differ, mut off) = (0usize, 0usize, 0usize);
    let mut first_differing = None;
    for i in 0..300 {
        let cs = case_seed(7, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let Ok(pair) = run_pair(be, &case, &opts) else {
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
        let y = oracle_for(&case, design).unwrap();
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

/// The two forms of D agree to rounding (`docs/semantics.md` §1.7): on random rows,
/// rowsum(dO∘O) in f32 from O rounded to bf16 lies within `(u_bf16 + Dv·u32)·Σ|dO·O|` of the
/// f64 Σ P·dP, and O's rounding is what that bound is for (dropping it moves D off by more).
#[test]
fn d_from_the_stored_o_is_sum_p_dp_to_rounding() {
    let mut state = 0x5eed_u64;
    let mut normal = move || {
        // Box-Muller on a 64-bit LCG: enough for test data.
        let mut u = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()
    };
    let (u16b, u32f) = (2f64.powi(-8), 2f64.powi(-24));
    let mut worst = 0f64;
    for row in 0..200 {
        let (lk, dv) = (1 + row % 37, [64, 128][row % 2]);
        let bf = |x: f64| Dtype::Bf16.round(x as f32);
        let s: Vec<f64> = (0..lk).map(|_| 3.0 * normal()).collect();
        let v: Vec<Vec<f32>> = (0..lk)
            .map(|_| (0..dv).map(|_| bf(normal())).collect())
            .collect();
        let d_o: Vec<f32> = (0..dv).map(|_| bf(normal())).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
        let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
        let o: Vec<f64> = (0..dv)
            .map(|j| (0..lk).map(|c| p[c] * f64::from(v[c][j])).sum())
            .collect();
        let dp: Vec<f64> = (0..lk)
            .map(|c| {
                (0..dv)
                    .map(|j| f64::from(d_o[j]) * f64::from(v[c][j]))
                    .sum()
            })
            .collect();
        let sum_p_dp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        let o16: Vec<f32> = o.iter().map(|&x| bf(x)).collect();
        let from_o = d_o.iter().zip(&o16).fold(0f32, |acc, (x, y)| acc + x * y);
        let mag: f64 = d_o
            .iter()
            .zip(&o)
            .map(|(x, y)| (f64::from(*x) * y).abs())
            .sum();
        let err = (f64::from(from_o) - sum_p_dp).abs();
        let bound = (u16b + dv as f64 * u32f) * mag;
        assert!(
            err <= bound,
            "row {row}: |{from_o} - {sum_p_dp}| = {err} > {bound}"
        );
        worst = worst.max(err / mag);
    }
    // O's rounding shows: the f32 term alone (Dv·u32 ≈ 8e-6 relative) would not hold it.
    assert!(worst > 128.0 * u32f, "largest relative error {worst:e}");
}
