//! `smallseq fuzz`: the campaign.

use super::parse_duration;
use super::target::{self, TargetArgs};
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::campaign::{write_reports, Budget, Campaign, Progress, Report, Shard};
use smallseq::harness::props::Checker;
use smallseq::harness::te625;
use smallseq::worker::pool::DEFAULT_TIMEOUT_RULE;
use smallseq::wrapper::RunOptions;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Fuzz a backend against the reference and every property.
#[derive(clap::Args, Debug)]
pub struct FuzzArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Dispatch profile: native or te625.
    #[arg(long, default_value = "native")]
    pub profile: Profile,
    /// Campaign seed (printed; default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Number of cases (overrides --time).
    #[arg(long)]
    pub cases: Option<u64>,
    /// Time budget, e.g. 60s, 10m.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub time: Duration,
    /// Output directory for report.json, junit.xml and capsules.
    #[arg(long, default_value = "smallseq-out")]
    pub out: PathBuf,
    /// Seconds spent shrinking each failure (0 disables shrinking).
    #[arg(long, value_parser = parse_duration, default_value = "20s")]
    pub shrink_time: Duration,
    /// Cases checked at once, each on its own thread (and, in workers, its own worker
    /// process; default: one per core). The report is the same for any value.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Run only the cases whose index is I mod N of the seeded sequence (one machine of N);
    /// `smallseq merge` joins the shards' directories into the report of the whole campaign.
    #[arg(long)]
    pub shard: Option<Shard>,
}

/// The variable that switches TE's small-seq path on.
const TE_SWITCH: &str = "NVTE_FUSED_ATTN_CK_SMALLSEQ";

pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    })
}

pub fn run(args: &FuzzArgs, stop: Arc<AtomicBool>) -> Result<i32> {
    if args.jobs == Some(0) {
        eprintln!("smallseq: --jobs 0: at least one case must run at a time");
        return Ok(super::EXIT_USAGE);
    }
    let (target, jobs) = match target::open(&args.target, args.profile, args.jobs) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let runner = target.runner();
    if let target::Target::InProcess(be) = &target {
        if jobs > 1 && !be.concurrent_cases() {
            eprintln!(
                "smallseq: --jobs {jobs}: backend {} in this process checks one case at a time \
                 (add --isolate for one worker process per job)",
                be.name()
            );
            return Ok(super::EXIT_USAGE);
        }
    }
    let seed = seed_or_clock(args.seed);
    let budget = match args.cases {
        Some(n) => Budget::Cases(n),
        None => Budget::Time(args.time),
    };
    let shard = args.shard.unwrap_or_default();
    let arch = runner
        .caps()
        .arch
        .clone()
        .unwrap_or_else(|| "unknown arch".into());
    eprintln!(
        "smallseq fuzz: backend {} ({arch}), profile {}, seed {seed}, {jobs} job(s){}, out {}",
        runner.name(),
        args.profile,
        if shard.is_split() {
            format!(", shard {shard}")
        } else {
            String::new()
        },
        args.out.display()
    );
    if let target::Target::Workers(pool) = &target {
        let placement: Vec<String> = pool.placement().iter().map(|d| d.to_string()).collect();
        eprintln!(
            "smallseq fuzz: {} worker(s) `{}` on device(s) {}; case timeout {}",
            placement.len(),
            runner.worker_command().unwrap_or_default().join(" "),
            placement.join(","),
            match args.target.case_timeout {
                Some(t) => format!("{:.1} s", t.as_secs_f64()),
                None => DEFAULT_TIMEOUT_RULE.into(),
            }
        );
        for line in runner.caps().not_covered() {
            eprintln!("smallseq fuzz: not covered: {line}");
        }
    }
    let mut env = EnvView::from_process();
    if args.profile == Profile::Te625 && env.get(TE_SWITCH).is_none() {
        // TE's small-seq path is off unless the variable is "1"; a campaign against it
        // without the variable would only ever test the fallback.
        eprintln!("smallseq fuzz: {TE_SWITCH} is unset; using {TE_SWITCH}=1 (set it to 0 to test TE with the path off)");
        env.set(TE_SWITCH, Some("1"));
    }
    let campaign = Campaign {
        checker: Checker::new(
            runner,
            RunOptions {
                profile: args.profile,
                env,
                ..RunOptions::default()
            },
        ),
        seed,
        budget,
        out: args.out.clone(),
        shrink_budget: args.shrink_time,
        stop_on_failure: false,
        jobs,
        shard,
    };
    let report = campaign.run(&stop, &mut progress_printer())?;
    write_reports(&args.out, &report)?;
    summarize(&report, &args.out);
    if campaign.checker.runner.name() == "te625-model" && !target.in_workers() {
        name_te625_defects(&report, &args.out, &campaign.checker.opts)?;
    }
    Ok(if report.failed() { 1 } else { 0 })
}

