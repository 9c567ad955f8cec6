//! The small matrix products of the equations, `C ← epilogue(A B)`.
//!
//! Every entry of `A B` is one chain of fused multiply-adds over the contraction index in
//! increasing order, starting from `+0`, restarted every [`KC`] terms with the partial chains
//! added in order. That is exactly what ndarray's `dot` computed here before (matrixmultiply's
//! FMA kernel, depth blocks of 256), so moving the products here left the reference's outputs
//! bitwise unchanged; it also makes them independent of the kernel a CPU happens to select (a
//! CPU without FMA computes the same chains, only slower).
//!
//! The products are tiny (`17 × 17 × 128` at most on the small-seq path), where packing and
//! per-call allocation cost more than the arithmetic, so operands are read in place: f32 or
//! f64, any row stride, converted to f64 on load (exact).

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

/// Depth of one chain before it is restarted (matrixmultiply's `kc` for f64).
const KC: usize = 256;

/// What is written to `C[i, j]` given `x = (A B)[i, j]`. The scale is one multiply of the
/// finished product and the accumulation one add, as in the two-step form of the equations.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Epilogue {
    /// `C = x`
    Store,
    /// `C = x · scale`
    Scaled(f64),
    /// `C = C + x`
    Add,
    /// `C = C + x · scale`
    AddScaled(f64),
}

/// `C ← epilogue(A B)` for `A [m, k]`, `B [k, n]`, `C [m, n]`; `A` may have any strides.
///
/// # Panics
/// If the shapes disagree.
pub(crate) fn gemm<TA, TB>(
    a: ArrayView2<'_, TA>,
    b: ArrayView2<'_, TB>,
    mut c: ArrayViewMut2<'_, f64>,
    epilogue: Epilogue,
) where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    let (m, k) = a.dim();
    let n = b.dim().1;
    assert_eq!(b.dim().0, k, "inner dimensions");
    assert_eq!(c.dim(), (m, n), "output shape");
    if m == 0 || n == 0 {
        return;
    }
    // The kernel loads rows of B and C as contiguous runs; other layouts (never produced by
    // this crate, possible with a caller's permuted views) go through contiguous copies,
    // which hold the same values.
    // (`from_shape_fn` because `mapv` and `to_owned` keep a column-major layout.)
    if n > 1 && b.strides()[1] != 1 {
        let b = Array2::from_shape_fn(b.dim(), |ix| b[ix].into());
        return gemm(a, b.view(), c, epilogue);
    }
    if n > 1 && c.strides()[1] != 1 {
        let mut tmp = Array2::from_shape_fn(c.dim(), |ix| c[ix]);
        gemm(a, b, tmp.view_mut(), epilogue);
        c.assign(&tmp);
        return;
    }
    let g = Operands {
        m,
        n,
        k,
        a: a.as_ptr(),
        rsa: a.strides()[0],
        csa: a.strides()[1],
        b: b.as_ptr(),
        rsb: b.strides()[0],
        c: c.as_mut_ptr(),
        rsc: c.strides()[0],
    };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the features are present; `g` describes the borrowed views above.
        unsafe { gemm_avx2_fma(g, epilogue) };
        return;
    }
    // SAFETY: `g` describes the borrowed views above.
    unsafe { tiles(g, epilogue) };
}

/// Raw view of the operands: element `(i, j)` of a matrix at `ptr + i·rs + j·cs`, with
/// `cs = 1` for `B` and `C`.
#[derive(Clone, Copy)]
struct Operands<TA, TB> {
    m: usize,
    n: usize,
    k: usize,
    a: *const TA,
    rsa: isize,
    csa: isize,
    b: *const TB,
    rsb: isize,
    c: *mut f64,
    rsc: isize,
}

/// [`tiles`] compiled with FMA and 256-bit vectors, selected at run time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_avx2_fma<TA, TB>(g: Operands<TA, TB>, epilogue: Epilogue)
where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    tiles(g, epilogue);
}

