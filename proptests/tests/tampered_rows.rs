//! The per-row rule's power (docs/judgement.md §2, "What a row rule must catch"): correct
//! CPU-backend outputs of production-shape cases, with one (token, head) row of one tensor
//! zeroed, halved or sign-flipped, must fail `smallseq repro` (the stored-output judge), for
//! every tensor, on any row whose reference magnitude is at least 2 % of its tensor's largest.
//!
//! Before the judge took the design of the implementation (issue 38), the order allowance of
//! dQ/dK held the terms of designs that round dP and D to 16 bits, and a zeroed dQ row at
//! 2.67 % of the tensor's largest passed (bf16, 8 slots, seed 1: margin 0.89).

use ndarray::{s, Axis};
use proptest::prelude::*;
use smallseq::backend;
use smallseq::case_file::{read_case, write_case, OutputPrecision};
use smallseq::harness::capsule;
use smallseq::harness::data_class::DataClass;
use smallseq::harness::gen::{build, DataDist, Geometry};
use smallseq::harness::props::run_pair;
use smallseq::harness::repro::judge_stored;
use smallseq::reference::Layout;
use smallseq::wrapper::RunOptions;
use smallseq::AttnConfig;

#[derive(Clone, Copy, Debug)]
enum Tamper {
    Zero,
    Half,
    Flip,
}

impl Tamper {
    fn apply(self, x: f64) -> f64 {
        match self {
            Tamper::Zero => 0.0,
            Tamper::Half => x * 0.5,
            Tamper::Flip => -x,
        }
    }
}

const TENSORS: [&str; 5] = ["o", "lse", "dq", "dk", "dv"];

fn production_case(dtype: &str, mask: &str, lens: &[(usize, usize)], seed: u64) -> smallseq::Case {
    let json = format!(
        r#"{{"dtype":"{dtype}","num_heads":16,"num_gqa_groups":16,"head_dim_qk":128,
            "head_dim_v":128,"mask":"{mask}","layout":"thd"}}"#
    );
    let g = Geometry {
        config: AttnConfig::from_json(&json).unwrap(),
        layout: Layout::packed(lens),
        backward: true,
        dist: DataDist::Randn,
        poison: false,
        segments: None,
        data: DataClass::Plain,
        production: false,
    };
    build(&g, seed).unwrap()
}

/// Tampers the row of `tensor` chosen by `pick` ([`choose`]) among those whose largest finite
/// magnitude is at least 2 % of the tensor's (an lse row is one element); returns (token,
/// head, share of the tensor's largest).
fn tamper(
    out: &mut smallseq::Outputs,
    tensor: &str,
    pick: usize,
    how: Tamper,
) -> (usize, usize, f64) {
    let mut a = match tensor {
        "lse" => out.lse.as_mut().map(|l| l.view_mut().insert_axis(Axis(2))),
        "o" => out.o.as_mut().map(|t| t.view_mut()),
        "dq" => out.dq.as_mut().map(|t| t.view_mut()),
        "dk" => out.dk.as_mut().map(|t| t.view_mut()),
        _ => out.dv.as_mut().map(|t| t.view_mut()),
    }
    .unwrap();
    let largest = |v: ndarray::ArrayView3<f64>| {
        v.iter()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |m, x| m.max(x.abs()))
    };
    let max = largest(a.view());
    let (tokens, heads, _) = a.dim();
    let rows: Vec<(usize, usize, f64)> = (0..tokens)
        .flat_map(|t| (0..heads).map(move |h| (t, h)))
        .map(|(t, h)| (t, h, largest(a.slice(s![t..t + 1, h..h + 1, ..]))))
        .filter(|&(_, _, m)| m >= 0.02 * max)
        .collect();
    let (t, h, m) = choose(&rows, pick);
    a.slice_mut(s![t, h, ..]).mapv_inplace(|x| how.apply(x));
    (t, h, m / max)
}

