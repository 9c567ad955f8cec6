//! Central finite differences in f64 against the analytic gradients of `L = Σ o ∘ d_o`.

mod common;

use common::{rel_err, Case, Rng, Spec};
use ndarray::{Array3, Axis};
use smallseq_reference::{forward_backward_views, Dropout, Mask, Window};

/// `L = Σ_{valid tq} o ∘ d_o`; don't-care rows of `d_o` hold NaN, so they stay out.
fn loss(case: &Case, q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>, d_o: &Array3<f64>) -> f64 {
    let (f, _) = forward_backward_views::<f64>(
        &case.params,
        &case.layout,
        q.view(),
        k.view(),
        v.view(),
        None,
    );
    let valid = case.layout.q.valid_tokens();
    f.o.axis_iter(Axis(0))
        .zip(d_o.axis_iter(Axis(0)))
        .zip(valid)
        .filter(|(_, ok)| *ok)
        .map(|((o, d), _)| (&o * &d).sum())
        .sum()
}

/// Finite-difference gradient of `L` with respect to `which` (0 = q, 1 = k, 2 = v) on valid
/// tokens; don't-care entries stay 0.
fn fd_grad(case: &Case, which: usize) -> Array3<f64> {
    let [q, k, v, d_o] = case.to_f64();
    let mut x = [q, k, v];
    let valid = if which == 0 {
        case.layout.q.valid_tokens()
    } else {
        case.layout.kv.valid_tokens()
    };
    let mut g = Array3::zeros(x[which].dim());
    let h = 1e-5;
    for idx in ndarray::indices(x[which].dim()) {
        if !valid[idx.0] {
            continue;
        }
        let x0 = x[which][idx];
        x[which][idx] = x0 + h;
        let lp = loss(case, &x[0], &x[1], &x[2], &d_o);
        x[which][idx] = x0 - h;
        let lm = loss(case, &x[0], &x[1], &x[2], &d_o);
        x[which][idx] = x0;
        g[idx] = (lp - lm) / (2.0 * h);
    }
    g
}

fn check(case: &Case, what: &str) -> f64 {
    let (_, g) = smallseq_reference::forward_backward(&case.problem());
    let g = g.expect("d_o given");
    let mut scale = 0.0f64;
    for (name, which, analytic) in [("dq", 0, &g.dq), ("dk", 1, &g.dk), ("dv", 2, &g.dv)] {
        let fd = fd_grad(case, which);
        let err = rel_err(fd.view(), analytic.view(), 1e-2);
        assert!(err <= 1e-6, "{what}: {name} rel err {err:e}");
        scale = scale.max(analytic.iter().fold(0.0, |m, x| m.max(x.abs())));
    }
    scale
}

#[test]
fn fd_every_mask_window_and_gqa() {
    let mut rng = Rng::new(7);
    let windows = [
        Window::NONE,
        Window { left: 1, right: 0 },
        Window { left: 0, right: 2 },
        Window { left: 2, right: -1 },
    ];
    let mut nontrivial = 0;
    for mask in Mask::ALL {
        for (hi, (heads, kv_heads)) in [(4, 2), (4, 1), (2, 2)].into_iter().enumerate() {
            let window = windows[(hi + mask as usize) % windows.len()];
            let mut spec = Spec::packed(
                &[(3, 5), (0, 2), (4, 3), (2, 0), (5, 5)],
                heads,
                kv_heads,
                3,
            );
            spec.dv = 2;
            spec.pads = vec![(1, 0), (2, 1), (0, 2), (1, 1), (0, 0)];
            spec.tail = (2, 1);
            spec.mask = mask;
            spec.window = window;
            spec.scale = 0.9;
            let case = Case::build(&spec, &mut rng);
            if check(
                &case,
                &format!("{mask} {window:?} H={heads} Hkv={kv_heads}"),
            ) > 1e-3
            {
                nontrivial += 1;
            }
        }
    }
    assert_eq!(nontrivial, 18, "every case must have non-zero gradients");
}