/// A progress bar on a terminal, a plain line every 10 s otherwise; failures always printed.
pub fn progress_printer() -> impl FnMut(Progress) {
    let tty = std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let b = ProgressBar::new(1000);
        b.set_style(
            ProgressStyle::with_template("{bar:40} {pos:>4}/1000 {msg}").expect("static template"),
        );
        b
    });
    let mut last = Instant::now();
    let mut seen_failures = 0;
    move |p: Progress| {
        let r = p.report;
        while seen_failures < r.failures.len() {
            let f = &r.failures[seen_failures];
            let line = format!(
                "FAIL case {} [{}] {}\n  capsule: {}\n  repro:   {}",
                f.case, f.property, f.detail, f.capsule, f.repro
            );
            match &bar {
                Some(b) => b.println(line),
                None => eprintln!("{line}"),
            }
            seen_failures += 1;
        }
        let msg = format!("{} cases, {} failures", r.cases, r.failures.len());
        match &bar {
            Some(b) => {
                b.set_position((p.fraction.unwrap_or(0.0) * 1000.0) as u64);
                b.set_message(msg);
            }
            None if last.elapsed() >= Duration::from_secs(10) => {
                eprintln!("progress: {msg}");
                last = Instant::now();
            }
            None => {}
        }
    }
}

/// Attributes the failures to the model's defects; prints the table, writes `te625.json` and
/// appends the table to `summary.md`.
fn name_te625_defects(report: &Report, out: &std::path::Path, opts: &RunOptions) -> Result<()> {
    eprintln!("smallseq fuzz: attributing failures to TE #625 defects (differential replay)");
    let findings = te625::attribute(report, out, opts, 60)?;
    println!("TE #625 defects:");
    for f in &findings {
        println!(
            "  {:<24} {:<4} {:>5}  {}",
            f.defect,
            if f.found() { "yes" } else { "no" },
            f.count,
            f.example.as_deref().unwrap_or("-")
        );
    }
    let json = serde_json::to_string_pretty(&findings)?;
    std::fs::write(out.join("te625.json"), json)?;
    let summary = out.join("summary.md");
    let mut md = std::fs::read_to_string(&summary).unwrap_or_default();
    md.push_str(&te625::markdown(&findings));
    std::fs::write(summary, md)?;
    Ok(())
}

fn summarize(r: &Report, out: &std::path::Path) {
    println!(
        "{} cases in {:.1}s ({:.1} cases/s), seed {}, backend {}, profile {}{}",
        r.cases,
        r.elapsed_s,
        r.cases_per_s,
        r.seed,
        r.backend,
        r.profile,
        if r.interrupted { " (interrupted)" } else { "" }
    );
    for (name, c) in &r.properties {
        println!(
            "  {name:<22} pass {:>6}  fail {:>4}  skip {:>6}",
            c.pass, c.fail, c.skip
        );
    }
    let missed = r.classes_missed();
    if !missed.is_empty() {
        println!("  classes not hit: {}", missed.join(", "));
    }
    for f in &r.failures {
        println!(
            "FAIL case {} [{}]: {}\n  repro: {}",
            f.case, f.property, f.detail, f.repro
        );
    }
    println!("report: {}", out.join("report.json").display());
}
