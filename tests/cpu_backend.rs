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
