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
