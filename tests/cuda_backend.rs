//! CUDA backend against the f64 reference and the CPU backend on random cases (skips without a
//! device), dropout and bias included (`docs/semantics.md` §1.8, §1.9). `SMALLSEQ_BENCH=1`
//! also runs the benchmark (`src/cli/bench.rs`).
#![cfg(feature = "cuda")]

#[path = "support/cuda_device.rs"]
mod cuda_device;

#[allow(unused_macros)]
#[macro_use]
#[path = "../src/cli/say.rs"]
mod say;

#[allow(dead_code)]
#[path = "../src/cli/bench.rs"]
mod bench;

use ndarray::{Array3, Array4};
use smallseq::backend::gpu::cuda::CudaBackend;
use smallseq::backend::{cpu::CpuBackend, Backend, BwdArgs, BwdBufs, DevBuf, FwdArgs, FwdBufs};
use smallseq::case_file::read_case;
use smallseq::dispatch::Path;
use smallseq::harness::props::Checker;
use smallseq::harness::repro::rerun;
use smallseq::harness::rng::{Draw, Rng};
use smallseq::workspace::{plan, Direction, Shape};
use smallseq::AttnConfig;
use smallseq_reference::{AttnBias, Dtype, Layout, Mask, Problem, Side, Window};
use std::sync::Arc;

struct Case {
    cfg: AttnConfig,
    layout: Layout,
    q: Array3<f32>,
    k: Array3<f32>,
    v: Array3<f32>,
    d_o: Array3<f32>,
}

fn gen_case(r: &mut Rng, small: bool) -> Case {
    let dtype = if small {
        [Dtype::Bf16, Dtype::F16][r.range(0, 1)]
    } else {
        [Dtype::Bf16, Dtype::F16, Dtype::F32][r.range(0, 2)]
    };
    let d = if small {
        [64, 128, 256][r.range(0, 2)]
    } else {
        [16, 40, 64, 128][r.range(0, 3)]
    };
    let dv = if small || r.range(0, 1) == 0 {
        d
    } else {
        [8, 24, 64][r.range(0, 2)]
    };
    let hkv = r.range(1, 3);
    let h = if small { hkv } else { hkv * r.range(1, 3) };
    let mask = Mask::ALL[r.range(0, 5)];
    let mut cfg = AttnConfig::new(dtype, h, d, mask);
    cfg.params.num_kv_heads = hkv;
    cfg.params.head_dim_v = dv;
    if !small && r.range(0, 2) == 0 {
        cfg.params.window = Window {
            left: r.range(0, 6) as i64 - 1,
            right: r.range(0, 6) as i64 - 1,
        };
    }
    cfg.params.scale = [1.0 / (d as f64).sqrt(), 1.0, 0.3][r.range(0, 2)];
    let b = [0, 1, 3, 20, 200][r.range(0, 4)];
    let maxl = if small { 17 } else { 70 };
    let (mut cq, mut ck, mut oq, mut ok) = (vec![0], vec![0], vec![0], vec![0]);
    for _ in 0..b {
        let lq = if r.range(0, 9) == 0 {
            0
        } else {
            r.range(1, maxl)
        };
        let lk = if r.range(0, 12) == 0 {
            0
        } else {
            r.range(1, maxl)
        };
        cq.push(cq.last().unwrap() + lq as i32);
        ck.push(ck.last().unwrap() + lk as i32);
        oq.push(oq.last().unwrap() + (lq + r.range(0, 2)) as i32);
        ok.push(ok.last().unwrap() + (lk + r.range(0, 2)) as i32);
    }
    let tq = *oq.last().unwrap() as usize + r.range(0, 3);
    let tk = *ok.last().unwrap() as usize + r.range(0, 3);
    let layout = Layout::new(
        Side {
            cu: cq,
            padded: Some(oq),
            tokens: tq,
        },
        Side {
            cu: ck,
            padded: Some(ok),
            tokens: tk,
        },
    )
    .unwrap();
    let vq = layout.q.valid_tokens();
    let vk = layout.kv.valid_tokens();
    let mut fill = |t: usize, hh: usize, dd: usize, valid: &[bool]| {
        Array3::from_shape_fn((t, hh, dd), |(i, _, _)| {
            if valid[i] {
                let x = (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
                dtype.round(x)
            } else {
                f32::NAN
            }
        })
    };
    let q = fill(tq, h, d, &vq);
    let k = fill(tk, hkv, d, &vk);
    let v = fill(tk, hkv, dv, &vk);
    let d_o = fill(tq, h, dv, &vq);
    Case {
        cfg,
        layout,
        q,
        k,
        v,
        d_o,
    }
}

/// Whether flat element `i` of a tensor with rows of `t` elements lies on a valid token.
fn by_row(t: usize, valid: &[bool]) -> impl Fn(usize) -> bool + '_ {
    move |i| valid[i / t]
}

