//! Reference invariants and metamorphic relations, on shrinkable cases of every dtype.

use ndarray::{Array3, Axis};
use proptest::prelude::*;
use smallseq::harness::props::oracle;
use smallseq::harness::transform::{repeat_kv, select_slots};
use smallseq::{Case, Outputs};
use smallseq_proptests::strategies::{tiny_case, tiny_case_grouped};
use smallseq_reference::{naive, Dtype};

fn reference(case: &Case) -> Outputs {
    oracle(case).expect("valid case").reference
}

fn tensors(o: &Outputs) -> Vec<(&'static str, Array3<f64>)> {
    let mut v = Vec::new();
    for (name, t) in [("o", &o.o), ("dq", &o.dq), ("dk", &o.dk), ("dv", &o.dv)] {
        if let Some(t) = t {
            v.push((name, t.clone()));
        }
    }
    v
}

/// Largest |a - b| over the largest |b|.
fn rel_diff(a: &Array3<f64>, b: &Array3<f64>) -> f64 {
    let scale = b.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    let err = a.iter().zip(b).fold(
        0.0f64,
        |m, (x, y)| if x == y { m } else { m.max((x - y).abs()) },
    );
    err / scale
}

/// Upper bounds on the sum of |terms| of each output, from the inputs' valid maxima:
/// o is a convex combination of v; dv sums P·dO over Lq rows; |dS| <= 2·max|dP| with
/// |dP| <= Dv·max|dO|·max|v|; dq and dk sum scale·dS·k (·q) over Lk (Lq) terms.
fn term_bounds(case: &Case) -> impl Fn(&str) -> f64 {
    let max_valid = |t: &Array3<f32>, valid: &[bool]| {
        t.outer_iter()
            .zip(valid)
            .filter(|(_, v)| **v)
            .flat_map(|(row, _)| row.iter().map(|x| f64::from(x.abs())).collect::<Vec<_>>())
            .fold(1e-300f64, f64::max)
    };
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let (q, k, v) = (
        max_valid(&case.q, &vq),
        max_valid(&case.k, &vk),
        max_valid(&case.v, &vk),
    );
    let d_o = case.d_o.as_ref().map_or(0.0, |d| max_valid(d, &vq));
    let (lq, lk) = (
        case.layout.q.max_len() as f64,
        case.layout.kv.max_len() as f64,
    );
    let p = &case.config.params;
    let ds = 2.0 * p.head_dim_v as f64 * d_o * v;
    let scale = p.scale.abs();
    let group = p.group_size() as f64;
    move |name: &str| match name {
        "o" => v,
        "dv" => group * lq * d_o,
        "dq" => scale * lk * ds * k,
        _ => group * scale * lq * ds * q,
    }
}

fn any_dtype() -> impl Strategy<Value = Case> {
    prop_oneof![
        tiny_case(Dtype::Bf16),
        tiny_case(Dtype::F16),
        tiny_case(Dtype::F32)
    ]
}

