//! The cases a fallback backward with D = rowsum(dO∘O) from the stored O (`docs/semantics.md`
//! §1.7) must pass every property on, whatever backend computes it: the CPU's `with_d_from_o`
//! (tests/d_from_o.rs) and the CUDA kernels built with `FTB_D_FROM_O=1` (tests/cuda_d_from_o.rs).

use smallseq::backend::Backend;
use smallseq::dispatch::Profile;
use smallseq::harness::campaign::case_seed;
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::{Checker, Outcome};
use smallseq::harness::rng::Rng;
use smallseq::wrapper::RunOptions;
use smallseq_reference::{Dtype, Layout, Mask};

/// Every failing outcome of `checker` on `case`, named.
fn failures(checker: &Checker, case: &smallseq::case::Case, i: u64, what: &str) -> Vec<String> {
    let run = checker.check(case, i).unwrap();
    run.outcomes
        .iter()
        .filter_map(|(prop, o)| match o {
            Outcome::Fail(f) => Some(format!("{what}: {prop}: {f:?}")),
            _ => None,
        })
        .collect()
}

/// The campaign's own cases whose backward takes the fallback (seed 41, the first `cases`),
/// then slots of 512 tokens on the tiled kernels (bf16 and f16, D = 64 and 128, causal and
/// not, GQA) and on the scalar ones (f32): every property's failure on `be`, named.
pub fn failures_on(be: &dyn Backend, cases: u64) -> Vec<String> {
    let checker = Checker::isolated(be);
    let opts = RunOptions::default();
    let mut failed = Vec::new();
    let mut fallback = 0;
    for i in 0..cases {
        let cs = case_seed(41, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let Ok(pair) = smallseq::harness::props::run_pair(be, &case, &opts) else {
            continue;
        };
        if case.d_o.is_none() || !pair.fallback().1 {
            continue;
        }
        fallback += 1;
        failed.extend(failures(
            &checker,
            &case,
            i,
            &format!("case {i} (seed {cs})"),
        ));
    }
    eprintln!("{fallback} campaign cases with a fallback backward");
    assert!(
        fallback >= cases / 6,
        "only {fallback} fallback backwards drawn"
    );
    let base = draw_geometry_for(&mut Rng::new(case_seed(41, 0)), Profile::Native);
    let shapes = [
        (Dtype::Bf16, 128, 4, 4, Mask::NoMask, vec![(512, 512)]),
        (
            Dtype::Bf16,
            128,
            4,
            2,
            Mask::Causal,
            vec![(512, 512), (3, 40)],
        ),
        (
            Dtype::F16,
            64,
            2,
            1,
            Mask::CausalBottomRight,
            vec![(200, 512)],
        ),
        (
            Dtype::F16,
            128,
            2,
            2,
            Mask::NoMask,
            vec![(512, 300), (0, 5)],
        ),
        (Dtype::F32, 64, 2, 2, Mask::Causal, vec![(512, 512)]),
    ];
    for (n, (dtype, d, heads, kv_heads, mask, lens)) in shapes.into_iter().enumerate() {
        let mut g = base.clone();
        let mut cfg = smallseq::AttnConfig::new(dtype, heads, d, mask);
        cfg.params.num_kv_heads = kv_heads;
        g.config = cfg;
        g.layout = Layout::packed(&lens);
        g.backward = true;
        g.segments = None;
        g.production = false;
        let case = build(&g, 0x512 + n as u64).unwrap();
        let what = format!("{dtype} d{d} h{heads}/{kv_heads} {mask:?} {lens:?}");
        failed.extend(failures(&checker, &case, n as u64, &what));
    }
    failed
}