fn rel_err(got: &[f32], want: &[f64], valid: impl Fn(usize) -> bool) -> (f64, bool) {
    let (mut num, mut den, mut finite) = (0f64, 0f64, true);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !valid(i) {
            continue;
        }
        let inf_ok = w.is_infinite() && g as f64 == w;
        if !(g.is_finite() || inf_ok) {
            finite = false;
        }
        if w.is_finite() {
            num += (g as f64 - w).powi(2);
            den += w * w;
        }
    }
    ((num / den.max(1e-30)).sqrt(), finite)
}

/// The case as the reference takes it, with its output gradient.
fn problem(c: &Case) -> Problem<'_> {
    Problem::new(
        &c.cfg.params,
        &c.layout,
        c.q.view(),
        c.k.view(),
        c.v.view(),
        Some(c.d_o.view()),
    )
    .unwrap()
}

fn run_case(be: &dyn Backend, c: &Case, path: Path) -> (FwdBufs, Option<BwdBufs>) {
    run_mixed(be, c, path, path)
}

/// Forward on `fwd_path`, then backward on `bwd_path` from that forward's o and lse.
fn run_mixed(
    be: &dyn Backend,
    c: &Case,
    fwd_path: Path,
    bwd_path: Path,
) -> (FwdBufs, Option<BwdBufs>) {
    let p = &c.cfg.params;
    let (tq, tk) = (c.layout.q.tokens, c.layout.kv.tokens);
    let shape = Shape {
        tq,
        tk,
        tq_addressed: *c.layout.q.offsets().last().unwrap() as usize,
        heads: p.num_heads,
        kv_heads: p.num_kv_heads,
        head_dim_qk: p.head_dim_qk,
        head_dim_v: p.head_dim_v,
        thd: true,
    };
    let fplan = plan(Direction::Fwd, Some(fwd_path), &shape);
    let fa = FwdArgs {
        config: &c.cfg,
        layout: &c.layout,
        q: c.q.view(),
        k: c.k.view(),
        v: c.v.view(),
        plan: &fplan,
    };
    let mut fo = FwdBufs {
        o: DevBuf::new(tq * p.num_heads * p.head_dim_v, f32::NAN),
        lse: DevBuf::new(tq * p.num_heads, f32::NAN),
        workspace: DevBuf::new(fplan.total, f32::NAN),
    };
    match fwd_path {
        Path::SmallSeq => be.small_seq_fwd(&fa, &mut fo).unwrap(),
        Path::Fallback => be.fallback_fwd(&fa, &mut fo).unwrap(),
    }
    let o = Array3::from_shape_vec((tq, p.num_heads, p.head_dim_v), fo.o.body().to_vec()).unwrap();
    let lse = ndarray::Array2::from_shape_vec((tq, p.num_heads), fo.lse.body().to_vec()).unwrap();
    let bplan = plan(Direction::Bwd, Some(bwd_path), &shape);
    let ba = BwdArgs {
        fwd: FwdArgs { plan: &bplan, ..fa },
        o: o.view(),
        lse: lse.view(),
        d_o: c.d_o.view(),
    };
    let mut bo = BwdBufs {
        dq: DevBuf::new(tq * p.num_heads * p.head_dim_qk, f32::NAN),
        dk: DevBuf::new(tk * p.num_kv_heads * p.head_dim_qk, f32::NAN),
        dv: DevBuf::new(tk * p.num_kv_heads * p.head_dim_v, f32::NAN),
        workspace: DevBuf::new(bplan.total, f32::NAN),
        // Poisoned: a backend that computes bias writes every element.
        dbias: p
            .bias
            .grad_shape()
            .map(|s| DevBuf::new(s.iter().product(), f32::NAN)),
    };
    match bwd_path {
        Path::SmallSeq => be.small_seq_bwd(&ba, &mut bo).unwrap(),
        Path::Fallback => be.fallback_bwd(&ba, &mut bo).unwrap(),
    }
    (fo, Some(bo))
}

/// The device, or `None` after a visible SKIP line (a failure when `SMALLSEQ_REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<CudaBackend> {
    cuda_device::cuda_or_skip(test, &[])
}

