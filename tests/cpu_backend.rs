//! The CPU backend against the reference and every property, on hundreds of random cases.

use smallseq::backend::cpu::CpuBackend;
use smallseq::harness::campaign::case_seed;
use smallseq::harness::gen::{build, draw_geometry};
use smallseq::harness::props::Checker;
use smallseq::harness::rng::Rng;

#[test]
fn cpu_backend_passes_every_property_on_random_cases() {
    let be = CpuBackend::default();
    let checker = Checker::isolated(&be);
    let seed = 20_261_130;
    println!("seed {seed}");
    let mut small_seq = 0;
    for i in 0..250 {
        let cs = case_seed(seed, i);
        let g = draw_geometry(&mut Rng::new(cs));
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let run = checker.check(&case, cs).unwrap();
        let failures = run.failures();
        assert!(failures.is_empty(), "case {i} (seed {seed}): {failures:?}");
        small_seq += usize::from(run.path_fwd == Some(smallseq::dispatch::Path::SmallSeq));
    }
    assert!(
        small_seq >= 40,
        "only {small_seq} cases took the small-seq path"
    );
}

/// A campaign case whose f16 dS overflows in a row (large values, scale 3, D = 256): the
/// device-faithful emulation and the CPU kernel both sum infinities into dQ, some of the
/// opposite sign to the reference (CPU fuzz, seed 2032, cases 4871 and 13767; 13767's inputs are
/// stored, since the generator no longer draws either). The kernel holding the emulation's own
/// infinity is faithful, and the emulation's overflow must not make the whole tensor's
/// threshold infinite.
#[test]
fn infinities_the_emulation_holds_are_no_error_and_keep_the_threshold_finite() {
    use smallseq::harness::props::{oracle, Prop};
    let be = CpuBackend::default();
    let checker = Checker::isolated(&be);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/capsules/stored/cpu-f16-dq-emulation-opposite-infinities.safetensors");
    let case = smallseq::case_file::read_case(&path).unwrap();
    // The campaign's salt of that case.
    let cs = 2_221_495_612_659_509_565;
    // The stored case is still the one this test is about.
    let y = oracle(&case).unwrap();
    let (r, e) = (y.reference.dq.unwrap(), y.emulated.dq.unwrap());
    let flipped = r
        .iter()
        .zip(&e)
        .filter(|(r, e)| r.abs() < 65504.0 && e.is_infinite() && e.signum() != r.signum())
        .count();
    assert!(
        flipped > 0,
        "no dQ infinity of the reference's opposite sign"
    );
    let run = checker.check(&case, cs).unwrap();
    assert!(run.failures().is_empty(), "{:?}", run.failures());
    let dq = run.judgements.iter().find(|j| j.tensor == "dq").unwrap();
    assert!(dq.threshold.is_finite(), "{dq:?}");
    let (_, na) = run
        .outcomes
        .iter()
        .find(|(p, _)| *p == Prop::NumericAgreement)
        .unwrap();
    assert!(
        matches!(na, smallseq::harness::props::Outcome::Pass),
        "{na:?}"
    );
}
