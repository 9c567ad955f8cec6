//! Don't-care tokens: whatever they hold, valid outputs are bitwise unchanged, and the
//! outputs there are exactly 0 (o, dq, dk, dv) and -inf (lse).

mod common;

use common::{Case, Rng, Spec};
use ndarray::{Array2, Array3, Axis};
use smallseq_reference::{emulate, forward_backward, naive};

const FILLS: [f32; 6] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    3.0e38,
    -1.0e30,
    0.0,
];

fn assert_dont_care_rows<A: Copy + Into<f64>>(a: &Array3<A>, valid: &[bool], what: &str) {
    for (t, row) in a.axis_iter(Axis(0)).enumerate() {
        if !valid[t] {
            assert!(
                row.iter().all(|&x| x.into() == 0.0),
                "{what}: token {t} not 0"
            );
        }
    }
}

fn assert_dont_care_lse<A: Copy + Into<f64>>(a: &Array2<A>, valid: &[bool], what: &str) {
    for (t, row) in a.axis_iter(Axis(0)).enumerate() {
        if !valid[t] {
            assert!(
                row.iter().all(|&x| x.into() == f64::NEG_INFINITY),
                "{what}: lse at {t}"
            );
        }
    }
}

/// All outputs of the three implementations, flattened to f64 bit patterns.
fn outputs(case: &Case) -> Vec<Vec<u64>> {
    let p = case.problem();
    let (vq, vk) = (case.layout.q.valid_tokens(), case.layout.kv.valid_tokens());
    let mut out = Vec::new();
    let bits = |a: ndarray::ArrayViewD<f64>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, (f, g)) in [
        ("reference", forward_backward(&p)),
        ("naive", naive::forward_backward(&p)),
    ] {
        let g = g.unwrap();
        assert_dont_care_rows(&f.o, &vq, name);
        assert_dont_care_lse(&f.lse, &vq, name);
        assert_dont_care_rows(&g.dq, &vq, name);
        assert_dont_care_rows(&g.dk, &vk, name);
        assert_dont_care_rows(&g.dv, &vk, name);
        for a in [
            f.o.into_dyn(),
            f.lse.into_dyn(),
            g.dq.into_dyn(),
            g.dk.into_dyn(),
            g.dv.into_dyn(),
        ] {
            assert!(a.iter().all(|x| !x.is_nan()), "{name}: NaN in output");
            out.push(bits(a.view()));
        }
    }
    let (f, g) = emulate::forward_backward(&p, case.dtype);
    let g = g.unwrap();
    assert_dont_care_rows(&f.o, &vq, "emulate");
    assert_dont_care_lse(&f.lse, &vq, "emulate");
    assert_dont_care_rows(&g.dq, &vq, "emulate");
    assert_dont_care_rows(&g.dk, &vk, "emulate");
    assert_dont_care_rows(&g.dv, &vk, "emulate");
    for a in [
        f.o.into_dyn(),
        f.lse.into_dyn(),
        g.dq.into_dyn(),
        g.dk.into_dyn(),
        g.dv.into_dyn(),
    ] {
        assert!(a.iter().all(|x| !x.is_nan()), "emulate: NaN in output");
        out.push(a.iter().map(|&x| f64::from(x).to_bits()).collect());
    }
    out
}

#[test]
fn dont_care_values_never_reach_valid_outputs() {
    let mut rng = Rng::new(31);
    let mut with_dont_care = 0;
    for i in 0..60 {
        let mut spec = Spec::random(&mut rng, 9, 12);
        if i % 2 == 0 {
            spec.pads = spec.lens.iter().map(|_| (1, 2)).collect();
            spec.tail = (2, 1);
        }
        let mut case = Case::build(&spec, &mut rng);
        let (nq, nk) = case.dont_care_tokens();
        if nq + nk > 0 {
            with_dont_care += 1;
        }
        let base = outputs(&case);
        for fill in FILLS {
            case.fill_dont_care(fill);
            assert!(outputs(&case) == base, "case {i}, fill {fill}: {spec:?}");
        }
    }
    assert!(with_dont_care >= 40);
}

/// Pinned geometry with every kind of don't-care token: pad-between on both sides, tail
/// slack, an Lq = 0 slot with a kv span and an Lk = 0 slot with a q span.
#[test]
fn every_kind_of_dont_care_token() {
    let mut rng = Rng::new(32);
    let mut spec = Spec::packed(&[(3, 4), (0, 3), (2, 0), (4, 4)], 4, 2, 8);
    spec.pads = vec![(2, 1), (3, 0), (0, 2), (1, 3)];
    spec.tail = (3, 2);
    let mut case = Case::build(&spec, &mut rng);
    let base = outputs(&case);
    for fill in FILLS {
        case.fill_dont_care(fill);
        assert!(outputs(&case) == base, "fill {fill}");
    }
}