/// Slots whose rows see exactly one key (Lk = 1, or row 0 under top-left causal), with the
/// scores in the hundreds (harness distribution `large`: q, k ~ N(0, 40²), v, dO ~ N(0, 100²)).
fn one_key_case(dtype: Dtype, d: usize, heads: usize, kv_heads: usize, causal: bool) -> Case {
    let mask = if causal { Mask::Causal } else { Mask::NoMask };
    let mut cfg = AttnConfig::new(dtype, heads, d, mask);
    cfg.params.num_kv_heads = kv_heads;
    let lens: Vec<(usize, usize)> = if causal {
        vec![(1, 5), (1, 17), (1, 1)]
    } else {
        vec![(1, 1), (7, 1), (17, 1), (3, 1)]
    };
    let layout = Layout::packed(&lens);
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let mut r = Rng::new(0x1e7 + d as u64);
    let mut fill = |t: usize, hh: usize, sd: f64| {
        Array3::from_shape_fn((t, hh, d), |_| dtype.round((r.normal() * sd) as f32))
    };
    let q = fill(tq, heads, 40.0);
    let k = fill(tk, kv_heads, 40.0);
    let v = fill(tk, kv_heads, 100.0);
    let d_o = fill(tq, heads, 100.0);
    Case {
        cfg,
        layout,
        q,
        k,
        v,
        d_o,
    }
}

/// Regression (issue 6, fuzz seed 7/11 capsules of the `large` distribution): a row with one
/// visible key has P = 1, so o = v exactly and dq, dk exactly 0. The kernels computed
/// exp(fma(dot, scale, -lse)) in the backward (and the fallback forward's exp(s - m)), i.e. the
/// unrounded score against the rounded one: P = 1 - 1e-5, dk up to 6e1 or inf.
#[test]
fn one_key_rows_are_exact() {
    let Some(be) = gpu("one_key_rows_are_exact") else {
        return;
    };
    let mut bad = Vec::new();
    for (fwd_path, bwd_path) in [
        (Path::SmallSeq, Path::SmallSeq),
        (Path::Fallback, Path::Fallback),
        // The mixed path: the small-seq forward's lse sums its dot products in another order.
        (Path::SmallSeq, Path::Fallback),
    ] {
        for dtype in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            if dtype == Dtype::F32 && fwd_path == Path::SmallSeq {
                continue;
            }
            for d in [64, 128, 256] {
                for causal in [false, true] {
                    let c = one_key_case(dtype, d, 2, 2, causal);
                    let (fo, bo) = run_mixed(&be, &c, fwd_path, bwd_path);
                    let bo = bo.unwrap();
                    let h = 2;
                    let what = format!("{fwd_path:?}->{bwd_path:?} {dtype} d{d} causal {causal}");
                    // (token, its slot's first key) of every one-key row: causal rows past 0
                    // see several keys.
                    let rows: Vec<(usize, usize)> = (0..c.layout.slots())
                        .flat_map(|i| {
                            let (oq, ok) = (c.layout.q.offset(i), c.layout.kv.offset(i));
                            let n = if causal { 1 } else { c.layout.q.len(i) };
                            (oq..oq + n).map(move |t| (t, ok))
                        })
                        .collect();
                    for &(t, key) in &rows {
                        for hh in 0..h {
                            for j in 0..d {
                                let o = fo.o.body()[(t * h + hh) * d + j];
                                let want = c.v[[key, hh, j]];
                                if o != want {
                                    bad.push(format!("{what}: o[{t},{hh},{j}] = {o}, v = {want}"));
                                }
                                let g = bo.dq.body()[(t * h + hh) * d + j];
                                if g != 0.0 {
                                    bad.push(format!("{what}: dq[{t},{hh},{j}] = {g}"));
                                }
                            }
                        }
                    }
                    // Every query row is a one-key row (causal slots have Lq = 1), so every
                    // dk is 0 (keys no row sees included).
                    if let Some((i, x)) = bo.dk.body().iter().enumerate().find(|(_, x)| **x != 0.0)
                    {
                        bad.push(format!("{what}: dk[{i}] = {x}"));
                    }
                }
            }
        }
    }
    for b in bad.iter().take(20) {
        eprintln!("{b}");
    }
    assert!(bad.is_empty(), "{} inexact one-key outputs", bad.len());
}

