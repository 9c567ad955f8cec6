//! Cases whose answer is known in closed form.

mod common;

use approx::assert_relative_eq;
use common::{same_bits, Case, Rng, Spec};
use smallseq_reference::{emulate, forward_backward, naive, visible, Dtype, Mask, Window};

/// q = 0 makes every logit 0: o is the plain mean of the visible v rows, lse = ln(count).
#[test]
fn equal_logits_average_visible_values() {
    let mut rng = Rng::new(21);
    for mask in Mask::ALL {
        let mut spec = Spec::packed(&[(4, 6), (6, 3), (1, 1)], 4, 2, 8);
        spec.mask = mask;
        spec.window = Window { left: 3, right: 1 };
        let mut case = Case::build(&spec, &mut rng);
        case.q.fill(0.0);
        let (f, _) = forward_backward(&case.problem());
        let g = spec.heads / spec.kv_heads;
        let mut checked = 0;
        for i in 0..case.layout.slots() {
            let (lq, lk) = (case.layout.q.len(i), case.layout.kv.len(i));
            let (oq, ok) = (case.layout.q.offset(i), case.layout.kv.offset(i));
            for h in 0..spec.heads {
                for r in 0..lq {
                    let vis: Vec<usize> = (0..lk)
                        .filter(|&c| visible(mask, spec.window, r, c, lq, lk))
                        .collect();
                    if vis.is_empty() {
                        assert_eq!(f.lse[[oq + r, h]], f64::NEG_INFINITY);
                        continue;
                    }
                    checked += 1;
                    assert_relative_eq!(
                        f.lse[[oq + r, h]],
                        (vis.len() as f64).ln(),
                        epsilon = 1e-15
                    );
                    for d in 0..spec.dv {
                        let mean = vis
                            .iter()
                            .map(|&c| f64::from(case.v[[ok + c, h / g, d]]))
                            .sum::<f64>()
                            / vis.len() as f64;
                        assert_relative_eq!(
                            f.o[[oq + r, h, d]],
                            mean,
                            max_relative = 1e-14,
                            epsilon = 1e-15
                        );
                    }
                }
            }
        }
        assert!(checked > 0, "{mask}: no row checked");
    }
}

/// Window (0, 0) with Lq = Lk leaves exactly key r visible to row r: P = 1, so o = v_r
/// bitwise, lse = s_rr, and dS = P (dP - P dP) = 0 gives dq = 0 exactly.
#[test]
fn one_visible_key_copies_value_and_zeroes_dq() {
    let mut rng = Rng::new(22);
    let mut spec = Spec::packed(&[(5, 5), (3, 3)], 2, 1, 16);
    spec.window = Window { left: 0, right: 0 };
    spec.mask = Mask::Causal;
    let case = Case::build(&spec, &mut rng);
    let (f, g) = forward_backward(&case.problem());
    let g_ = g.unwrap();
    for i in 0..case.layout.slots() {
        let (oq, ok) = (case.layout.q.offset(i), case.layout.kv.offset(i));
        for r in 0..case.layout.q.len(i) {
            for h in 0..2 {
                for d in 0..16 {
                    assert_eq!(f.o[[oq + r, h, d]], f64::from(case.v[[ok + r, 0, d]]));
                    assert_eq!(g_.dq[[oq + r, h, d]], 0.0);
                }
                let s: f64 = (0..16)
                    .map(|d| f64::from(case.q[[oq + r, h, d]]) * f64::from(case.k[[ok + r, 0, d]]))
                    .sum::<f64>()
                    * spec.scale;
                assert_relative_eq!(f.lse[[oq + r, h]], s, epsilon = 1e-12);
            }
        }
    }
    // dv of key r collects d_o of row r over both heads of the group.
    assert!(g_.dv.iter().any(|&x| x != 0.0));
}