/// Covers `C` with register tiles of `R` rows by `W` columns. Four rows by eight columns is
/// eight 4-lane accumulators, enough independent chains to hide the FMA latency; leftover
/// rows take wider tiles for the same reason.
#[inline(always)]
unsafe fn tiles<TA, TB>(g: Operands<TA, TB>, e: Epilogue)
where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    let mut i = 0;
    while i + 4 <= g.m {
        row_block::<4, 8, _, _>(g, i, e);
        i += 4;
    }
    match g.m - i {
        3 => row_block::<3, 8, _, _>(g, i, e),
        2 => row_block::<2, 16, _, _>(g, i, e),
        1 => row_block::<1, 32, _, _>(g, i, e),
        _ => {}
    }
}

/// Rows `i..i+R` of `C`: columns in tiles of `W`, then 8, 4 and 1.
#[inline(always)]
unsafe fn row_block<const R: usize, const W: usize, TA, TB>(
    g: Operands<TA, TB>,
    i: usize,
    e: Epilogue,
) where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    let mut j = 0;
    j = sweep::<R, W, _, _>(g, i, j, e);
    j = sweep::<R, 8, _, _>(g, i, j, e);
    j = sweep::<R, 4, _, _>(g, i, j, e);
    sweep::<R, 1, _, _>(g, i, j, e);
}

/// Tiles `R × W` at rows `i..`, from column `j` while a whole tile fits; returns the next
/// column.
#[inline(always)]
unsafe fn sweep<const R: usize, const W: usize, TA, TB>(
    g: Operands<TA, TB>,
    i: usize,
    mut j: usize,
    e: Epilogue,
) -> usize
where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    while j + W <= g.n {
        let c = g.c.offset(i as isize * g.rsc).add(j);
        if g.k <= KC {
            // The common case on its own, so the tile stays in registers.
            store::<R, W>(c, g.rsc, &chains::<R, W, _, _>(g, i, j, 0, g.k), e);
        } else {
            let mut x = chains::<R, W, _, _>(g, i, j, 0, KC);
            let mut k0 = KC;
            while k0 < g.k {
                let part = chains::<R, W, _, _>(g, i, j, k0, g.k.min(k0 + KC));
                for (xr, pr) in x.iter_mut().zip(&part) {
                    for (xe, pe) in xr.iter_mut().zip(pr) {
                        *xe += pe;
                    }
                }
                k0 += KC;
            }
            store::<R, W>(c, g.rsc, &x, e);
        }
        j += W;
    }
    j
}

/// The `R × W` chains `Σ_{k0 <= p < k1} A[i+r, p] B[p, j+w]`, one FMA per term in order.
#[inline(always)]
unsafe fn chains<const R: usize, const W: usize, TA, TB>(
    g: Operands<TA, TB>,
    i: usize,
    j: usize,
    k0: usize,
    k1: usize,
) -> [[f64; W]; R]
where
    TA: Copy + Into<f64>,
    TB: Copy + Into<f64>,
{
    let mut acc = [[0.0f64; W]; R];
    let a = g.a.offset(i as isize * g.rsa);
    let b = g.b.add(j);
    for p in k0..k1 {
        let brow = b.offset(p as isize * g.rsb);
        let bv: [f64; W] = std::array::from_fn(|w| (*brow.add(w)).into());
        for (r, accr) in acc.iter_mut().enumerate() {
            let av: f64 = (*a.offset(r as isize * g.rsa + p as isize * g.csa)).into();
            for (acc, &bw) in accr.iter_mut().zip(&bv) {
                *acc = av.mul_add(bw, *acc);
            }
        }
    }
    acc
}