proptest! {
    #![proptest_config(smallseq_proptests::config(file!()))]

    /// The main reference and the independent plain-loop one agree to 1e-12 of the sums'
    /// a-priori magnitude (two f64 evaluation orders differ by a few eps times the sum of
    /// |terms|; relative to the result, cancellation in dq/dk would make any bound arbitrary).
    #[test]
    fn agrees_with_the_naive_implementation(case in any_dtype()) {
        let main = reference(&case);
        let p = case.problem().expect("valid case");
        let (f, g) = naive::forward_backward(&p);
        let other = Outputs { o: Some(f.o), lse: Some(f.lse), dq: g.as_ref().map(|g| g.dq.clone()), dk: g.as_ref().map(|g| g.dk.clone()), dv: g.map(|g| g.dv), dbias: None };
        let bounds = term_bounds(&case);
        for ((name, a), (_, b)) in tensors(&main).into_iter().zip(tensors(&other)) {
            let err = a.iter().zip(&b).fold(0.0f64, |m, (x, y)| if x == y { m } else { m.max((x - y).abs()) });
            let bound = bounds(name);
            prop_assert!(err <= 1e-12 * bound, "{name}: difference {err:e} > 1e-12 x term bound {bound:e}");
        }
    }

    /// Reversing the slot order permutes the outputs and changes nothing else, bitwise.
    #[test]
    fn slot_order_is_irrelevant(case in any_dtype()) {
        let b = case.layout.slots();
        let order: Vec<usize> = (0..b).rev().collect();
        let (rev, rows_q, rows_k) = select_slots(&case, &order, true);
        let base = reference(&case);
        let got = reference(&rev);
        for ((name, a), (_, r)) in tensors(&base).into_iter().zip(tensors(&got)) {
            let rows = if name == "dk" || name == "dv" { &rows_k } else { &rows_q };
            let want = a.select(Axis(0), rows);
            prop_assert!(want.iter().zip(r.iter()).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} changed when slots were reversed");
        }
    }

    /// GQA equals MHA with K and V repeated over each group, dK/dV summed over the group.
    #[test]
    fn gqa_is_mha_with_repeated_kv(case in prop_oneof![
        tiny_case_grouped(Dtype::Bf16, vec![2, 3]),
        tiny_case_grouped(Dtype::F16, vec![2, 3]),
        tiny_case_grouped(Dtype::F32, vec![2, 3]),
    ]) {
        let g = case.config.params.group_size();
        let base = reference(&case);
        let mha = reference(&repeat_kv(&case));
        let sum = |t: &Array3<f64>| {
            let (tk, h, d) = t.dim();
            Array3::from_shape_fn((tk, h / g, d), |(x, y, z)| (0..g).map(|j| t[(x, y * g + j, z)]).sum())
        };
        let pairs = [
            ("o", base.o.clone(), mha.o.clone()),
            ("dq", base.dq.clone(), mha.dq.clone()),
            ("dk", base.dk.clone(), mha.dk.as_ref().map(sum)),
            ("dv", base.dv.clone(), mha.dv.as_ref().map(sum)),
        ];
        for (name, a, b) in pairs {
            if let (Some(a), Some(b)) = (a, b) {
                let d = rel_diff(&a, &b);
                prop_assert!(d <= 1e-12, "{name}: GQA vs MHA differ by {d:e} of the largest element");
            }
        }
    }

    /// Doubling v doubles o (to the ulp) and leaves lse unchanged; doubling d_o too doubles
    /// dv and quadruples dq and dk.
    #[test]
    fn scaling_v_and_d_o_by_two_is_exact(case in any_dtype()) {
        let base = reference(&case);
        let mut scaled = case.clone();
        scaled.v.mapv_inplace(|x| x * 2.0);
        if let Some(d) = scaled.d_o.as_mut() {
            d.mapv_inplace(|x| x * 2.0);
        }
        let got = reference(&scaled);
        let valid_q = case.layout.q.valid_tokens();
        let valid_k = case.layout.kv.valid_tokens();
        for ((name, a), (_, b)) in tensors(&base).into_iter().zip(tensors(&got)) {
            let (f, valid) = match name { "o" => (2.0, &valid_q), "dv" => (2.0, &valid_k), "dq" => (4.0, &valid_q), _ => (4.0, &valid_k) };
            for ((t, h, d), x) in a.indexed_iter() {
                // Power-of-two scaling commutes with every f64 operation except a product
                // that lands in the subnormal range (P = exp(-10^5) with large logits): such
                // a term is rounded to an absolute quantum, which can tip a later exact tie,
                // so a result may move by one ulp; below 2^-100 it may be made of such terms
                // alone (the harness's own scale relation uses the same cut).
                let want = x * f;
                let got = b[(t, h, d)];
                let one_ulp = want.to_bits().abs_diff(got.to_bits()) <= 1 && want.signum() == got.signum();
                if valid[t] && x.abs() > 2f64.powi(-100) {
                    prop_assert!(one_ulp, "{}[{}, {}, {}]: {} x {} = {}, got {}", name, t, h, d, f, x, want, got);
                }
            }
        }
        let (la, lb) = (base.lse.expect("lse"), got.lse.expect("lse"));
        prop_assert!(la.iter().zip(lb.iter()).all(|(x, y)| x.to_bits() == y.to_bits()), "lse changed");
    }
}
