//! `smallseq calibrate`: how often a backend's small-seq outputs land more than one ulp from the
//! device-faithful emulation, per dtype, head dim and tensor. `emulation_conformance` fails a
//! case whose rate exceeds `Backend::rounding_budget`; this measures the rates a correct
//! backend shows, so the budget is set from figures and not guessed.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use smallseq::backend;
use smallseq::dispatch::{Path, Profile};
use smallseq::harness::bias::{self, Signs};
use smallseq::harness::campaign::case_seed;
use smallseq::harness::conformance::{self, CONFORMANCE_TENSORS};
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::{oracle, run_pair};
use smallseq::harness::rng::Rng;
use smallseq::harness::text::{decimal, signed};
use smallseq::wrapper::RunOptions;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Measure a backend's small-seq conformance rates against the emulation.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Backend to measure: cpu, cuda, hip.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Cases drawn (the fuzz campaign's generator; only small-seq cases are measured).
    #[arg(long, default_value_t = 400)]
    pub cases: u64,
    /// Seed of the cases (printed).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the rates as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Rounding bias per dtype, head dim and tensor (`rounding_bias`): how far the rows' votes
/// lean from a half, and the largest margin under the backend's current bias budget.
#[derive(Default, Serialize)]
struct Lean {
    /// Tensors with enough rows for the sign test.
    tensors: usize,
    /// Rows voting (net deviation from the emulation not zero), over all those tensors.
    voting_rows: usize,
    /// Of those, rows whose net deviation is away from zero.
    away_rows: usize,
    /// Largest `|k/n − 1/2|` of one tensor, either statistic, over votes of at least 45 rows
    /// (what a budget must cover).
    max_excess: f64,
    /// Sum of the signed deviations of differing elements, in ulps, and their count.
    signed_ulps: f64,
    differing: usize,
    /// Largest margin under the current budget (above 1 fails the property).
    max_margin: Option<f64>,
}

impl Lean {
    fn add(&mut self, s: &Signs, budget: Option<f64>) {
        // Every tensor some budget could judge is measured (a unanimous vote fails from
        // `min_rows(0)` rows on), not only those the current budget judges: a budget calibrated
        // below the provisional one judges smaller tensors, whose lean must be in the figures.
        if s.margin(0.0).is_none() {
            return;
        }
        self.tensors += 1;
        self.voting_rows += s.away.n;
        self.away_rows += s.away.k;
        // A lean of a handful of rows is chance; only votes a unanimous one could fail count.
        let enough = bias::min_rows(0.0).unwrap_or(usize::MAX);
        for v in [s.up, s.away].iter().filter(|v| v.n >= enough) {
            self.max_excess = self.max_excess.max(v.excess().abs());
        }
        self.signed_ulps += s.signed_ulps;
        self.differing += s.differing;
        if let Some(m) = budget.and_then(|b| s.margin(b)) {
            self.max_margin = Some(self.max_margin.map_or(m, |x| x.max(m)));
        }
    }
}

#[derive(Default, Serialize)]
struct Rates {
    /// Tensors judged (enough elements and rows, `Count::judged`).
    tensors: usize,
    elements: usize,
    off: usize,
    /// dq/dk elements left out of the count: their conditioning allowance dominates.
    excluded: usize,
    max_rate: f64,
    /// Largest `off / allowance` under the backend's current budget (above 1 fails the
    /// property); None where the tensor is not judged.
    max_margin: Option<f64>,
    bias: Lean,
}

