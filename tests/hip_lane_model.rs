//! The gfx942 code path of the kernels, checked on the host (there is no AMD GPU here).
//!
//! `tests/hip_model/model.cpp` includes `kernels/small_seq.cu` and `kernels/fallback.cu`
//! unchanged, with the HIP branch of `portable.h` selected as for gfx942, and runs them on 64
//! fibers in lockstep per wavefront, with models of `ds_bpermute` and of
//! `v_mfma_f32_16x16x16{bf16_1k,f16}` (the ISA's operand layout). It checks the matrix-core
//! fragment moves element by element, that every cross-lane operation is reached by all 64
//! lanes (the matrix cores need uniform control flow), and the small-seq and fallback kernels
//! end to end against a double-precision reference, including empty slots, masks, a grid tail
//! and don't-care tokens left unwritten.
//!
//! Needs a clang (for `ext_vector_type`): `SMALLSEQ_HIP_CLANG`, else `clang++-19`, `clang++-20`,
//! `clang++-18`, `clang++`. Without one it prints SKIP, unless `SMALLSEQ_REQUIRE_HIP_MODEL=1`
//! (`ci/hip-compile-check.sh` sets it after installing clang-19).
use std::path::Path;
use std::process::Command;

fn clang() -> Option<String> {
    let works = |c: &str| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Ok(c) = std::env::var("SMALLSEQ_HIP_CLANG") {
        if c != "none" && works(&c) {
            return Some(c);
        }
    }
    ["clang++-19", "clang++-20", "clang++-18", "clang++"]
        .into_iter()
        .find(|c| works(c))
        .map(String::from)
}