/// Causal bottom-right with Lq > Lk hides every key from the first Lq - Lk rows, and an
/// Lk = 0 slot hides all: o = 0, lse = -inf, no NaN, and their d_o cannot reach dk/dv.
#[test]
fn rows_without_visible_keys() {
    let mut rng = Rng::new(23);
    let mut spec = Spec::packed(&[(6, 2), (3, 0), (2, 2)], 2, 2, 4);
    spec.mask = Mask::CausalBottomRight;
    let case = Case::build(&spec, &mut rng);
    let empty_rows: Vec<usize> = (0..4).chain(6..9).collect();
    let run = |c: &Case| {
        let (f, g) = forward_backward(&c.problem());
        let (nf, ng) = naive::forward_backward(&c.problem());
        let (ef, eg) = emulate::forward_backward(&c.problem(), c.dtype);
        (f, g.unwrap(), nf, ng.unwrap(), ef, eg.unwrap())
    };
    let (f, g, nf, ng, ef, eg) = run(&case);
    for &t in &empty_rows {
        for h in 0..2 {
            for x in [f.lse[[t, h]], nf.lse[[t, h]], f64::from(ef.lse[[t, h]])] {
                assert_eq!(x, f64::NEG_INFINITY);
            }
            for d in 0..4 {
                for x in [
                    f.o[[t, h, d]],
                    g.dq[[t, h, d]],
                    nf.o[[t, h, d]],
                    ng.dq[[t, h, d]],
                ] {
                    assert_eq!(x, 0.0);
                }
                assert_eq!(ef.o[[t, h, d]], 0.0);
                assert_eq!(eg.dq[[t, h, d]], 0.0);
            }
        }
    }
    let finite = |a: &[f64]| a.iter().all(|x| !x.is_nan());
    assert!(finite(f.o.as_slice().unwrap()) && finite(g.dk.as_slice().unwrap()));
    assert!(ef
        .o
        .iter()
        .chain(eg.dk.iter())
        .chain(eg.dv.iter())
        .all(|x| !x.is_nan()));
    // Rows that see no key contribute nothing: change their d_o, keep every gradient.
    let mut other = case.clone();
    for &t in &empty_rows {
        other
            .d_o
            .as_mut()
            .unwrap()
            .slice_mut(ndarray::s![t, .., ..])
            .fill(1e30);
    }
    let (_, g2, _, ng2, _, eg2) = run(&other);
    assert!(same_bits(g.dk.view(), g2.dk.view()) && same_bits(g.dv.view(), g2.dv.view()));
    assert!(same_bits(ng.dk.view(), ng2.dk.view()) && same_bits(ng.dv.view(), ng2.dv.view()));
    assert!(same_bits(eg.dk.view(), eg2.dk.view()) && same_bits(eg.dv.view(), eg2.dv.view()));
    assert!(
        g.dv.iter().any(|&x| x != 0.0),
        "the visible rows must give some dv"
    );
}

/// o is linear in v and P does not depend on v: v · 2^k gives o · 2^k bitwise.
#[test]
fn scaling_v_by_power_of_two_scales_o_exactly() {
    let mut rng = Rng::new(24);
    for i in 0..20 {
        let spec = Spec::random(&mut rng, 10, 24);
        let case = Case::build(&spec, &mut rng);
        let (f, _) = forward_backward(&case.problem());
        let ef = emulate::forward_backward(&case.problem(), case.dtype).0;
        for k in [-3i32, 4] {
            let mut scaled = case.clone();
            scaled.v.mapv_inplace(|x| x * 2f32.powi(k));
            let (fs, _) = forward_backward(&scaled.problem());
            let efs = emulate::forward_backward(&scaled.problem(), case.dtype).0;
            let expect = f.o.mapv(|x| x * 2f64.powi(k));
            assert!(same_bits(fs.o.view(), expect.view()), "case {i}, k = {k}");
            assert!(
                same_bits(fs.lse.view(), f.lse.view()),
                "case {i}: lse moved"
            );
            // f16's narrow exponent range makes small outputs subnormal, where rounding is
            // not scale-invariant; bf16 and f32 share f32's range.
            if case.dtype == Dtype::F16 {
                continue;
            }
            let eexpect = ef.o.mapv(|x| x * 2f32.powi(k));
            assert!(
                same_bits(efs.o.view(), eexpect.view()),
                "case {i}, k = {k}: emulation"
            );
        }
    }
}
