//! The emulation stays within a few unit roundoffs of the f64 reference, and it does round
//! (its error is of the dtype's order, not f64's).

mod common;

use common::{rel_err, Case, Rng, Spec};
use ndarray::{Array, Dimension};
use smallseq_reference::{emulate, forward_backward, Dtype};

fn up<D: Dimension>(a: &Array<f32, D>) -> Array<f64, D> {
    a.mapv(f64::from)
}

#[test]
fn emulation_error_is_of_unit_roundoff_order() {
    for dtype in Dtype::ALL {
        let u = dtype.unit_roundoff();
        let mut rng = Rng::new(41);
        let mut worst = [0.0f64; 5];
        for i in 0..40 {
            let mut spec = Spec::random(&mut rng, 17, 64);
            spec.dtype = dtype;
            let case = Case::build(&spec, &mut rng);
            let p = case.problem();
            let (f, g) = forward_backward(&p);
            let (ef, eg) = emulate::forward_backward(&p, dtype);
            let (g, eg) = (g.unwrap(), eg.unwrap());
            // lse is f32 whatever the dtype: judged against f32's roundoff, per unit of |lse|.
            let errs = [
                rel_err(up(&ef.o).view(), f.o.view(), 1e-3),
                rel_err(up(&ef.lse).view(), f.lse.view(), 1.0) * u / 2f64.powi(-24),
                rel_err(up(&eg.dq).view(), g.dq.view(), 1e-3),
                rel_err(up(&eg.dk).view(), g.dk.view(), 1e-3),
                rel_err(up(&eg.dv).view(), g.dv.view(), 1e-3),
            ];
            // Storing in the dtype costs a few u; the f32 dot products and sums add up to
            // about (length) · u_f32 on top, which only shows when the dtype is f32 itself.
            let n = (spec.dqk + spec.dv + case.layout.kv.max_len()) as f64;
            let tol = 16.0 * u + 2.0 * n * 2f64.powi(-24);
            for (w, e) in worst.iter_mut().zip(errs) {
                assert!(
                    e <= tol,
                    "{dtype} case {i}: error {e:e} > {tol:e}; {errs:?}"
                );
                *w = w.max(e);
            }
        }
        // Not f64 in disguise: o, dq, dk, dv carry the dtype's rounding somewhere.
        for (name, w) in ["o", "dq", "dk", "dv"]
            .iter()
            .zip([worst[0], worst[2], worst[3], worst[4]])
        {
            assert!(
                w >= u / 8.0,
                "{dtype}: {name} worst error {w:e} far below u = {u:e}"
            );
        }
        println!("{dtype}: worst errors / u = {:?}", worst.map(|w| w / u));
    }
}

/// f16, one head of dimension 1, scale 1, `lq` queries against `k.len()` keys in one slot.
fn overflow_case(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
) -> (
    ndarray::Array3<f32>,
    [ndarray::Array3<f32>; 3],
    smallseq_reference::Layout,
) {
    let a = |x: &[f32]| ndarray::Array3::from_shape_vec((x.len(), 1, 1), x.to_vec()).unwrap();
    let layout = smallseq_reference::Layout::packed(&[(q.len(), k.len())]);
    (a(q), [a(k), a(v), a(d_o)], layout)
}

/// Where the f64 reference lies past f16's largest value, the emulation holds the infinity of
/// its sign (never NaN, never a finite stand-in); where the reference is finite, so is it.
/// (The harness excuses a non-finite value it shares with a kernel only there: issue 21.)
#[test]
fn the_emulation_overflows_where_the_reference_does_with_its_sign() {
    use smallseq_reference::{AttnParams, Dropout, Mask, Problem, Window};
    let params = AttnParams {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim_qk: 1,
        head_dim_v: 1,
        mask: Mask::Padding,
        window: Window::NONE,
        scale: 1.0,
        dropout: Dropout::NONE,
        bias: smallseq_reference::AttnBias::None,
    };
    let max = f64::from(Dtype::F16.max_finite());
    // (1) Four queries on one key, dO = 30,000 each: dV = 120,000. (2) Q = 0, so P = 1/2,
    // V = ±60,000 and dO = 1: dS = ±30,000 (finite in f16), and dQ = Σ dS·K with K = ±2 is
    // 120,000. (3) Negative: K = ∓2 gives dQ = -120,000. O stays finite (|O| ≤ max |V|).
    let cases = [
        overflow_case(&[1.0; 4], &[0.5], &[1.0], &[30000.0; 4]),
        overflow_case(&[0.0], &[2.0, -2.0], &[60000.0, -60000.0], &[1.0]),
        overflow_case(&[0.0], &[-2.0, 2.0], &[60000.0, -60000.0], &[1.0]),
    ];
    let mut past = 0;
    for (i, (q, [k, v, d_o], layout)) in cases.iter().enumerate() {
        let p = Problem::new(
            &params,
            layout,
            q.view(),
            k.view(),
            v.view(),
            Some(d_o.view()),
        )
        .unwrap();
        let (f, g) = forward_backward(&p);
        let (ef, eg) = emulate::forward_backward(&p, Dtype::F16);
        let (g, eg) = (g.unwrap(), eg.unwrap());
        let pairs = [
            (&f.o, &ef.o),
            (&g.dq, &eg.dq),
            (&g.dk, &eg.dk),
            (&g.dv, &eg.dv),
        ];
        for (t, (r, e)) in pairs.into_iter().enumerate() {
            for (&r, &e) in r.iter().zip(e.iter()) {
                let e = f64::from(e);
                assert!(
                    !e.is_nan(),
                    "case {i} tensor {t}: NaN where the reference is {r}"
                );
                if r.abs() > max {
                    past += 1;
                    assert_eq!(e, r.signum() * f64::INFINITY, "case {i} tensor {t}: {r}");
                } else {
                    assert!(
                        e.is_finite(),
                        "case {i} tensor {t}: {e} where the reference is {r}"
                    );
                }
            }
        }
    }
    // dV of (1), dQ of (2) and (3).
    assert!(past >= 3, "{past} elements past the limit");
}
