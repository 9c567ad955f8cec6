//! `smallseq fuzz`: the campaign.

use super::parse_duration;
use super::target::{self, TargetArgs};
use super::write_reports;
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use smallseq::design::Design;
use smallseq::dispatch::{apply_profile_defaults, EnvView, Profile};
use smallseq::harness::campaign::{Budget, Campaign, Progress, Report, Shard};
use smallseq::harness::props::Checker;
use smallseq::harness::report_io::{write_atomic, PartialReports};
use smallseq::harness::te625;
use smallseq::mutants::Mutant;
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
    /// Number of cases (overrides --time; at least 1).
    #[arg(long, value_parser = super::parse_cases)]
    pub cases: Option<u64>,
    /// Time budget, e.g. 60s, 10m.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub time: Duration,
    /// Output directory for report.json, junit.xml and capsules.
    #[arg(long, default_value = "smallseq-out")]
    pub out: PathBuf,
    /// Replace the report of a previous run in --out (without it, a --out that holds one is
    /// refused, so no run silently wipes another's capsules).
    #[arg(long)]
    pub force: bool,
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
    /// Plant these bugs (comma-separated names from `smallseq mutants`) in the cpu backend, or
    /// in the cuda kernels for the mutants they carry: a campaign that finds failures, to try
    /// the harness, its reports and its repro lines. Capsules record them; `repro` plants them
    /// again.
    #[arg(long, value_delimiter = ',')]
    pub plant: Vec<Mutant>,
    /// Fail (exit 1) on range limits too: failures that are wholly an output past the dtype's
    /// range that smallseq's emulation of a 16-bit design reproduces (listed apart by default).
    #[arg(long)]
    pub fail_on_range_limit: bool,
    /// Judge against this numeric design instead of the one the implementation declares
    /// (`caps.design`; undeclared: envelope): project (P and dS rounded to the input type, dP
    /// and D in f32, as smallseq's kernels) or envelope (any common design). docs/judgement.md
    /// ("Declared designs") says what each allows; capsules record it and `repro` judges with
    /// it.
    #[arg(long)]
    pub design: Option<Design>,
}

pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    })
}

