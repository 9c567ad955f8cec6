//! How the envelope of the common designs weighs the 16-bit roundings of P and dS in the
//! allowance for another order (docs/judgement.md §2): the terms `conditioning::allowances`
//! and the range rule's reach (`props::envelope_reach`) take in units of `u`.

use smallseq_reference::Dtype;

/// The envelope's weight of one dS in the allowance for another order (docs/judgement.md §2):
/// `|dS| + P·(|dP| + |D| + d_from_o)`, for P, dP and D each held in 16 bits and D formed from
/// the stored O. `d_from_o` is the weight of that D's error: `Σ_d |dO·O|` where the range rule
/// asks, `Σ_d |dO|·max(|O|, O's own error / u)` in the allowances.
pub(crate) fn envelope_ds_weight(ds: f64, prob: f64, dp: f64, big_d: f64, d_from_o: f64) -> f64 {
    ds.abs() + prob * (dp.abs() + big_d.abs() + d_from_o)
}

/// P as the envelope's allowances weigh it (they take `u` times it): a design that rounds P
/// to the 16-bit input type before P·V, Pᵀ·dO or dS = P·(dP − D) (PyTorch's memory-efficient
/// backward forms dS from that P) moves a normal P by `u·P`, but below the smallest normal the
/// spacing is fixed, half of it `u·smallest normal`, and no P moves by more than itself (it
/// may round to 0). So the weight is `max(P, min(P/u, smallest normal))` (f16: P = 1.72e-7
/// rounds 4 % away, and a dK row fed only by such P moved by 3 %, H100 seed 29,
/// `tests/capsules/stored/torch-efficient-f16-subnormal-p-dk-row`). f32 P is not rounded.
pub(super) fn p_rounded_to(dtype: Dtype, prob: f64) -> f64 {
    if dtype == Dtype::F32 {
        return prob;
    }
    prob.max((prob / dtype.unit_roundoff()).min(dtype.smallest_normal()))
}

/// |dS| as the envelope's allowances weigh its 16-bit rounding (they take `u` times it), as
/// [`p_rounded_to`] weighs P's: a design may round dS, or `scale·dS` with the softmax scale
/// folded in (PyTorch's memory-efficient backward), and below the smallest normal the spacing
/// is fixed. With a scale under 1 the folded value is the smaller, so its subnormal floor is
/// `smallest normal / scale` in dS's units (f16, scale 0.01: a dK row fed by `0.01·dS` near
/// 1e-5 moved by 1 %, and rounding `0.01·dS` to f16 gives the recorded row to 3e-8, seed 71
/// group 23). f32 dS is not rounded.
pub(super) fn ds_rounded_to(dtype: Dtype, ds: f64, scale: f64) -> f64 {
    let ds = ds.abs();
    if dtype == Dtype::F32 || scale == 0.0 {
        return ds;
    }
    let floor = dtype.smallest_normal() / scale.abs().min(1.0);
    ds.max((ds / dtype.unit_roundoff()).min(floor))
}
