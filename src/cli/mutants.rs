//! `smallseq mutants`: the standard campaign against every planted bug.

use super::write_reports;
use super::{parse_duration, EXIT_INTERRUPTED};
use anyhow::Result;
use rayon::prelude::*;
use serde::Serialize;
use smallseq::backend::open_planted;
use smallseq::design::Design;
use smallseq::harness::campaign::{case_seed, Progress};
use smallseq::harness::campaign::{Budget, Campaign, Shard};
use smallseq::harness::capsule;
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::Checker;
use smallseq::harness::props::Prop;
use smallseq::harness::rng::Rng;
use smallseq::harness::shrink::shrink;
use smallseq::mutants::Mutant;
use std::collections::BTreeMap;
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
    /// Stop each mutant at the first case that kills it and shrink nothing: the quick check
    /// that every mutant is still killed (L0). The kill counts then cover only the cases run,
    /// so each property's own power shows only without it.
    #[arg(long)]
    pub until_killed: bool,
    /// Output directory (mutants.json; per mutant its report files and capsules).
    #[arg(long, default_value = "smallseq-out/mutants")]
    pub out: PathBuf,
    /// Replace the report of a previous run in --out (without it, a --out that holds one is
    /// refused, so no run silently wipes another's capsules).
    #[arg(long)]
    pub force: bool,
    /// Judge every mutant against this numeric design instead of the backend's own (project):
    /// `--design envelope` measures what the wider judge of an undeclared worker still kills.
    #[arg(long)]
    pub design: Option<Design>,
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
    /// Every property that failed a case of this mutant, with the number of cases it failed
    /// (all of the budget's cases run, so each property's own power shows).
    kills: BTreeMap<String, u64>,
    /// Per killing property, the cases run when it first failed one.
    cases_to_kill_by: BTreeMap<String, u64>,
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
    tell!(
        "smallseq mutants: {} mutants, seed {}, budget {budget} each",
        list.len(),
        args.seed
    );
    let per_mutant: Vec<PathBuf> = Mutant::ALL
        .iter()
        .map(|m| args.out.join(m.name()))
        .collect();
    if let Err(code) = super::prepare_out("mutants", &args.out, &per_mutant, args.force) {
        return Ok(code);
    }
    let one = |&m: &Mutant| -> Result<Row> {
        let be = open_planted(&args.backend, &[m])?;
        let mut checker = Checker::isolated(be.as_ref());
        checker.design = args.design;
        let mut campaign_checker = Checker::isolated(be.as_ref());
        campaign_checker.design = args.design;
        let campaign = Campaign {
            checker: campaign_checker,
            seed: args.seed,
            budget,
            out: args.out.join(m.name()),
            // Every case runs (unless --until-killed), so that every property's kills are
            // counted; only the first failure is shrunk, below.
            shrink_budget: Duration::ZERO,
            stop_on_failure: args.until_killed,
            // The mutants themselves run in parallel.
            jobs: 1,
            shard: Shard::default(),
        };
        let mut first: BTreeMap<String, u64> = BTreeMap::new();
        let rep = campaign.run(stop, &mut |p: Progress| {
            for (name, c) in &p.report.properties {
                if c.fail > 0 {
                    first.entry(name.clone()).or_insert(p.report.cases);
                }
            }
        })?;
        // Each mutant's own report and page, so a kill can be looked at like any failure.
        write_reports(&campaign.out, &rep)?;
        let f = rep.failures.first();
        let mut shrunk = None;
        if let Some(f) = f.filter(|_| !args.until_killed) {
            let cs = case_seed(args.seed, f.case);
            let profile = checker.opts.profile;
            let case = build(&draw_geometry_for(&mut Rng::new(cs), profile), cs ^ 0xda7a)?;
            let prop = Prop::ALL
                .into_iter()
                .find(|p| p.name() == f.property)
                .unwrap_or(Prop::NumericAgreement);
            let (small, steps) = shrink(&checker, &case, prop, Duration::from_secs(20), stop);
            if steps > 0 {
                let run = checker.check(&small, 0)?;
                let path = std::path::Path::new(&f.capsule).with_extension("shrunk.safetensors");
                capsule::write(&path, &small, &run, &checker, 0, None)?;
                let l = &small.layout;
                let max_tok = (0..l.slots())
                    .map(|s| l.q.len(s).max(l.kv.len(s)))
                    .max()
                    .unwrap_or(0);
                shrunk = Some((l.slots(), max_tok, path.display().to_string()));
            }
        }
        let kills: BTreeMap<String, u64> = rep
            .properties
            .iter()
            .filter(|(_, c)| c.fail > 0)
            .map(|(k, c)| (k.clone(), c.fail))
            .collect();
        let row = Row {
            mutant: m.name().into(),
            killed: f.is_some(),
            interrupted: f.is_none() && rep.interrupted,
            cases_run: rep.cases,
            cases_to_kill: f.map(|f| f.case + 1),
            property: f.map(|f| f.property.clone()),
            shrunk_slots: shrunk.as_ref().map(|s| s.0),
            shrunk_tokens: shrunk.as_ref().map(|s| s.1),
            capsule: f.map(|f| shrunk.as_ref().map_or(f.capsule.clone(), |s| s.2.clone())),
            kills,
            cases_to_kill_by: first,
        };
        tell!("  {:<28} {}", m.name(), row.result());
        Ok(row)
    };
    // The CPU mutants run in parallel; a GPU runs one campaign at a time.
    let rows: Vec<Row> = if on_gpu {
        list.iter().map(one).collect::<Result<_>>()?
    } else {
        list.par_iter().map(one).collect::<Result<_>>()?
    };
    say!(
        "| mutant | result | cases to kill | property | killed by (cases failed, first) | shrunk slots | shrunk max tokens |"
    );
    say!("|---|---|---|---|---|---|---|");
    let opt = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    for r in &rows {
        let by: Vec<String> = r
            .kills
            .iter()
            .map(|(p, n)| {
                let first = r.cases_to_kill_by.get(p).copied().unwrap_or(0);
                format!("{p} {n} ({first})")
            })
            .collect();
        say!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.mutant,
            r.result(),
            opt(r.cases_to_kill.map(|x| x.to_string())),
            opt(r.property.clone()),
            opt((!by.is_empty()).then(|| by.join(", "))),
            opt(r.shrunk_slots.map(|x| x.to_string())),
            opt(r.shrunk_tokens.map(|x| x.to_string())),
        );
    }
    // Each property's own power: the mutants it kills, whether or not it failed first.
    say!("\n| property | mutants killed |\n|---|---:|");
    let mut power: BTreeMap<&str, usize> = Prop::ALL.iter().map(|p| (p.name(), 0)).collect();
    for r in &rows {
        for p in r.kills.keys() {
            *power.entry(p.as_str()).or_default() += 1;
        }
    }
    for (p, n) in &power {
        say!("| {p} | {n} |");
    }
    let killed = rows.iter().filter(|r| r.killed).count();
    let interrupted = rows.iter().filter(|r| r.interrupted).count();
    let mut ctk: Vec<u64> = rows.iter().filter_map(|r| r.cases_to_kill).collect();
    ctk.sort_unstable();
    let median = ctk.get(ctk.len() / 2).copied().unwrap_or(0);
    say!(
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
