//! The plain-loop implementation agrees with the main one to 1e-12 relative.

mod common;

use common::{rel_err, same_bits, Case, Rng, Spec};
use ndarray::ShapeBuilder;
use smallseq_reference::{
    forward, forward_backward, forward_backward_views, naive, Dropout, Dtype, Mask, Window,
};

fn agree(case: &Case, what: &str) {
    let p = case.problem();
    let (a, ga) = forward_backward(&p);
    let (b, gb) = naive::forward_backward(&p);
    let tol = 1e-12;
    assert!(rel_err(a.o.view(), b.o.view(), 1e-300) <= tol, "{what}: o");
    assert!(
        rel_err(a.lse.view(), b.lse.view(), 1e-300) <= tol,
        "{what}: lse"
    );
    match (ga, gb) {
        (Some(ga), Some(gb)) => {
            for (name, x, y) in [
                ("dq", &ga.dq, &gb.dq),
                ("dk", &ga.dk, &gb.dk),
                ("dv", &ga.dv, &gb.dv),
            ] {
                let err = rel_err(x.view(), y.view(), 1e-300);
                assert!(err <= tol, "{what}: {name} rel err {err:e}");
            }
        }
        (None, None) => {}
        _ => panic!("{what}: gradients present in one implementation only"),
    }
}

/// `agree`, and dBias too.
fn agree_dbias(case: &Case, what: &str) {
    agree(case, what);
    let p = case.problem();
    let (_, ga) = forward_backward(&p);
    let (_, gb) = naive::forward_backward(&p);
    let (Some(ga), Some(gb)) = (ga, gb) else {
        return;
    };
    match (ga.dbias, gb.dbias) {
        (Some(x), Some(y)) => {
            let err = rel_err(x.view(), y.view(), 1e-300);
            assert!(err <= 1e-12, "{what}: dbias rel err {err:e}");
            assert!(x.iter().all(|v| v.is_finite()), "{what}: dbias not finite");
        }
        (None, None) => {}
        _ => panic!("{what}: dbias present in one implementation only"),
    }
}

/// Post-scale biases of every broadcast shape with -inf entries, and ALiBi (docs/semantics.md
/// §1.9), with GQA, masks, windows and dropout.
#[test]
fn naive_agrees_with_bias() {
    let mut rng = Rng::new(8);
    let mut with_dbias = 0;
    for i in 0..160 {
        let mut spec = Spec::random(&mut rng, 12, 24);
        spec.bias = if i % 5 == 4 {
            common::alibi(&mut rng, &spec)
        } else {
            common::post_scale_bias(&mut rng, &spec, i % 2 == 0, i % 4 < 2, 6)
        };
        if i % 7 == 0 {
            spec.dropout = Dropout {
                p: 0.5,
                seed: i as u64,
                offset: 3,
            };
        }
        let case = Case::build(&spec, &mut rng);
        let (_, g) = forward_backward(&case.problem());
        with_dbias += usize::from(g.is_some_and(|g| g.dbias.is_some()));
        agree_dbias(&case, &format!("bias case {i}: {spec:?}"));
    }
    assert!(with_dbias > 100, "{with_dbias} cases had a dbias");
}

/// A bias that is -inf on every key of a row hides the row's keys: o = 0, lse = -inf, no
/// NaN anywhere (docs/semantics.md §1.3); a zero bias is exactly no bias, and a bias constant
/// along each row moves lse by the constant and leaves o alone.
#[test]
fn bias_extremes() {
    let mut rng = Rng::new(9);
    let mut spec = Spec::packed(&[(3, 4), (2, 5)], 2, 1, 8);
    let zero = ndarray::Array4::<f32>::zeros((1, 2, 3, 5));
    spec.bias = smallseq_reference::AttnBias::PostScale(std::sync::Arc::new(zero.clone()));
    let case = Case::build(&spec, &mut rng);
    let mut plain = case.clone();
    plain.params.bias = smallseq_reference::AttnBias::None;
    let (f0, g0) = forward_backward(&plain.problem());
    let (f, g) = forward_backward(&case.problem());
    let g = g.unwrap();
    let g0 = g0.unwrap();
    assert_eq!(f, f0);
    assert_eq!((&g.dq, &g.dk, &g.dv), (&g0.dq, &g0.dk, &g0.dv));
    let mut shifted = zero.clone();
    let mut hidden = zero;
    for r in 0..3 {
        shifted
            .slice_mut(ndarray::s![0, 1, r, ..])
            .fill(0.5 * r as f32 - 3.0);
    }
    hidden
        .slice_mut(ndarray::s![0, 0, 1, ..])
        .fill(f32::NEG_INFINITY);
    let mut c = case.clone();
    c.params.bias = smallseq_reference::AttnBias::PostScale(std::sync::Arc::new(shifted));
    let (fs, gs) = forward_backward(&c.problem());
    assert!(rel_err(fs.o.view(), f0.o.view(), 1e-300) <= 1e-12);
    // Slot 0 (rows 0..3) and slot 1 (rows 3..5) of head 1.
    for t in 0..5 {
        let r = if t < 3 { t } else { t - 3 };
        let want = f0.lse[[t, 1]] + 0.5 * r as f64 - 3.0;
        assert!((fs.lse[[t, 1]] - want).abs() <= 1e-12, "token {t}");
    }
    assert!(gs
        .unwrap()
        .dbias
        .unwrap()
        .iter()
        .all(|x| x.abs() < 1e-12 || x.is_finite()));
    c.params.bias = smallseq_reference::AttnBias::PostScale(std::sync::Arc::new(hidden));
    let (fh, gh) = forward_backward(&c.problem());
    let gh = gh.unwrap();
    // Row 1 of both slots in head 0.
    for t in [1, 4] {
        assert_eq!(fh.lse[[t, 0]], f64::NEG_INFINITY, "token {t}");
        assert!(fh.o.slice(ndarray::s![t, 0, ..]).iter().all(|&x| x == 0.0));
        assert!(gh.dq.slice(ndarray::s![t, 0, ..]).iter().all(|&x| x == 0.0));
    }
    assert!(fh.o.iter().chain(gh.dk.iter()).all(|x| x.is_finite()));
    assert!(gh
        .dbias
        .unwrap()
        .slice(ndarray::s![0, 0, 1, ..])
        .iter()
        .all(|&x| x == 0.0));
    agree_dbias(&c, "a row hidden by -inf");
}