#[test]
fn fd_random_geometries() {
    let mut rng = Rng::new(11);
    for i in 0..40 {
        let spec = Spec::random(&mut rng, 5, 4);
        let case = Case::build(&spec, &mut rng);
        check(&case, &format!("random case {i}: {spec:?}"));
    }
}

/// With a fixed mask dropout is linear in P, so finite differences see its gradients too:
/// dV from the dropped P, dP masked and rescaled, D = rowsum(dO ∘ O).
#[test]
fn fd_with_dropout() {
    let mut rng = Rng::new(13);
    for (i, p) in [0.1, 0.5, 0.9, 1.0].into_iter().enumerate() {
        let mut spec = Spec::packed(&[(3, 5), (0, 2), (4, 3), (5, 5)], 4, 2, 3);
        spec.dv = 2;
        spec.mask = Mask::ALL[i];
        spec.scale = 0.9;
        spec.dropout = Dropout {
            p,
            seed: 0xdead_beef_0000 + i as u64,
            offset: 7 * i as u64,
        };
        let case = Case::build(&spec, &mut rng);
        let scale = check(&case, &format!("dropout p = {p}"));
        // p = 1 drops everything: every gradient is exactly 0.
        assert_eq!(scale == 0.0, p == 1.0, "p = {p}: largest gradient {scale}");
    }
}

/// `L` as a function of the post-scale bias (the inputs fixed).
fn loss_of_bias(case: &Case, bias: ndarray::Array4<f32>) -> f64 {
    let [q, k, v, d_o] = case.to_f64();
    let mut c = case.clone();
    c.params.bias = smallseq_reference::AttnBias::PostScale(std::sync::Arc::new(bias));
    loss(&c, &q, &k, &v, &d_o)
}

/// dQ, dK, dV under a bias and ALiBi, and dBias against finite differences of each entry
/// (the bias is f32: each step is the one f32 can hold, and broadcast entries sum the slots
/// and heads that read them).
#[test]
fn fd_with_bias() {
    let mut rng = Rng::new(17);
    for (i, (per_slot, per_head)) in [(false, true), (true, false), (true, true), (false, false)]
        .into_iter()
        .enumerate()
    {
        let mut spec = Spec::packed(&[(3, 5), (0, 2), (4, 3), (5, 5)], 4, 2, 3);
        spec.dv = 2;
        spec.mask = Mask::ALL[i + 1];
        spec.scale = 0.9;
        spec.bias = common::post_scale_bias(&mut rng, &spec, per_slot, per_head, 8);
        let case = Case::build(&spec, &mut rng);
        check(&case, &format!("bias {per_slot} {per_head}"));
        let smallseq_reference::AttnBias::PostScale(t) = &case.params.bias else {
            unreachable!()
        };
        let (_, g) = smallseq_reference::forward_backward(&case.problem());
        let analytic = g.unwrap().dbias.expect("a post-scale bias has a gradient");
        let mut fd = ndarray::Array4::<f64>::zeros(t.dim());
        for idx in ndarray::indices(t.dim()) {
            let x0 = t[idx];
            if !x0.is_finite() {
                continue;
            }
            let h = 2f32.powi(-12);
            let (mut up, mut down) = ((**t).clone(), (**t).clone());
            up[idx] = x0 + h;
            down[idx] = x0 - h;
            let step = f64::from(up[idx]) - f64::from(down[idx]);
            fd[idx] = (loss_of_bias(&case, up) - loss_of_bias(&case, down)) / step;
        }
        let err = rel_err(fd.view(), analytic.view(), 1e-2);
        assert!(err <= 1e-5, "case {i}: dbias rel err {err:e}");
        assert!(
            analytic.iter().any(|x| x.abs() > 1e-3),
            "case {i}: dbias is zero"
        );
    }
    let mut spec = Spec::packed(&[(3, 5), (4, 3)], 2, 2, 3);
    spec.bias = common::alibi(&mut rng, &spec);
    let case = Case::build(&spec, &mut rng);
    check(&case, "alibi");
}