pub fn run(args: &CalibrateArgs) -> Result<i32> {
    let be = match backend::open(&args.backend) {
        Ok(b) => b,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    tell!(
        "smallseq calibrate: backend {} ({}), {} cases, seed {}",
        be.name(),
        be.arch(),
        args.cases,
        args.seed
    );
    let opts = RunOptions::default();
    let bar = ProgressBar::new(args.cases);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} cases {eta}",
    )?);
    let mut rates: BTreeMap<String, Rates> = BTreeMap::new();
    let mut small = 0usize;
    for i in 0..args.cases {
        bar.inc(1);
        let cs = case_seed(args.seed, i);
        let case = build(
            &draw_geometry_for(&mut Rng::new(cs), Profile::Native),
            cs ^ 0xda7a,
        )?;
        let Ok(pair) = run_pair(be.as_ref(), &case, &opts) else {
            continue; // a failing run is the fuzz campaign's business, not a rate
        };
        if pair.fwd.path != Some(Path::SmallSeq) {
            continue;
        }
        small += 1;
        let y = oracle(&case).with_context(|| format!("case {i} (seed {cs})"))?;
        for c in conformance::counts(
            &case,
            pair.small_seq(),
            &pair.outputs(),
            &y.emulated,
            y.undecided(),
        ) {
            if !c.judged() {
                continue;
            }
            let key = format!(
                "{} d{} {}",
                case.config.dtype.name(),
                case.config.params.head_dim_qk,
                c.tensor
            );
            let r = rates.entry(key).or_default();
            r.tensors += 1;
            r.elements += c.elements;
            r.off += c.off;
            r.excluded += c.excluded;
            r.max_rate = r.max_rate.max(c.rate());
            if let Some(m) = be.rounding_budget(c.tensor).and_then(|b| c.margin(b)) {
                r.max_margin = Some(r.max_margin.map_or(m, |x| x.max(m)));
            }
        }
        for s in bias::signs(
            &case,
            pair.small_seq(),
            &pair.outputs(),
            &y.emulated,
            y.undecided(),
        ) {
            let key = format!(
                "{} d{} {}",
                case.config.dtype.name(),
                case.config.params.head_dim_qk,
                s.tensor
            );
            let budget = bias::bias_budget_of(be.name(), s.tensor);
            rates.entry(key).or_default().bias.add(&s, budget);
        }
    }
    bar.finish_and_clear();
    say!(
        "{:22} {:>8} {:>10} {:>9} {:>9} {:>9} {:>10}",
        "dtype d tensor",
        "tensors",
        "elements",
        "excluded",
        "mean %",
        "max %",
        "max margin"
    );
    let mut max = 0.0f64;
    let mut max_margin = None::<f64>;
    for (k, r) in &rates {
        max = max.max(r.max_rate);
        if let Some(m) = r.max_margin {
            max_margin = Some(max_margin.map_or(m, |x| x.max(m)));
        }
        say!(
            "{k:22} {:>8} {:>10} {:>9} {:>9.3} {:>9.3} {:>10}",
            r.tensors,
            r.elements,
            r.excluded,
            100.0 * r.off as f64 / r.elements.max(1) as f64,
            100.0 * r.max_rate,
            r.max_margin.map_or("-".into(), |m| decimal(m, 3))
        );
    }
    let budgets: Vec<String> = CONFORMANCE_TENSORS
        .iter()
        .map(|t| {
            be.rounding_budget(t)
                .map_or(format!("{t} not judged"), |b| {
                    format!("{t} {:.2} %", 100.0 * b)
                })
        })
        .collect();
    say!(
        "{small} small-seq cases of {}; largest rate {:.3} % (current budgets: {}, at least one \
         row); largest margin {}",
        args.cases,
        100.0 * max,
        budgets.join(", "),
        max_margin.map_or("- (nothing judged)".into(), |m| format!(
            "{}{}",
            decimal(m, 3),
            if m > 1.0 { ": over budget" } else { "" }
        ))
    );
    // What `rounding_budget_of` needs per tensor: its largest rate over every dtype and head
    // dim (o and dv's budgets sit 4-6x above theirs).
    let per_tensor: Vec<String> = CONFORMANCE_TENSORS
        .iter()
        .map(|t| {
            let worst = rates
                .iter()
                .filter(|(k, _)| k.ends_with(&format!(" {t}")))
                .fold(0.0f64, |m, (_, r)| m.max(r.max_rate));
            format!("{t} {:.3} %", 100.0 * worst)
        })
        .collect();
    say!("largest rate per tensor: {}", per_tensor.join(", "));
    say!(
        "\nrounding bias (sign test at false-alarm rate {:e} per tensor; budget = excess over a half):",
        bias::FALSE_ALARM
    );
    say!(
        "{:22} {:>8} {:>11} {:>7} {:>11} {:>10} {:>10}",
        "dtype d tensor",
        "tensors",
        "voting rows",
        "away %",
        "max excess",
        "mean ulp",
        "max margin"
    );
    for (k, r) in rates.iter().filter(|(_, r)| r.bias.tensors > 0) {
        let b = &r.bias;
        say!(
            "{k:22} {:>8} {:>11} {:>7.1} {:>11} {:>10} {:>10}",
            b.tensors,
            b.voting_rows,
            100.0 * b.away_rows as f64 / b.voting_rows.max(1) as f64,
            decimal(b.max_excess, 3),
            signed(b.signed_ulps / b.differing.max(1) as f64, 3),
            b.max_margin.map_or("-".into(), |m| decimal(m, 3))
        );
    }
    // What `bias::bias_budget_of` needs per tensor: its largest excess over every dtype and
    // head dim, beside the current budget.
    let per_tensor: Vec<String> = CONFORMANCE_TENSORS
        .iter()
        .map(|t| {
            let worst = rates
                .iter()
                .filter(|(k, r)| k.ends_with(&format!(" {t}")) && r.bias.tensors > 0)
                .fold(None::<f64>, |m, (_, r)| {
                    Some(m.map_or(r.bias.max_excess, |x| x.max(r.bias.max_excess)))
                });
            let now = bias::bias_budget_of(be.name(), t)
                .map_or("not judged".into(), |b| format!("budget {b:.2}"));
            worst.map_or(format!("{t} - ({now})"), |w| {
                format!("{t} {} ({now})", decimal(w, 3))
            })
        })
        .collect();
    say!("largest excess per tensor: {}", per_tensor.join(", "));
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&rates)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(0)
}
