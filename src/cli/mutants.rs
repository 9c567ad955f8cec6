//! `smallseq mutants`: the standard campaign against every planted bug.

use super::parse_duration;
use anyhow::Result;
use rayon::prelude::*;
use serde::Serialize;
use smallseq::backend::cpu::CpuBackend;
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::campaign::{Budget, Campaign};
use smallseq::harness::props::Checker;
use smallseq::mutants::{Defects, Mutant};
use smallseq::wrapper::RunOptions;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Run the campaign against each planted bug; exit 1 if any survives.
#[derive(clap::Args, Debug)]
pub struct MutantsArgs {
    /// Cases per mutant (overrides --time).
    #[arg(long)]
    pub cases: Option<u64>,
    /// Time budget per mutant.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub time: Duration,
    /// Campaign seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Only these mutants (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<Mutant>,
    /// Output directory (mutants.json and per-mutant capsules).
    #[arg(long, default_value = "smallseq-out/mutants")]
    pub out: PathBuf,
}

#[derive(Serialize)]
struct Row {
    mutant: String,
    killed: bool,
    cases_to_kill: Option<u64>,
    property: Option<String>,
    shrunk_slots: Option<usize>,
    shrunk_tokens: Option<usize>,
    capsule: Option<String>,
}

pub fn run(args: &MutantsArgs) -> Result<i32> {
    let list: Vec<Mutant> = if args.only.is_empty() {
        Mutant::ALL.to_vec()
    } else {
        args.only.clone()
    };
    let budget = match args.cases {
        Some(n) => Budget::Cases(n),
        None => Budget::Time(args.time),
    };
    eprintln!(
        "smallseq mutants: {} mutants, seed {}, budget {budget:?} each",
        list.len(),
        args.seed
    );
    let stop = AtomicBool::new(false);
    let rows: Vec<Row> = list
        .par_iter()
        .map(|&m| -> Result<Row> {
            let be = CpuBackend::mutant(Defects::of(&[m]));
            let campaign = Campaign {
                checker: Checker {
                    backend: &be,
                    opts: RunOptions {
                        profile: Profile::Native,
                        env: EnvView::default(),
                        ..RunOptions::default()
                    },
                },
                seed: args.seed,
                budget,
                out: args.out.join(m.name()),
                shrink_budget: Duration::from_secs(20),
                stop_on_failure: true,
            };
            let rep = campaign.run(&stop, &mut |_| {})?;
            let f = rep.failures.first();
            let row = Row {
                mutant: m.name().into(),
                killed: f.is_some(),
                cases_to_kill: f.map(|f| f.case + 1),
                property: f.map(|f| f.property.clone()),
                shrunk_slots: f.and_then(|f| f.shrunk_size.map(|s| s.0)),
                shrunk_tokens: f.and_then(|f| f.shrunk_size.map(|s| s.1)),
                capsule: f.map(|f| f.shrunk_capsule.clone().unwrap_or(f.capsule.clone())),
            };
            eprintln!(
                "  {:<28} {}",
                m.name(),
                if row.killed { "killed" } else { "SURVIVED" }
            );
            Ok(row)
        })
        .collect::<Result<_>>()?;
    println!("| mutant | result | cases to kill | property | shrunk slots | shrunk max tokens |");
    println!("|---|---|---|---|---|---|");
    let opt = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.mutant,
            if r.killed { "killed" } else { "SURVIVED" },
            opt(r.cases_to_kill.map(|x| x.to_string())),
            opt(r.property.clone()),
            opt(r.shrunk_slots.map(|x| x.to_string())),
            opt(r.shrunk_tokens.map(|x| x.to_string())),
        );
    }
    let killed = rows.iter().filter(|r| r.killed).count();
    let mut ctk: Vec<u64> = rows.iter().filter_map(|r| r.cases_to_kill).collect();
    ctk.sort_unstable();
    let median = ctk.get(ctk.len() / 2).copied().unwrap_or(0);
    println!(
        "killed {killed}/{} ; median cases to kill {median}",
        rows.len()
    );
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(
        args.out.join("mutants.json"),
        serde_json::to_string_pretty(&rows)?,
    )?;
    Ok(if killed == rows.len() { 0 } else { 1 })
}