#[inline(always)]
unsafe fn store<const R: usize, const W: usize>(
    c: *mut f64,
    rsc: isize,
    x: &[[f64; W]; R],
    e: Epilogue,
) {
    for (r, xr) in x.iter().enumerate() {
        let row = c.offset(r as isize * rsc);
        for (w, &x) in xr.iter().enumerate() {
            let c = row.add(w);
            *c = match e {
                Epilogue::Store => x,
                Epilogue::Scaled(s) => x * s,
                Epilogue::Add => *c + x,
                Epilogue::AddScaled(s) => *c + x * s,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::ShapeBuilder;

    /// The contract spelled out one entry at a time: chains of at most `KC` FMAs in index
    /// order, partial chains added in order, then the epilogue.
    fn spec(a: &Array2<f64>, b: &Array2<f64>, c: &mut Array2<f64>, e: Epilogue) {
        let k = a.ncols();
        for ((i, j), c) in c.indexed_iter_mut() {
            let mut x = 0.0;
            for k0 in (0..k).step_by(KC) {
                let mut chain = 0.0f64;
                for p in k0..k.min(k0 + KC) {
                    chain = a[[i, p]].mul_add(b[[p, j]], chain);
                }
                x = if k0 == 0 { chain } else { x + chain };
            }
            *c = match e {
                Epilogue::Store => x,
                Epilogue::Scaled(s) => x * s,
                Epilogue::Add => *c + x,
                Epilogue::AddScaled(s) => *c + x * s,
            };
        }
    }

    /// Deterministic values with every sign and many magnitudes, exact in f32.
    fn fill(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut z = seed;
        Array2::from_shape_simple_fn((rows, cols), || {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let m = ((z >> 40) as i32 - (1 << 23)) as f32;
            m * f32::powi(2.0, (z >> 33 & 15) as i32 - 30)
        })
    }

    fn bits(x: &Array2<f64>) -> Vec<u64> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn every_tile_shape_depth_and_epilogue_matches_the_chain_definition() {
        let epilogues = [
            Epilogue::Store,
            Epilogue::Scaled(-0.3),
            Epilogue::Add,
            Epilogue::AddScaled(0.7),
        ];
        let mut seed = 1;
        for m in [1, 2, 3, 4, 5, 7, 9] {
            for n in [1, 3, 4, 5, 8, 12, 17, 33, 40] {
                for k in [1, 2, 9, 256, 257, 600] {
                    for e in epilogues {
                        seed += 1;
                        let a32 = fill(m, k, seed);
                        let b32 = fill(k, n, seed + 1000);
                        let c0 = fill(m, n, seed + 2000).mapv(f64::from);
                        let (a, b) = (a32.mapv(f64::from), b32.mapv(f64::from));
                        let mut want = c0.clone();
                        spec(&a, &b, &mut want, e);
                        // f32 operands read in place, f64 operands, A transposed in memory.
                        let mut got = c0.clone();
                        gemm(a32.view(), b32.view(), got.view_mut(), e);
                        assert_eq!(bits(&got), bits(&want), "f32 {m}x{k}x{n} {e:?}");
                        let mut got = c0.clone();
                        let a_t = a.t().as_standard_layout().into_owned();
                        gemm(a_t.t(), b.view(), got.view_mut(), e);
                        assert_eq!(bits(&got), bits(&want), "f64 A^T {m}x{k}x{n} {e:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn column_strided_operands_take_the_copy_path() {
        let (m, k, n) = (5, 19, 13);
        let a = fill(m, k, 1).mapv(f64::from);
        let b = fill(k, n, 2).mapv(f64::from);
        let mut want = Array2::zeros((m, n));
        spec(&a, &b, &mut want, Epilogue::Store);
        let b_f = Array2::from_shape_vec((k, n).f(), b.t().iter().copied().collect()).unwrap();
        assert_eq!(b_f, b);
        let mut got = Array2::zeros((m, n).f());
        gemm(a.view(), b_f.view(), got.view_mut(), Epilogue::Store);
        assert_eq!(bits(&got.as_standard_layout().into_owned()), bits(&want));
    }
}