/// Regression: the shrunk capsules of the H200 fuzz failures of issue 6 (`tests/capsules/cuda`,
/// named by campaign seed and case) pass every property on the device. Causes: one-key rows
/// with P = 1 - 1e-5 from an FMA of the score (seed 11 cases 4, 856), tensor-core chained
/// accumulation (seed 11 case 1477, lse 4 ulp off), the f32 fallback's fused products and f32
/// D (seed 7 cases 846, 1966, 3539, and 584's dq not exactly 4x under v, dO scaled by 2; all
/// four pass since both changes, which one fixed which was not separated), dS rounded to f16
/// overflowing (seed 7 case 4440).
#[test]
fn fuzz_capsules_pass() {
    let Some(be) = gpu("fuzz_capsules_pass") else {
        return;
    };
    // The run's CARGO_MANIFEST_DIR first: a binary built elsewhere runs from another checkout
    // (ci/h200-reach.sh).
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let dir = std::path::Path::new(&root).join("tests/capsules/cuda");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no capsules in {}", dir.display());
    let checker = Checker::isolated(&be);
    let mut failed = Vec::new();
    for p in &paths {
        let case = read_case(p).unwrap();
        let d = rerun(&checker, &case, 0).unwrap();
        if d.failed {
            failed.push(format!("{}:\n  {}", p.display(), d.lines.join("\n  ")));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn cuda_matches_reference() {
    let Some(be) = gpu("cuda_matches_reference") else {
        return;
    };
    let cpu = CpuBackend::default();
    let n: usize = std::env::var("SMALLSEQ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    let mut r = Rng::new(42);
    let mut worst = [0f64; 5];
    let mut fails = 0;
    for i in 0..n {
        let small = i % 2 == 0;
        let c = gen_case(&mut r, small);
        let path = if small {
            Path::SmallSeq
        } else {
            Path::Fallback
        };
        let prob = problem(&c);
        let (rf, rg) = smallseq_reference::forward_backward(&prob);
        let rg = rg.unwrap();
        // The device-faithful emulation's own errors: what a correct kernel with these
        // roundings gets, the yardstick of the bounds below.
        let (ef, eg) = smallseq_reference::emulate::forward_backward(&prob, c.cfg.dtype);
        let eg = eg.unwrap();
        let (fo, bo) = run_case(&be, &c, path);
        let bo = bo.unwrap();
        let vq = c.layout.q.valid_tokens();
        let vk = c.layout.kv.valid_tokens();
        let p = &c.cfg.params;
        let (h, hkv, dqk, dv) = (p.num_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_v);
        let tol: f64 = match c.cfg.dtype {
            Dtype::Bf16 => 2e-2,
            Dtype::F16 => 4e-3,
            Dtype::F32 => 1e-4,
        };
        let checks = [
            (
                "o",
                rel_err(fo.o.body(), rf.o.as_slice().unwrap(), |i| vq[i / (h * dv)]),
            ),
            (
                "lse",
                rel_err(fo.lse.body(), rf.lse.as_slice().unwrap(), |i| vq[i / h]),
            ),
            (
                "dq",
                rel_err(bo.dq.body(), rg.dq.as_slice().unwrap(), |i| {
                    vq[i / (h * dqk)]
                }),
            ),
            (
                "dk",
                rel_err(bo.dk.body(), rg.dk.as_slice().unwrap(), |i| {
                    vk[i / (hkv * dqk)]
                }),
            ),
            (
                "dv",
                rel_err(bo.dv.body(), rg.dv.as_slice().unwrap(), |i| {
                    vk[i / (hkv * dv)]
                }),
            ),
        ];
        let guards = [&fo.o, &fo.lse, &bo.dq, &bo.dk, &bo.dv]
            .iter()
            .all(|b| b.corrupted_guards().is_empty());
        let emu_norm = [
            rel_err(
                ef.o.as_slice().unwrap(),
                rf.o.as_slice().unwrap(),
                by_row(h * dv, &vq),
            )
            .0,
            0.0,
            rel_err(
                eg.dq.as_slice().unwrap(),
                rg.dq.as_slice().unwrap(),
                by_row(h * dqk, &vq),
            )
            .0,
            rel_err(
                eg.dk.as_slice().unwrap(),
                rg.dk.as_slice().unwrap(),
                by_row(hkv * dqk, &vk),
            )
            .0,
            rel_err(
                eg.dv.as_slice().unwrap(),
                rg.dv.as_slice().unwrap(),
                by_row(hkv * dv, &vk),
            )
            .0,
        ];
        for (j, (name, (e, fin))) in checks.iter().enumerate() {
            worst[j] = worst[j].max(*e);
            // Gradients whose dS cancels carry more than the forward's norm error: four times
            // the emulation's own, never less than the forward's bound (bf16: 2 %, where 8 %
            // was once allowed).
            let t = if j >= 2 {
                tol.max(4.0 * emu_norm[j])
            } else {
                tol
            };
            if *e > t || !fin || !guards {
                fails += 1;
                eprintln!(
                    "case {i} {path:?} {} h{h}/{hkv} d{dqk}/{dv} {} w{:?} b{}: {name} rel {e:.3e} finite {fin} guards {guards}",
                    c.cfg.dtype, p.mask, p.window, c.layout.slots()
                );
            }
        }
        // Small-seq: the CPU model of the same kernel should agree closely.
        if small && i % 6 == 0 {
            let (cf, cb) = run_case(&cpu, &c, path);
            let cb = cb.unwrap();
            let d = |a: &DevBuf, b: &DevBuf| {
                a.body()
                    .iter()
                    .zip(b.body())
                    .filter(|(x, y)| !(x.is_nan() && y.is_nan()))
                    .map(|(x, y)| ((x - y).abs() / (1.0 + y.abs())) as f64)
                    .fold(0f64, f64::max)
            };
            let diffs = [
                d(&fo.o, &cf.o),
                d(&fo.lse, &cf.lse),
                d(&bo.dq, &cb.dq),
                d(&bo.dk, &cb.dk),
                d(&bo.dv, &cb.dv),
            ];
            // Both kernels perform the emulation's roundings, in different orders: each is
            // within the emulation's own largest error of the reference, so they differ by at
            // most twice that, plus two ulps for an order-flipped rounding (lse: f32).
            let ed = |e: &[f32], r: &[f64]| {
                e.iter()
                    .zip(r)
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .map(|(&x, &y)| (f64::from(x) - y).abs() / (1.0 + y.abs()))
                    .fold(0f64, f64::max)
            };
            let u = c.cfg.dtype.unit_roundoff();
            let bounds = [
                2.0 * ed(ef.o.as_slice().unwrap(), rf.o.as_slice().unwrap()) + 4.0 * u,
                2.0 * ed(ef.lse.as_slice().unwrap(), rf.lse.as_slice().unwrap())
                    + 4.0 * Dtype::F32.unit_roundoff(),
                2.0 * ed(eg.dq.as_slice().unwrap(), rg.dq.as_slice().unwrap()) + 4.0 * u,
                2.0 * ed(eg.dk.as_slice().unwrap(), rg.dk.as_slice().unwrap()) + 4.0 * u,
                2.0 * ed(eg.dv.as_slice().unwrap(), rg.dv.as_slice().unwrap()) + 4.0 * u,
            ];
            for (j, name) in ["o", "lse", "dq", "dk", "dv"].iter().enumerate() {
                if diffs[j] > bounds[j] {
                    fails += 1;
                    eprintln!(
                        "case {i} cuda-vs-cpu small-seq {name}: max rel diff {:.3e} > {:.3e}",
                        diffs[j], bounds[j]
                    );
                }
            }
        }
    }
    eprintln!("worst rel err o/lse/dq/dk/dv: {worst:?} over {n} cases, {fails} failures");
    assert_eq!(fails, 0);
}

#[test]
fn determinism_and_large_slot_count() {
    let Some(be) = gpu("determinism_and_large_slot_count") else {
        return;
    };
    // 70,000 slots of 1 token: past the 65,535 grid-dimension limit.
    let mut r = Rng::new(3);
    let mut c = gen_case(&mut r, true);
    let b = 70_000;
    c.layout = Layout::packed(&vec![(1, 2); b]);
    let p = &c.cfg.params;
    let (h, d) = (p.num_heads, p.head_dim_qk);
    let rnd = |r: &mut Rng, t: usize| {
        Array3::from_shape_fn((t, h, d), |_| {
            c.cfg.dtype.round((r.next_u64() >> 40) as f32 / 1.6e7 - 0.5)
        })
    };
    c.q = rnd(&mut r, b);
    c.k = rnd(&mut r, 2 * b);
    c.v = rnd(&mut r, 2 * b);
    c.d_o = rnd(&mut r, b);
    let (f1, b1) = run_case(&be, &c, Path::SmallSeq);
    let (f2, b2) = run_case(&be, &c, Path::SmallSeq);
    let bits = |x: &DevBuf| x.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&f1.o), bits(&f2.o));
    assert_eq!(
        bits(&b1.as_ref().unwrap().dk),
        bits(&b2.as_ref().unwrap().dk)
    );
    assert!(
        f1.o.body().iter().all(|x| x.is_finite()),
        "every row written"
    );
    assert!(
        b1.unwrap().dv.body().iter().all(|x| x.is_finite()),
        "every key row written"
    );
}

#[test]
fn bench_when_asked() {
    if std::env::var("SMALLSEQ_BENCH").is_err() {
        return;
    }
    let out = std::env::var("SMALLSEQ_BENCH_OUT").ok().map(Into::into);
    let args = bench::BenchArgs {
        backend: "cuda".into(),
        iters: 20,
        warmup: 3,
        filter: std::env::var("SMALLSEQ_BENCH_FILTER").ok(),
        rotate_mb: 256,
        fallback: true,
        forward_only: false,
        out,
    };
    bench::run(&args).unwrap();
}

/// The campaign's own dropout and bias cases (every p it draws, post-scale tensors of every
/// broadcast shape and ALiBi) pass every property on the device, as on the CPU
/// (tests/bias_cases.rs): forward and backward against the reference, dBias included.
#[test]
fn campaign_dropout_and_bias_cases_pass_every_property() {
    use smallseq::config::Bias;
    use smallseq::dispatch::Profile;
    use smallseq::harness::campaign::case_seed;
    use smallseq::harness::gen::{build, draw_geometry_for};
    use smallseq::harness::props::Outcome;
    let Some(be) = gpu("campaign_dropout_and_bias_cases_pass_every_property") else {
        return;
    };
    let seed = 35;
    eprintln!("campaign seed {seed}");
    // Per class: p = 0.1, 0.5, 0.9, 1.0, a post-scale tensor, ALiBi.
    let mut want = [6usize; 6];
    let checker = Checker::isolated(&be);
    let mut failed = Vec::new();
    for i in 0..200_000u64 {
        if want.iter().all(|&n| n == 0) {
            break;
        }
        let cs = case_seed(seed, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
        let p = g.config.params.dropout.p;
        let class = match (&g.config.bias, p) {
            (Bias::PostScale(_), _) => 4,
            (Bias::Alibi, _) => 5,
            (_, p) if p > 0.0 => [0.1, 0.5, 0.9, 1.0]
                .iter()
                .position(|&x| x == p)
                .unwrap_or(0),
            _ => continue,
        };
        if want[class] == 0 {
            continue;
        }
        want[class] -= 1;
        let case = build(&g, cs ^ 0xda7a).unwrap();
        let run = checker.check(&case, i).unwrap();
        for (prop, o) in &run.outcomes {
            if let Outcome::Fail(f) = o {
                failed.push(format!("case {i} (seed {cs}): {prop}: {f:?}"));
            }
        }
    }
    assert_eq!(
        want, [0; 6],
        "the campaign drew too few cases of some class"
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// `n` values of `dtype` drawn uniform in [-2, 2).
fn uniform(r: &mut Rng, dtype: Dtype, shape: (usize, usize, usize)) -> Array3<f32> {
    Array3::from_shape_simple_fn(shape, || {
        dtype.round((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
    })
}

/// Dropout's keep mask on the device is the reference's, element for element: with Q = 0 every
/// visible key has the same P, and a one-hot V (key c of a slot: dimension c) puts element
/// (r, c) of the mask in o[r, h, c], 0 exactly where it drops.
#[test]
fn dropout_keep_mask_is_the_references() {
    let Some(be) = gpu("dropout_keep_mask_is_the_references") else {
        return;
    };
    let lens = [(1, 1), (5, 40), (33, 7), (17, 64), (2, 33)];
    let layout = Layout::packed(&lens);
    let (heads, kv_heads, d) = (4, 2, 64);
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    for dtype in [Dtype::Bf16, Dtype::F32] {
        for (j, p) in [0.1, 0.5, 0.9, 1.0].into_iter().enumerate() {
            let mut cfg = AttnConfig::new(dtype, heads, d, Mask::NoMask);
            cfg.params.num_kv_heads = kv_heads;
            cfg.params.dropout = smallseq_reference::Dropout {
                p,
                seed: 0x5eed_0000_0000_0001 + j as u64,
                offset: (1 << 33) + 7 * j as u64,
            };
            let mut v = Array3::zeros((tk, kv_heads, d));
            for slot in 0..layout.slots() {
                for c in 0..layout.kv.len(slot) {
                    let t = layout.kv.offset(slot) + c;
                    for hk in 0..kv_heads {
                        v[(t, hk, c)] = 1.0;
                    }
                }
            }
            let mut r = Rng::new(0x6ee9 + j as u64);
            let c = Case {
                k: uniform(&mut r, dtype, (tk, kv_heads, d)),
                d_o: uniform(&mut r, dtype, (tq, heads, d)),
                q: Array3::zeros((tq, heads, d)),
                v,
                cfg,
                layout: layout.clone(),
            };
            let (fo, _) = run_case(&be, &c, Path::Fallback);
            let drop = &c.cfg.params.dropout;
            let (mut kept, mut wrong) = (0usize, Vec::new());
            for slot in 0..layout.slots() {
                let (lq, lk) = (layout.q.len(slot), layout.kv.len(slot));
                for row in 0..lq {
                    let t = layout.q.offset(slot) + row;
                    for h in 0..heads {
                        for col in 0..lk {
                            let keep = drop.keep(slot, heads, h, row, col);
                            let o = fo.o.body()[(t * heads + h) * d + col];
                            kept += usize::from(keep);
                            if (o != 0.0) != keep || !o.is_finite() {
                                wrong.push((slot, h, row, col, o));
                            }
                        }
                    }
                }
            }
            assert!(
                wrong.is_empty(),
                "{dtype} p {p}: {} elements differ: {:?}",
                wrong.len(),
                &wrong[..wrong.len().min(8)]
            );
            assert_eq!(kept == 0, p == 1.0, "{dtype} p {p}: {kept} kept");
        }
    }
}

/// The bias variants of [`score_terms_match_the_reference_and_the_cpu`]: post-scale tensors of
/// each broadcast shape `[1|b, 1|H, Sq, Sk]` (larger than the slots need), with `-inf`
/// entries (one slot's first row hidden whole) and `+inf` where the causal mask hides the key;
/// ALiBi.
fn biases(r: &mut Rng, dtype: Dtype, layout: &Layout, heads: usize) -> Vec<AttnBias> {
    let (b, sq, sk) = (
        layout.slots(),
        layout.q.max_len() + 1,
        layout.kv.max_len() + 2,
    );
    let mut v: Vec<AttnBias> = [(1, 1), (b, 1), (1, heads), (b, heads)]
        .into_iter()
        .map(|(bb, hb)| {
            let mut t = Array4::from_shape_simple_fn((bb, hb, sq, sk), || {
                dtype.round((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 6.0 - 3.0)
            });
            for ((_, _, row, col), x) in t.indexed_iter_mut() {
                if col > row {
                    // Hidden by the top-left causal mask of the cases that carry it.
                    *x = if col % 3 == 0 { f32::INFINITY } else { *x };
                } else if (row * 7 + col) % 5 == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
            t.slice_mut(ndarray::s![.., .., 0, ..])
                .fill(f32::NEG_INFINITY);
            AttnBias::PostScale(Arc::new(t))
        })
        .collect();
    v.push(AttnBias::Alibi(Arc::new(
        (0..heads).map(|h| 0.5f32.powi(h as i32 + 1)).collect(),
    )));
    v
}

/// Dropout (p = 0.1, 0.5, 0.9, 1.0) and bias (every broadcast shape, ±inf entries, ALiBi),
/// alone and together, forward and backward with dBias: the device's outputs are as close to
/// the f64 reference as the CPU backend's (within the dtype's bound or twice the CPU's
/// error), finite where the reference is, guards intact, every dBias element written.
#[test]
fn score_terms_match_the_reference_and_the_cpu() {
    let Some(be) = gpu("score_terms_match_the_reference_and_the_cpu") else {
        return;
    };
    let cpu = CpuBackend::default();
    let seed = 0x35b1a5;
    eprintln!("seed {seed:#x}");
    let mut r = Rng::new(seed);
    let lens = [(3, 5), (17, 17), (1, 9), (40, 33), (6, 1)];
    let layout = Layout::packed(&lens);
    let (heads, kv_heads) = (4, 2);
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let mut fails = Vec::new();
    let mut cases = 0;
    for dtype in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
        let (d, dv) = if dtype == Dtype::F32 {
            (40, 24)
        } else {
            (64, 64)
        };
        let mut variants: Vec<(f64, AttnBias)> = [0.1, 0.5, 0.9, 1.0]
            .into_iter()
            .map(|p| (p, AttnBias::None))
            .collect();
        for b in biases(&mut r, dtype, &layout, heads) {
            variants.push((0.0, b.clone()));
            variants.push((0.5, b));
        }
        for (i, (p, bias)) in variants.into_iter().enumerate() {
            // The +inf entries sit above the diagonal: causal top-left for tensor biases.
            let mask = if matches!(bias, AttnBias::PostScale(_)) {
                Mask::Causal
            } else {
                [Mask::NoMask, Mask::CausalBottomRight][i % 2]
            };
            let mut cfg = AttnConfig::new(dtype, heads, d, mask);
            cfg.params.num_kv_heads = kv_heads;
            cfg.params.head_dim_v = dv;
            cfg.params.dropout = smallseq_reference::Dropout {
                p,
                seed: r.next_u64(),
                offset: r.next_u64() >> 20,
            };
            cfg.params.bias = bias;
            cfg.params
                .bias
                .check(&layout, heads, mask, Window::NONE)
                .unwrap();
            let c = Case {
                q: uniform(&mut r, dtype, (tq, heads, d)),
                k: uniform(&mut r, dtype, (tk, kv_heads, d)),
                v: uniform(&mut r, dtype, (tk, kv_heads, dv)),
                d_o: uniform(&mut r, dtype, (tq, heads, dv)),
                cfg,
                layout: layout.clone(),
            };
            let what = format!("{dtype} p {p} {} {}", c.cfg.params.bias.name(), mask);
            cases += 1;
            let (rf, rg) = smallseq_reference::forward_backward(&problem(&c));
            let rg = rg.unwrap();
            let (go, gb) = run_case(&be, &c, Path::Fallback);
            let (co, cb) = run_case(&cpu, &c, Path::Fallback);
            let (gb, cb) = (gb.unwrap(), cb.unwrap());
            let all = |_| true;
            let pairs: Vec<(&str, &DevBuf, &DevBuf, &[f64])> = vec![
                ("o", &go.o, &co.o, rf.o.as_slice().unwrap()),
                ("lse", &go.lse, &co.lse, rf.lse.as_slice().unwrap()),
                ("dq", &gb.dq, &cb.dq, rg.dq.as_slice().unwrap()),
                ("dk", &gb.dk, &cb.dk, rg.dk.as_slice().unwrap()),
                ("dv", &gb.dv, &cb.dv, rg.dv.as_slice().unwrap()),
            ];
            let mut pairs = pairs;
            let dbias_ref;
            if let (Some(g), Some(cc), Some(rd)) = (&gb.dbias, &cb.dbias, &rg.dbias) {
                dbias_ref = rd.iter().copied().collect::<Vec<f64>>();
                pairs.push(("dbias", g, cc, &dbias_ref));
            } else if c.cfg.params.bias.grad_shape().is_some() {
                fails.push(format!("{what}: no dbias"));
            }
            let tol: f64 = match dtype {
                Dtype::Bf16 => 2e-2,
                Dtype::F16 => 4e-3,
                Dtype::F32 => 1e-4,
            };
            for (name, g, cc, want) in pairs {
                let (eg, fin) = rel_err(g.body(), want, all);
                let (ec, _) = rel_err(cc.body(), want, all);
                let bound = tol.max(2.0 * ec);
                if eg > bound || !fin || !g.corrupted_guards().is_empty() {
                    fails.push(format!(
                        "{what}: {name} rel {eg:.3e} (cpu {ec:.3e}, bound {bound:.3e}) finite {fin}"
                    ));
                }
            }
        }
    }
    eprintln!("{cases} cases, {} failures", fails.len());
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

#[path = "support/campaign_json.rs"]
mod campaign_json;

/// A campaign in this process over lanes (`smallseq fuzz --backend cuda --in-process`: one
/// stream per job, cases checked concurrently) reports what one backend checking one case at
/// a time reports: the lanes share the device's context and its kernels, never a buffer.
#[test]
fn a_campaign_on_lanes_reports_what_one_stream_does() {
    let Some(one) = gpu("a_campaign_on_lanes_reports_what_one_stream_does") else {
        return;
    };
    let spec = smallseq::backend::Spec {
        name: "cuda",
        ..Default::default()
    };
    let lanes = smallseq::backend::open_lanes(&spec, 6).unwrap();
    let want = campaign_json::campaign_json(&one, 1, 150, false);
    assert!(want.contains(r#""cases":150"#), "{want}");
    assert_eq!(
        campaign_json::campaign_json(lanes.as_ref(), 6, 150, false),
        want
    );
}
