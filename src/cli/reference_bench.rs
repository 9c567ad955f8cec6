//! `smallseq bench-reference`: forward+backward reference cases per second on the standard
//! case (16 slots, lengths uniform in 1..=17, H = 16, D = 128, bf16 inputs).

use anyhow::Result;
use rayon::prelude::*;
use smallseq::harness::rng::{Draw, Rng};
use smallseq::reference::{forward_backward, Dtype, Layout, Mask};
use smallseq::{AttnConfig, Case};
use std::time::Instant;

/// Benchmark the f64 reference.
#[derive(clap::Args, Debug)]
pub struct BenchReferenceArgs {
    /// Cases per measurement.
    #[arg(long, default_value_t = 200)]
    pub cases: usize,
    /// Seed of the standard cases.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// The standard case for seed `s`.
pub fn standard_case(s: u64) -> Result<Case> {
    let mut rng = Rng::new(s);
    let lens: Vec<(usize, usize)> = (0..16)
        .map(|_| (rng.range(1, 17), rng.range(1, 17)))
        .collect();
    let layout = Layout::packed(&lens);
    let cfg = AttnConfig::new(Dtype::Bf16, 16, 128, Mask::Padding);
    let mut fill = |t: usize| {
        ndarray::Array3::from_shape_simple_fn((t, 16, 128), || {
            Dtype::Bf16.round(rng.normal() as f32)
        })
    };
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    let (q, k, v, d_o) = (fill(tq), fill(tk), fill(tk), fill(tq));
    Ok(Case::new(cfg, layout, q, k, v, Some(d_o))?)
}

pub fn run(args: &BenchReferenceArgs) -> Result<i32> {
    let cases: Vec<Case> = (0..args.cases as u64)
        .map(|i| standard_case(args.seed + i))
        .collect::<Result<_>>()?;
    let one = |c: &Case| -> Result<()> {
        let (f, g) = forward_backward(&c.problem()?);
        std::hint::black_box((f, g));
        Ok(())
    };
    let t = Instant::now();
    for c in &cases {
        one(c)?;
    }
    let single = cases.len() as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    cases.par_iter().try_for_each(one)?;
    let all = cases.len() as f64 / t.elapsed().as_secs_f64();
    let threads = rayon::current_num_threads();
    say!("standard case (16 slots, L in 1..=17, H=16, D=128, bf16), forward+backward:");
    say!("  1 thread:   {single:.1} cases/s");
    say!(
        "  {threads} threads: {all:.1} cases/s ({:.1} per thread)",
        all / threads as f64
    );
    Ok(0)
}