pub fn run(args: &FuzzArgs, stop: Arc<AtomicBool>) -> Result<i32> {
    if args.jobs == Some(0) {
        tell!("smallseq: --jobs 0: at least one case must run at a time");
        return Ok(super::EXIT_USAGE);
    }
    if let Err(code) = super::refuse_previous("fuzz", &args.out, &[], args.force) {
        return Ok(code);
    }
    let (target, jobs) =
        match target::open_planted(&args.target, args.profile, args.jobs, &args.plant) {
            Ok(t) => t,
            Err(e) => {
                tell!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
    let runner = target.runner();
    if let target::Target::InProcess(be) = &target {
        be.stop_on_loss(stop.clone());
        if jobs > 1 && !be.concurrent_cases() {
            tell!(
                "smallseq: --jobs {jobs}: backend {} in this process checks one case at a time \
                 (add --isolate for one worker process per job)",
                be.name()
            );
            return Ok(super::EXIT_USAGE);
        }
    }
    if args.cases.is_none() && args.time.is_zero() {
        // As `--cases 0` is refused: a campaign that checks nothing must not read as passed
        // (a CI line whose templated budget came out as 0s would turn green).
        tell!("smallseq: --time 0s: the campaign would check no case (give a time above 0, or --cases N)");
        return Ok(super::EXIT_USAGE);
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
        .unwrap_or_else(|| "arch unknown".into());
    tell!(
        "smallseq fuzz: backend {} ({arch}), profile {}, seed {seed}, budget {budget}, {jobs} \
         job(s){}, out {}",
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
        tell!(
            "smallseq fuzz: {} worker(s) `{}` on device(s) {}; case timeout {}",
            placement.len(),
            runner.worker_command().unwrap_or_default().join(" "),
            placement.join(","),
            match (args.target.case_timeout, runner.caps().case_timeout_s) {
                (Some(t), _) => format!("{:.1} s", t.as_secs_f64()),
                (None, Some(floor)) =>
                    format!("{DEFAULT_TIMEOUT_RULE}, at least the {floor:.0} s the worker declares"),
                (None, None) => DEFAULT_TIMEOUT_RULE.into(),
            }
        );
        for line in runner.caps().not_covered() {
            tell!("smallseq fuzz: not covered: {line}");
        }
    }
    let mut env = EnvView::from_process();
    for var in apply_profile_defaults(args.profile, &mut env) {
        tell!(
            "smallseq fuzz: {} is unset; using {var} (set it to 0 to test TE with the path off; \
             capsules record it)",
            var.split('=').next().unwrap_or_default()
        );
    }
    if !args.plant.is_empty() {
        let names: Vec<&str> = args.plant.iter().map(|m| m.name()).collect();
        tell!("smallseq fuzz: planted bugs: {}", names.join(", "));
    }
    if let Err(code) = super::prepare_out("fuzz", &args.out, &[], args.force) {
        return Ok(code);
    }
    let mut checker = Checker::new(
        runner,
        RunOptions {
            profile: args.profile,
            env,
            ..RunOptions::default()
        },
    );
    checker.design = args.design;
    let design = checker.design();
    tell!(
        "smallseq fuzz: judged against design {design}: {}",
        design.summary()
    );
    let campaign = Campaign {
        checker,
        seed,
        budget,
        out: args.out.clone(),
        shrink_budget: args.shrink_time,
        stop_on_failure: false,
        jobs,
        shard,
    };
    let command = super::command_line();
    let mut partial = PartialReports::new(&args.out, &command);
    let mut show = progress_printer(budget);
    let mut warned = false;
    let mut report = campaign.run(&stop, &mut |p: Progress| {
        if let Err(e) = partial.offer(p.report) {
            if !std::mem::replace(&mut warned, true) {
                tell!("smallseq fuzz: partial report not written: {e}");
            }
        }
        show(p);
    })?;
    report.command = command;
    write_reports(&args.out, &report)?;
    summarize(&report, &args.out);
    if let target::Target::InProcess(be) = &target {
        if let Some(why) = be.lost() {
            tell!("smallseq fuzz: stopped after {} cases: {why}", report.cases);
        }
    }
    let te = campaign.checker.runner.name() == "te625-model" && !target.in_workers();
    if te && report.interrupted {
        tell!("smallseq fuzz: interrupted: TE #625 defect attribution skipped");
    } else if te {
        name_te625_defects(&report, &args.out, &campaign.checker.opts)?;
    }
    say!(
        "{}",
        verdict_line(&report, &args.out, args.fail_on_range_limit)
    );
    Ok(
        if report.failed() || (args.fail_on_range_limit && !report.range_limits.is_empty()) {
            1
        } else if report.interrupted {
            super::EXIT_INTERRUPTED
        } else {
            0
        },
    )
}

/// A progress bar on a terminal, a plain line every 10 s otherwise; failures always printed.
/// The bar counts cases against a case budget, or seconds against a time budget.
pub fn progress_printer(budget: Budget) -> impl FnMut(Progress) {
    let tty = std::io::stderr().is_terminal();
    let (len, template) = match budget {
        Budget::Cases(n) => (n, "{bar:40} {pos}/{len} cases {msg}"),
        Budget::Time(t) => (t.as_secs().max(1), "{bar:40} {pos}/{len} s {msg}"),
    };
    let bar = tty.then(|| {
        let b = ProgressBar::new(len);
        b.set_style(ProgressStyle::with_template(template).expect("static template"));
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
                None => tell!("{line}"),
            }
            seen_failures += 1;
        }
        let msg = format!("{} cases, {} failures", r.cases, r.failures.len());
        match &bar {
            Some(b) => {
                b.set_position(match budget {
                    Budget::Cases(_) => r.cases,
                    Budget::Time(_) => r.elapsed_s as u64,
                });
                b.set_message(msg);
            }
            None if last.elapsed() >= Duration::from_secs(10) => {
                tell!("progress: {msg}");
                last = Instant::now();
            }
            None => {}
        }
    }
}

/// Attributes the failures to the model's defects; prints the table, writes `te625.json` and
/// appends the table to `summary.md`.
fn name_te625_defects(report: &Report, out: &std::path::Path, opts: &RunOptions) -> Result<()> {
    tell!("smallseq fuzz: attributing failures to TE #625 defects (differential replay)");
    let findings = te625::attribute(report, out, opts, 60, &mut attribution_progress())?;
    say!("TE #625 defects:");
    for f in &findings {
        say!(
            "  {:<24} {:<4} {:>5}  {}",
            f.defect,
            if f.found() { "yes" } else { "no" },
            f.count,
            f.example.as_deref().unwrap_or("-")
        );
    }
    let json = serde_json::to_string_pretty(&findings)?;
    write_atomic(&out.join("te625.json"), json.as_bytes())?;
    let summary = out.join("summary.md");
    let mut md = std::fs::read_to_string(&summary).unwrap_or_default();
    md.push_str(&te625::markdown(&findings));
    write_atomic(&summary, md.as_bytes())?;
    Ok(())
}

/// Draws [`te625::Step`]s: a bar per phase on a terminal, else a line on stderr every 10 s
/// and at each phase's end (CI logs show it is moving, without a line per case).
fn attribution_progress() -> impl FnMut(te625::Step) {
    let tty = std::io::stderr().is_terminal();
    let mut bar: Option<(&'static str, ProgressBar)> = None;
    let mut last = Instant::now();
    move |s: te625::Step| {
        if tty {
            if bar.as_ref().is_none_or(|(phase, _)| *phase != s.phase) {
                if let Some((_, b)) = bar.take() {
                    b.finish();
                }
                let b = ProgressBar::new(s.total);
                b.set_style(
                    ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                        .expect("static template"),
                );
                b.set_message(s.phase);
                bar = Some((s.phase, b));
            }
            if let Some((_, b)) = &bar {
                b.set_position(s.done);
                if s.done == s.total {
                    b.finish();
                }
            }
        } else if s.done == s.total || last.elapsed() >= Duration::from_secs(10) {
            tell!(
                "smallseq fuzz: TE #625 attribution: {} {}/{}",
                s.phase,
                s.done,
                s.total
            );
            last = Instant::now();
        }
    }
}

/// The campaign's last line: its verdict and the page to open.
fn verdict_line(r: &Report, out: &std::path::Path, fail_on_range_limit: bool) -> String {
    let mut cases: Vec<u64> = r.failures.iter().map(|f| f.case).collect();
    cases.sort_unstable();
    cases.dedup();
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let limits = r.range_limits.len();
    let limits_text = match limits {
        0 => String::new(),
        n => format!(", {n} range limit{} listed apart", plural(n)),
    };
    let verdict = if !cases.is_empty() || (fail_on_range_limit && limits > 0) {
        format!(
            "FAILED ({} case{}{limits_text}{})",
            cases.len(),
            plural(cases.len()),
            if r.interrupted { ", interrupted" } else { "" }
        )
    } else if r.interrupted {
        format!("INTERRUPTED{limits_text}")
    } else {
        format!("PASSED{limits_text}")
    };
    format!("{verdict}: open {}", out.join("report.html").display())
}

fn summarize(r: &Report, out: &std::path::Path) {
    say!(
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
        say!(
            "  {name:<22} pass {:>6}  fail {:>4}  skip {:>6}",
            c.pass,
            c.fail,
            c.skip
        );
    }
    let missed = r.classes_missed();
    if !missed.is_empty() {
        say!("  classes not hit: {}", missed.join(", "));
    }
    for f in &r.range_limits {
        say!(
            "RANGE LIMIT case {} [{}]: {}\n  repro: {}",
            f.case,
            f.property,
            f.detail,
            f.repro
        );
    }
    for f in &r.failures {
        say!(
            "FAIL case {} [{}]: {}\n  repro: {}",
            f.case,
            f.property,
            f.detail,
            f.repro
        );
    }
    say!("report: {}", out.join("report.json").display());
}