#[test]
fn naive_agrees_on_random_geometries() {
    let mut rng = Rng::new(3);
    for i in 0..300 {
        let mut spec = Spec::random(&mut rng, 12, 40);
        spec.grads = i % 5 != 0;
        let case = Case::build(&spec, &mut rng);
        agree(&case, &format!("case {i}: {spec:?}"));
    }
}

#[test]
fn naive_agrees_on_large_heads_and_extreme_scales() {
    let mut rng = Rng::new(4);
    for (i, scale) in [1e-3, 0.088, 1.0, 4.0, -0.5].into_iter().enumerate() {
        let mut spec = Spec::packed(&[(17, 17), (1, 17), (17, 1), (9, 4)], 8, 2, 128);
        spec.dv = 64;
        spec.scale = scale;
        spec.mask = Mask::ALL[i];
        spec.window = Window { left: 5, right: 3 };
        spec.dtype = Dtype::F16;
        let case = Case::build(&spec, &mut rng);
        agree(&case, &format!("scale {scale}"));
    }
}

#[test]
fn forward_equals_forward_of_forward_backward() {
    let mut rng = Rng::new(5);
    let case = Case::build(&Spec::random(&mut rng, 9, 8), &mut rng);
    let p = case.problem();
    let f = forward(&p);
    let (g, _) = forward_backward(&p);
    assert!(same_bits(f.o.view(), g.o.view()) && same_bits(f.lse.view(), g.lse.view()));
}

#[test]
fn input_memory_layout_does_not_change_outputs() {
    // Column-major copies of the inputs: every row the products read is strided.
    let mut rng = Rng::new(6);
    for _ in 0..20 {
        let case = Case::build(&Spec::random(&mut rng, 9, 12), &mut rng);
        let f = |a: &ndarray::Array3<f32>| {
            let mut c = ndarray::Array3::zeros(a.raw_dim().f());
            c.assign(a);
            c
        };
        let (q, k, v) = (f(&case.q), f(&case.k), f(&case.v));
        let d_o = case.d_o.as_ref().map(f);
        let (a, ga) = forward_backward(&case.problem());
        let (b, gb) = forward_backward_views(
            &case.params,
            &case.layout,
            q.view(),
            k.view(),
            v.view(),
            d_o.as_ref().map(|d| d.view()),
        );
        assert!(same_bits(a.o.view(), b.o.view()) && same_bits(a.lse.view(), b.lse.view()));
        let (ga, gb) = (ga.unwrap(), gb.unwrap());
        for (x, y) in [(&ga.dq, &gb.dq), (&ga.dk, &gb.dk), (&ga.dv, &gb.dv)] {
            assert!(same_bits(x.view(), y.view()));
        }
    }
}

#[test]
fn naive_agrees_with_dropout() {
    let mut rng = Rng::new(5);
    for i in 0..120 {
        let mut spec = Spec::random(&mut rng, 12, 24);
        spec.dropout = Dropout {
            p: [0.1, 0.5, 0.9, 1.0][i % 4],
            seed: rng.range(0, 1 << 30) as u64,
            offset: rng.range(0, 1 << 20) as u64,
        };
        let case = Case::build(&spec, &mut rng);
        agree(&case, &format!("dropout case {i}: {spec:?}"));
    }
}

/// `p = 0` is no dropout whatever the seed and offset, bit for bit; `p = 1` zeroes o and
/// every gradient and leaves lse alone.
#[test]
fn dropout_extremes() {
    let mut rng = Rng::new(6);
    for i in 0..40 {
        let spec = Spec::random(&mut rng, 12, 24);
        let case = Case::build(&spec, &mut rng);
        let (f0, g0) = forward_backward(&case.problem());
        let with = |p: f64| {
            let mut s = spec.clone();
            s.dropout = Dropout {
                p,
                seed: 99 + i,
                offset: 5,
            };
            let mut c = case.clone();
            c.params = s.params();
            forward_backward(&c.problem())
        };
        let (f, g) = with(0.0);
        assert_eq!((&f, &g), (&f0, &g0), "case {i}: p = 0");
        let (f, g) = with(1.0);
        assert!(
            same_bits(f.lse.view(), f0.lse.view()),
            "case {i}: p = 1 lse"
        );
        assert!(f.o.iter().all(|&x| x == 0.0), "case {i}: p = 1 o");
        if let Some(g) = g {
            for t in [&g.dq, &g.dk, &g.dv] {
                assert!(t.iter().all(|&x| x == 0.0), "case {i}: p = 1 gradients");
            }
        }
    }
}