/// `pick` even: the row with the smallest max that still qualifies (the one most likely to
/// lie under the noise the judge allows, as the issue chose it); odd: a random qualifying row.
fn choose(rows: &[(usize, usize, f64)], pick: usize) -> (usize, usize, f64) {
    if pick.is_multiple_of(2) {
        *rows
            .iter()
            .min_by(|a, b| a.2.total_cmp(&b.2))
            .expect("a tensor's largest row qualifies")
    } else {
        rows[(pick / 2) % rows.len()]
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(12),
        ..smallseq_proptests::config(file!())
    })]

    #[test]
    fn a_tampered_row_fails_repro_on_every_tensor(
        bf16 in any::<bool>(),
        causal in any::<bool>(),
        lens in proptest::collection::vec((2usize..=17, 2usize..=17), 8),
        seed in 0u64..1_000_000,
        pick in any::<usize>(),
        how in prop_oneof![Just(Tamper::Zero), Just(Tamper::Half), Just(Tamper::Flip)],
    ) {
        let dtype = if bf16 { "bf16" } else { "f16" };
        let mask = if causal { "causal" } else { "padding" };
        let mut case = production_case(dtype, mask, &lens, seed);
        let be = backend::open("cpu").unwrap();
        let pair = run_pair(be.as_ref(), &case, &RunOptions::default()).unwrap();
        case.outputs = pair.outputs();
        capsule::stamp(&mut case.meta, be.as_ref());
        let path = pair.fwd.path.map_or("none", |p| p.name());
        case.meta.insert("smallseq.path".into(), path.into());
        let dir = std::env::temp_dir().join(format!("smallseq-tamper-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let correct = judge_stored(&case).unwrap();
        prop_assert!(!correct.failed, "the untampered outputs fail: {:?}", correct.lines);
        for (i, tensor) in TENSORS.into_iter().enumerate() {
            let mut tampered = case.clone();
            let (t, h, share) = tamper(&mut tampered.outputs, tensor, pick.wrapping_add(i), how);
            // Through the case file, as `smallseq repro` reads it.
            let path = dir.join(format!("{tensor}.safetensors"));
            write_case(&tampered, &path, OutputPrecision::Device).unwrap();
            let d = judge_stored(&read_case(&path).unwrap()).unwrap();
            prop_assert!(
                d.failed,
                "{dtype} {mask} seed {seed} lens {lens:?}: {tensor} row ({t}, {h}) at {:.1} % \
                 of the tensor's largest, {how:?}, passes:\n{}",
                100.0 * share,
                d.lines.join("\n")
            );
        }
    }
}

/// The case issue 38 found: its smallest dQ row at ≥ 2 % (2.67 % of the tensor's largest),
/// zeroed, passed at margin 0.89 under the envelope's allowance (`smallseq case new --q-lens
/// 2,5,9,17,3,12,16,7 --kv-lens 4,17,6,13,2,15,9,11 --seed 1`, `run --backend cpu`).
#[test]
fn the_zeroed_dq_row_of_issue_38_fails() {
    let lens = [
        (2, 4),
        (5, 17),
        (9, 6),
        (17, 13),
        (3, 2),
        (12, 15),
        (16, 9),
        (7, 11),
    ];
    let mut case = production_case("bf16", "padding", &lens, 1);
    let be = backend::open("cpu").unwrap();
    let pair = run_pair(be.as_ref(), &case, &RunOptions::default()).unwrap();
    case.outputs = pair.outputs();
    capsule::stamp(&mut case.meta, be.as_ref());
    for how in [Tamper::Zero, Tamper::Half] {
        let mut tampered = case.clone();
        let (t, h, share) = tamper(&mut tampered.outputs, "dq", 0, how);
        let d = judge_stored(&tampered).unwrap();
        assert!(
            d.failed,
            "dq row ({t}, {h}) at {:.2} %, {how:?}, passes:\n{}",
            100.0 * share,
            d.lines.join("\n")
        );
    }
}