/// Builds the model with `defines` into the test's scratch directory as `name`.
fn build_model(cc: &str, name: &str, defines: &[&str]) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    // -O0: the model's run time is its thread exchanges; optimising the kernels' host copy
    // only costs compile time (a minute at -O1, seconds at -O0).
    let build = Command::new(cc)
        .args(["--driver-mode=g++", "-std=c++20", "-O0"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(&exe)
        .arg(root.join("tests/hip_model/model.cpp"))
        .output()
        .expect("running the compiler");
    assert!(
        build.status.success(),
        "{cc} failed on tests/hip_model/model.cpp {defines:?}:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    exe
}

/// Builds the model with `defines` and runs it: (exit success, stdout).
fn build_and_run(cc: &str, name: &str, defines: &[&str]) -> (bool, String) {
    let exe = build_model(cc, name, defines);
    let run = Command::new(&exe).output().expect("running the model");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    (run.status.success(), out)
}

fn clang_or_skip(test: &str) -> Option<String> {
    let cc = clang();
    if cc.is_none() {
        assert_ne!(
            std::env::var("SMALLSEQ_REQUIRE_HIP_MODEL").as_deref(),
            Ok("1"),
            "SMALLSEQ_REQUIRE_HIP_MODEL=1 but no clang found"
        );
        smallseq::print_skip(format_args!(
            "{test}: no clang (ci/hip-compile-check.sh installs one)"
        ));
    }
    cc
}

#[test]
fn gfx942_wavefront_model() {
    let Some(cc) = clang_or_skip("gfx942_wavefront_model") else {
        return;
    };
    let (ok, stdout) = build_and_run(&cc, "hip_wavefront_model", &[]);
    eprintln!("{stdout}");
    assert!(ok, "model failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

/// Kernel mutants the model cannot see, with why: its data never overflows f16/bf16. The
/// device campaign sees it (`smallseq mutants --backend cuda`).
const MODEL_BLIND_MUTANTS: &[(&str, &str)] = &[(
    "nan-on-overflow",
    "the model's data never overflows the output type",
)];

/// The kernels' planted bugs (`SMALLSEQ_MUTANT_*`, the catalogue's GPU side) are live: the
/// model's end-to-end check against its double reference fails with each one it can see.
#[test]
fn kernel_mutants_fail_the_model() {
    let Some(cc) = clang_or_skip("kernel_mutants_fail_the_model") else {
        return;
    };
    for m in smallseq::mutants::Mutant::ALL {
        let Some(define) = m.kernel_define() else {
            continue;
        };
        if let Some((_, why)) = MODEL_BLIND_MUTANTS.iter().find(|(n, _)| *n == m.name()) {
            eprintln!("{}: not judged by the model ({why})", m.name());
            continue;
        }
        // The kernel mutants are planted in the small-seq kernels: the tiled fallback's block
        // jobs (most of the model's run time) are left out of these runs.
        let (ok, stdout) = build_and_run(
            &cc,
            &format!("hip_model_{}", m.name()),
            &[define, "HIP_MODEL_SMALL_SEQ_ONLY"],
        );
        let fails = stdout.lines().filter(|l| l.starts_with("FAIL")).count();
        eprintln!("{}: {fails} failing checks", m.name());
        assert!(
            !ok && fails > 0,
            "mutant {} survived the model:\n{stdout}",
            m.name()
        );
    }
}

/// Kernel variants other than the default that are timed on the H200 (bench/NOTES.md v6, v7,
/// v13-v16), each with whether the model's tiled fallback runs (most of its run time; the other
/// variants change the small-seq or scalar kernels only): the small-seq kernels without the
/// dead-tile skips, with one of them, the forward with both (v7's default), the backward
/// without the dead rows 8-15 (the default until v16), the tiled items for one query and the
/// 64-bit item decoding (both the default until v16), the one-query items without the keys-as-rows
/// scores (bit 2, the default since v25), with those scores and the tiled products, the tiled
/// backward's column tiles in padded rather than swizzled rows, the scalar backward's GQA sums
/// per head, D from the stored O (`FTB_D_FROM_O=1`, the D kernel run before each backward)
/// and from it corrected in one pass (`FTB_D_FROM_O=2`), the tiled kernels' tile copies with
/// hoisted strides (`FT_COPY_HOIST=1`).
/// Variants that change different code share one build (a fault of either still fails it;
/// each build is about 20 s of the CI's two cores): the forward's and the backward's dead-tile
/// skips; the small-seq item decoding and the scalar fallback's GQA sums; the tiled
/// fallback's column-tile layout and where its D comes from.
const KERNEL_VARIANTS: &[(&str, bool)] = &[
    ("SS_SKIP_DEAD_TILES=0", false),
    ("SS_SKIP_DEAD_TILES=1", false),
    ("SS_SKIP_DEAD_TILES=2", false),
    ("SS_SKIP_DEAD_FWD=3 SS_SKIP_DEAD_BWD=3", false),
    ("SS_ONE_QUERY=0", false),
    ("SS_ONE_QUERY=3", false),
    ("SS_ONE_QUERY=4", false),
    ("SS_ITEM32=0 FB_GROUP_PARTIALS=0", false),
    ("FTB_SWIZZLE=0 FTB_D_FROM_O=1", true),
    ("FTB_D_FROM_O=2", true),
    ("FT_COPY_HOIST=1", true),
];

/// The kernel variants compute the same outputs: the model's end-to-end checks pass with each
/// one.
#[test]
fn kernel_variants_pass_the_model() {
    let Some(cc) = clang_or_skip("kernel_variants_pass_the_model") else {
        return;
    };
    for &(define, tiled) in KERNEL_VARIANTS {
        let mut defines: Vec<&str> = define.split(' ').collect();
        if !tiled {
            defines.push("HIP_MODEL_SMALL_SEQ_ONLY");
        }
        let (ok, stdout) = build_and_run(
            &cc,
            &format!("hip_model_{}", define.replace(['=', ' '], "_")),
            &defines,
        );
        assert!(
            ok && stdout.contains(" passed, 0 failed"),
            "{define}:\n{stdout}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Rates of the gfx942 path against the emulation, from the model (no AMD GPU here).
//
// The campaign's own generator draws the cases (`smallseq calibrate`'s draws: the native
// profile, production shapes and data classes included); every one the small-seq kernels take
// runs through the model (`--replay`), and its outputs are counted against the device-faithful
// emulation exactly as `emulation_conformance` and `rounding_bias` count a HIP device's. The
// budgets HIP judges with (`rounding_budget_of("hip", _)`, `bias_budget_of("hip", _)`) must
// cover the model's largest rate and lean with headroom, and a kernel whose rounding is
// biased must not fit them. See docs/judgement.md §3.

use smallseq::backend::launch::{dims_of, mask_code};
use smallseq::backend::rounding_budget_of;
use smallseq::dispatch::Profile;
use smallseq::harness::bias::{self, bias_budget_of};
use smallseq::harness::campaign::case_seed;
use smallseq::harness::conformance::{self, CONFORMANCE_TENSORS};
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::oracle;
use smallseq::harness::rng::Rng;
use smallseq::reference::Dtype;
use smallseq::{Case, Outputs};
use std::collections::BTreeMap;

/// Draws of the generator (seed 1, as `smallseq calibrate`); about one in five is a 16-bit
/// case the small-seq kernels take. `SMALLSEQ_HIP_MODEL_DRAWS` sets another count (the
/// figures in docs/judgement.md §3 are of 600).
fn rate_draws() -> u64 {
    std::env::var("SMALLSEQ_HIP_MODEL_DRAWS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300)
}
/// How far under a budget the model's largest rate, or lean, must sit: the model's `exp` is
/// the host's and its matrix core rounds the exact sum once, so a device may differ from the
/// emulation more often than the model does (CUDA's H200 figures sit 4-6x under its budgets).
const HEADROOM: f64 = 4.0;
/// Largest case the model replays, in wavefronts (slots × heads).
const MAX_WAVES: i32 = 512;

fn small_seq_cases(draws: u64) -> Vec<Case> {
    (0..draws)
        .filter_map(|i| {
            let cs = case_seed(1, i);
            let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
            let case = build(&g, cs ^ 0xda7a).ok()?;
            let d = dims_of(&case.config, &case.layout, true);
            // The model runs a wavefront in about a millisecond: the largest production
            // batches (hundreds of slots of 32 heads) would cost it minutes.
            let takes = d.small_seq_unsupported().is_none()
                && d.dtype_suffix(false).is_ok()
                && d.b > 0
                && d.b * d.heads <= MAX_WAVES
                && case.d_o.is_some()
                // The small-seq path refuses dropout (the gate sends it to the fallback); the
                // model runs the small-seq kernel itself, so it takes none.
                && case.config.params.dropout.p == 0.0
                // Nor a bias (docs/semantics.md §1.9), for the same reason.
                && case.config.params.bias.is_none();
            takes.then_some(case)
        })
        .collect()
}

fn bits(dt: Dtype, x: f32) -> u16 {
    match dt {
        Dtype::Bf16 => half::bf16::from_f32(x).to_bits(),
        _ => half::f16::from_f32(x).to_bits(),
    }
}

/// One record of the model's `--replay` input (format in tests/hip_model/model.cpp).
fn record(c: &Case, out: &mut Vec<u8>) {
    let p = &c.config.params;
    let kind = i32::from(c.config.dtype != Dtype::Bf16);
    let l = &c.layout;
    let ints = [
        kind,
        p.head_dim_qk as i32,
        l.slots() as i32,
        p.num_heads as i32,
        mask_code(&c.config),
    ];
    ints.iter().for_each(|x| out.extend(x.to_le_bytes()));
    out.extend((p.scale as f32).to_le_bytes());
    out.extend((l.q.tokens as i64).to_le_bytes());
    out.extend((l.kv.tokens as i64).to_le_bytes());
    for a in [&l.q.cu[..], &l.kv.cu[..], l.q.offsets(), l.kv.offsets()] {
        a.iter().for_each(|x| out.extend(x.to_le_bytes()));
    }
    let d_o = c.d_o.as_ref().expect("drawn with d_o");
    for t in [&c.q, &c.k, &c.v, d_o] {
        t.iter()
            .for_each(|&x| out.extend(bits(c.config.dtype, x).to_le_bytes()));
    }
}

/// The model's outputs of case `c`, read from `f32s` at `*at`.
fn outputs(c: &Case, f32s: &[f32], at: &mut usize) -> Outputs {
    let p = &c.config.params;
    let (tq, tk, h, d) = (
        c.layout.q.tokens,
        c.layout.kv.tokens,
        p.num_heads,
        p.head_dim_qk,
    );
    let mut take = |n: usize| {
        let s: Vec<f64> = f32s[*at..*at + n].iter().map(|&x| f64::from(x)).collect();
        *at += n;
        s
    };
    let a3 = |v: Vec<f64>, t: usize| ndarray::Array3::from_shape_vec((t, h, d), v).unwrap();
    let o = a3(take(tq * h * d), tq);
    let lse = ndarray::Array2::from_shape_vec((tq, h), take(tq * h)).unwrap();
    let dq = a3(take(tq * h * d), tq);
    let dk = a3(take(tk * h * d), tk);
    let dv = a3(take(tk * h * d), tk);
    Outputs {
        o: Some(o),
        lse: Some(lse),
        dq: Some(dq),
        dk: Some(dk),
        dv: Some(dv),
        dbias: None,
    }
}

/// Per tensor over the cases: (largest conformance rate of a judged tensor, elements counted,
/// largest lean |k/n − 1/2| of a vote a unanimous one could fail, largest bias margin under
/// HIP's budget).
#[derive(Default, Debug)]
struct ModelRates {
    max_rate: f64,
    elements: usize,
    off: usize,
    judged: usize,
    max_lean: f64,
    votes: usize,
    max_bias_margin: f64,
}

/// Runs `cases` through the model built with `defines` and counts them per tensor.
fn model_rates(
    cc: &str,
    name: &str,
    defines: &[&str],
    cases: &[Case],
) -> BTreeMap<&'static str, ModelRates> {
    let mut with_small_only = vec!["HIP_MODEL_SMALL_SEQ_ONLY"];
    with_small_only.extend_from_slice(defines);
    let exe = build_model(cc, name, &with_small_only);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut input = Vec::new();
    cases.iter().for_each(|c| record(c, &mut input));
    let (inp, outp) = (
        dir.join(format!("{name}.in")),
        dir.join(format!("{name}.out")),
    );
    std::fs::write(&inp, &input).unwrap();
    let run = Command::new(&exe)
        .arg("--replay")
        .arg(&inp)
        .arg(&outp)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
    let raw = std::fs::read(&outp).unwrap();
    let f32s: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut at = 0;
    let mut rates: BTreeMap<&'static str, ModelRates> = BTreeMap::new();
    let enough = bias::min_rows(0.0).unwrap();
    for c in cases {
        let got = outputs(c, &f32s, &mut at);
        let y = oracle(c).expect("the reference of a drawn case");
        for n in conformance::counts(c, (true, true), &got, &y.emulated, y.undecided()) {
            let r = rates.entry(n.tensor).or_default();
            if n.judged() {
                r.judged += 1;
                r.elements += n.elements;
                r.off += n.off;
                r.max_rate = r.max_rate.max(n.rate());
            }
        }
        for s in bias::signs(c, (true, true), &got, &y.emulated, y.undecided()) {
            let r = rates.entry(s.tensor).or_default();
            for v in [s.up, s.away].iter().filter(|v| v.n >= enough) {
                r.votes += 1;
                r.max_lean = r.max_lean.max(v.excess().abs());
            }
            if let Some(m) = bias_budget_of("hip", s.tensor).and_then(|b| s.margin(b)) {
                r.max_bias_margin = r.max_bias_margin.max(m);
            }
        }
    }
    assert_eq!(
        at,
        f32s.len(),
        "the model wrote more outputs than the cases have"
    );
    rates
}

#[test]
fn gfx942_model_rates_fit_the_hip_budgets() {
    let Some(cc) = clang_or_skip("gfx942_model_rates_fit_the_hip_budgets") else {
        return;
    };
    let draws = rate_draws();
    let cases = small_seq_cases(draws);
    assert!(
        cases.len() >= 30,
        "only {} small-seq cases drawn",
        cases.len()
    );
    let rates = model_rates(&cc, "hip_model_rates", &[], &cases);
    eprintln!(
        "gfx942 host model, {} small-seq cases of {draws} draws (seed 1):",
        cases.len()
    );
    eprintln!(
        "{:6} {:>7} {:>10} {:>8} {:>8} {:>7} {:>9} {:>7} {:>10}",
        "tensor",
        "judged",
        "elements",
        "mean %",
        "max %",
        "budget",
        "max lean",
        "votes",
        "bias budget"
    );
    let mut bad = Vec::new();
    for t in CONFORMANCE_TENSORS {
        let r = &rates[t];
        let budget = rounding_budget_of("hip", t).expect("every tensor has a HIP budget");
        let bias_budget = bias_budget_of("hip", t).expect("every tensor has a HIP bias budget");
        eprintln!(
            "{t:6} {:>7} {:>10} {:>8.3} {:>8.3} {:>6.1}% {:>9.3} {:>7} {:>10.2}",
            r.judged,
            r.elements,
            100.0 * r.off as f64 / r.elements.max(1) as f64,
            100.0 * r.max_rate,
            100.0 * budget,
            r.max_lean,
            r.votes,
            bias_budget
        );
        if r.judged < 20 {
            bad.push(format!("{t}: only {} judged tensors", r.judged));
        }
        if HEADROOM * r.max_rate > budget {
            bad.push(format!(
                "{t}: the model's largest rate {:.3} % is within {HEADROOM}x of HIP's budget \
                 {:.1} %",
                100.0 * r.max_rate,
                100.0 * budget
            ));
        }
        // Rows vote only where they deviate from the emulation; where none does, nothing leans.
        if HEADROOM * r.max_lean > bias_budget {
            bad.push(format!(
                "{t}: the model's largest lean {:.3} is within {HEADROOM}x of HIP's bias \
                 budget {bias_budget}",
                r.max_lean
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The HIP budgets have power: kernels that round toward zero, or bias dQ by 1.5 ulps, do not
/// fit them on the same cases.
#[test]
fn biased_kernels_do_not_fit_the_hip_budgets() {
    let Some(cc) = clang_or_skip("biased_kernels_do_not_fit_the_hip_budgets") else {
        return;
    };
    let cases = small_seq_cases(100);
    for (define, tensor) in [
        ("SMALLSEQ_MUTANT_ROUND_TOWARD_ZERO", "o"),
        ("SMALLSEQ_MUTANT_DQ_ULP_BIAS", "dq"),
    ] {
        let rates = model_rates(&cc, &format!("hip_model_rates_{tensor}"), &[define], &cases);
        let r = &rates[tensor];
        let over_rate = r.max_rate > rounding_budget_of("hip", tensor).unwrap();
        let over_bias = r.max_bias_margin > 1.0;
        eprintln!(
            "{define}: {tensor} max rate {:.3} %, bias margin {:.2}",
            100.0 * r.max_rate,
            r.max_bias_margin
        );
        assert!(
            over_rate || over_bias,
            "{define} fits the HIP budgets of {tensor}: {r:?}"
        );
    }
}
