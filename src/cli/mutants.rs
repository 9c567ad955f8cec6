//! `smallseq mutants`: the standard campaign against every planted bug.

use super::{parse_duration, EXIT_INTERRUPTED};
use anyhow::Result;
use rayon::prelude::*;
use serde::Serialize;
use smallseq::backend::open_planted;
use smallseq::harness::campaign::{Budget, Campaign};
use smallseq::harness::props::Checker;
use smallseq::harness::report_io::clean_previous;
use smallseq::mutants::Mutant;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Run the campaign against each planted bug; exit 1 if any survives.
#[derive(clap::Args, Debug)]
pub struct MutantsArgs {
    /// Where the bugs are planted: cpu (the whole catalogue) or cuda (the mutants the kernels
    /// carry as `SMALLSEQ_MUTANT_*` defines).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Cases per mutant (overrides --time; at least 1).
    #[arg(long, value_parser = super::parse_cases)]
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
    /// Leave these mutants out (comma-separated names), e.g. known survivors in CI.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<Mutant>,
    /// Output directory (mutants.json and per-mutant capsules).
    #[arg(long, default_value = "smallseq-out/mutants")]
    pub out: PathBuf,
}

#[derive(Serialize)]
struct Row {
    mutant: String,
    killed: bool,
    /// Stopped by Ctrl-C or SIGTERM before a kill or the end of its budget: not a survivor.
    interrupted: bool,
    cases_run: u64,
    cases_to_kill: Option<u64>,
    property: Option<String>,
    shrunk_slots: Option<usize>,
    shrunk_tokens: Option<usize>,
    capsule: Option<String>,
}

pub fn run(args: &MutantsArgs, stop: &AtomicBool) -> Result<i32> {
    let list: Vec<Mutant> = if args.only.is_empty() {
        Mutant::ALL.to_vec()
    } else {
        args.only.clone()
    };
    let on_gpu = args.backend != "cpu";
    let list: Vec<Mutant> = list
        .into_iter()
        .filter(|m| !args.skip.contains(m))
        .filter(|m| !on_gpu || m.kernel_define().is_some())
        .collect();
    let budget = match args.cases {
        Some(n) => Budget::Cases(n),
        None => Budget::Time(args.time),
    };
    eprintln!(
        "smallseq mutants: {} mutants, seed {}, budget {budget} each",
        list.len(),
        args.seed
    );
    let mut removed = clean_previous(&args.out)?.len();
    for m in Mutant::ALL {
        removed += clean_previous(&args.out.join(m.name()))?.len();
    }
    super::say_cleaned("mutants", &args.out, removed);
    let one = |&m: &Mutant| -> Result<Row> {
        let be = open_planted(&args.backend, &[m])?;
        let campaign = Campaign {
            checker: Checker::isolated(be.as_ref()),
            seed: args.seed,
            budget,
            out: args.out.join(m.name()),
            shrink_budget: Duration::from_secs(20),
            stop_on_failure: true,
            // The mutants themselves run in parallel.
            jobs: 1,
        };
        let rep = campaign.run(stop, &mut |_| {})?;
        let f = rep.failures.first();
        let row = Row {
            mutant: m.name().into(),
            killed: f.is_some(),
            interrupted: f.is_none() && rep.interrupted,
            cases_run: rep.cases,
            cases_to_kill: f.map(|f| f.case + 1),
            property: f.map(|f| f.property.clone()),
            shrunk_slots: f.and_then(|f| f.shrunk_size.map(|s| s.slots)),
            shrunk_tokens: f.and_then(|f| f.shrunk_size.map(|s| s.max_tokens)),
            capsule: f.map(|f| f.shrunk_capsule.clone().unwrap_or(f.capsule.clone())),
        };
        eprintln!("  {:<28} {}", m.name(), row.result());
        Ok(row)
    };
    // The CPU mutants run in parallel; a GPU runs one campaign at a time.
    let rows: Vec<Row> = if on_gpu {
        list.iter().map(one).collect::<Result<_>>()?
    } else {
        list.par_iter().map(one).collect::<Result<_>>()?
    };
    println!("| mutant | result | cases to kill | property | shrunk slots | shrunk max tokens |");
    println!("|---|---|---|---|---|---|");
    let opt = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.mutant,
            r.result(),
            opt(r.cases_to_kill.map(|x| x.to_string())),
            opt(r.property.clone()),
            opt(r.shrunk_slots.map(|x| x.to_string())),
            opt(r.shrunk_tokens.map(|x| x.to_string())),
        );
    }
    let killed = rows.iter().filter(|r| r.killed).count();
    let interrupted = rows.iter().filter(|r| r.interrupted).count();
    let mut ctk: Vec<u64> = rows.iter().filter_map(|r| r.cases_to_kill).collect();
    ctk.sort_unstable();
    let median = ctk.get(ctk.len() / 2).copied().unwrap_or(0);
    println!(
        "killed {killed}/{} ; median cases to kill {median}{}",
        rows.len(),
        if interrupted > 0 {
            format!(" ; interrupted: {interrupted} not run to their budget")
        } else {
            String::new()
        }
    );
    smallseq::harness::report_io::write_atomic(
        &args.out.join("mutants.json"),
        serde_json::to_string_pretty(&rows)?.as_bytes(),
    )?;
    // A survivor that ran its whole budget is a finding even when others were interrupted.
    Ok(if killed + interrupted < rows.len() {
        1
    } else if interrupted > 0 {
        EXIT_INTERRUPTED
    } else {
        0
    })
}

impl Row {
    fn result(&self) -> &'static str {
        match (self.killed, self.interrupted) {
            (true, _) => "killed",
            (false, true) => "INTERRUPTED",
            (false, false) => "SURVIVED",
        }
    }
}
