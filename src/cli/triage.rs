//! `smallseq triage DIR…`: each campaign's failures grouped by signature, one representative
//! per group shrunk where the campaign left it unshrunk, its standalone script, and a verdict
//! with its evidence (`harness::triage*`). Opening the recorded backend or worker to replay
//! and shrink is done here, as `repro` does it.

use super::target::{self, Target, TargetArgs};
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use smallseq::backend;
use smallseq::case_file::read_case;
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::campaign::repro_cmd;
use smallseq::harness::capsule::{self, KERNEL_DEFINES_ENV, WORKER};
use smallseq::harness::props::{Checker, Prop};
use smallseq::harness::repro::Recorded;
use smallseq::harness::shrink::shrink;
use smallseq::harness::triage::{self, Group};
use smallseq::harness::triage_report::{Triage, Triaged};
use smallseq::harness::triage_script;
use smallseq::harness::triage_verdict::{judge, Finding, Replay, Verdict};
use smallseq::wrapper::RunOptions;
use smallseq::Case;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Group a campaign's failures, shrink and script a representative of each, and give each
/// group a verdict: defect, design or range limit, or harness error.
#[derive(clap::Args, Debug)]
pub struct TriageArgs {
    /// Campaign output directories (each with report.json and capsules/).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where triage.md, triage.json and triage/ (scripts, shrunk capsules) go (default: the
    /// first DIR).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Time spent shrinking a representative the campaign left unshrunk (0s: none).
    #[arg(long, default_value = "20s", value_parser = super::parse_duration)]
    pub shrink_time: Duration,
    /// Judge from the capsules alone: do not rerun representatives on their backend or worker.
    #[arg(long)]
    pub no_replay: bool,
    /// The adapters folder, which holds standalone.py (default: SMALLSEQ_ADAPTERS, else the
    /// source tree's adapters/ this binary was built from, else ./adapters). It runs under
    /// SMALLSEQ_PYTHON when set, else python3, which needs numpy and safetensors.
    #[arg(long)]
    pub adapters: Option<PathBuf>,
}

pub fn run(args: &TriageArgs, stop: Arc<AtomicBool>) -> Result<i32> {
    let out = args.out.clone().unwrap_or_else(|| args.dirs[0].clone());
    let items = match triage::load(&args.dirs) {
        Ok(i) => i,
        Err(e) => {
            tell!("smallseq triage: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let groups = triage::group(items);
    let work = out.join("triage");
    if let Err(e) = std::fs::create_dir_all(&work) {
        tell!("smallseq triage: cannot create {}: {e}", work.display());
        return Ok(super::EXIT_USAGE);
    }
    let bar = ProgressBar::new(groups.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("triage [{bar:30}] {pos}/{len} groups: {msg}")
            .expect("a fixed template"),
    );
    let mut triaged = Vec::new();
    let mut backends = Backends::default();
    for (i, g) in groups.iter().enumerate() {
        bar.set_message(format!("{} {}", g.signature.property, g.signature.tensor));
        if !bar.is_hidden() {
            bar.tick();
        } else {
            tell!(
                "triage: group {}/{}: {} {} ({} case(s))",
                i + 1,
                groups.len(),
                g.signature.property,
                g.signature.tensor,
                g.items.len()
            );
        }
        triaged.push(one_group(args, &mut backends, (&work, i + 1), g, &stop));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let t = Triage {
        dirs: args.dirs.iter().map(|d| d.display().to_string()).collect(),
        groups: triaged,
    };
    let (json, md) = match t.write(&out) {
        Ok(p) => p,
        Err(e) => {
            tell!("smallseq triage: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    for (i, g) in t.groups.iter().enumerate() {
        say!(
            "{}. {} x {} {} [{}] on {}: {}",
            i + 1,
            g.count,
            g.signature.property,
            g.signature.tensor,
            g.signature.class,
            g.signature.implementation,
            g.finding.verdict.label()
        );
    }
    say!("triage: {}", t.summary());
    say!("wrote {} and {}", md.display(), json.display());
    let open = t.count(Verdict::Defect) + t.count(Verdict::HarnessError);
    Ok(if open > 0 { 1 } else { 0 })
}

/// The triage of one group, whatever goes wrong on the way (each failure becomes evidence).
fn one_group(
    args: &TriageArgs,
    backends: &mut Backends,
    (work, n): (&Path, usize),
    g: &Group,
    stop: &AtomicBool,
) -> Triaged {
    let cases = g
        .items
        .iter()
        .map(|i| format!("{}: case {}", i.dir.display(), i.entry.case))
        .collect();
    let mut t = Triaged {
        count: g.items.len(),
        signature: g.signature.clone(),
        representative: None,
        shrunk_here: false,
        repro: None,
        script: None,
        script_note: None,
        finding: Finding {
            verdict: Verdict::HarnessError,
            clause: None,
            evidence: Vec::new(),
        },
        cases,
        classes: g.classes(),
    };
    let Some((item, path, shrunk)) = g.representative() else {
        t.finding.evidence.push(format!(
            "no capsule of the group is on disk (looked for {} and in each DIR/capsules)",
            g.items[0].entry.capsule
        ));
        return t;
    };
    let mut case = match read_case(path) {
        Ok(c) => c,
        Err(e) => {
            t.finding
                .evidence
                .push(format!("the representative cannot be read: {e}"));
            return t;
        }
    };
    let mut path = path.to_path_buf();
    let repro_backend = if case.meta.contains_key(WORKER) {
        "exec".to_string()
    } else {
        (case.meta.get("smallseq.backend").cloned()).unwrap_or_else(|| item.backend.clone())
    };
    let detail = if g.signature.range_limit {
        item.entry.detail.clone()
    } else {
        recorded_detail(&case, &g.signature.property).unwrap_or_else(|| item.entry.detail.clone())
    };
    backends.with_replay(args, &case.clone(), &repro_backend, |replay, why| {
        let mut salt_replay = replay;
        let prop = Prop::ALL
            .into_iter()
            .find(|p| p.name() == g.signature.property);
        if let (false, Some(r), Some(prop), false) =
            (shrunk, salt_replay.as_ref(), prop, g.signature.range_limit)
        {
            if !args.shrink_time.is_zero() {
                let (small, steps) = shrink(r.checker, &case, prop, args.shrink_time, stop);
                let run = (steps > 0)
                    .then(|| r.checker.check(&small, 0).ok())
                    .flatten();
                if let Some(run) = run {
                    let dest = work.join(format!("group-{n:02}-shrunk.safetensors"));
                    if capsule::write(&dest, &small, &run, r.checker, 0, None).is_ok() {
                        (case, path, t.shrunk_here) = (small, dest, true);
                        // Shrinking checks with salt 0, so the shrunk case replays with it.
                        if let Some(r) = salt_replay.as_mut() {
                            r.salt = 0;
                        }
                    }
                }
            }
        }
        t.finding = judge(&g.signature, &detail, &case, salt_replay.as_ref(), why);
    });
    t.representative = Some(path.display().to_string());
    t.repro = Some(repro_cmd(&path, &repro_backend, &item.profile));
    let dest = work.join(format!("group-{n:02}.py"));
    match triage_script::write(&path, &case, &dest, args.adapters.as_deref()) {
        Ok(()) => t.script = Some(dest.display().to_string()),
        Err(why) => t.script_note = Some(why),
    }
    t
}

/// The detail the capsule's verdict records for `prop` (a shrunk capsule's own figures).
fn recorded_detail(case: &Case, prop: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(case.meta.get("smallseq.verdict")?).ok()?;
    let failures = v.get("failures")?.as_array()?;
    let f = failures
        .iter()
        .find(|f| f.get("property") == Some(&prop.into()))?;
    f.get("detail")?.as_str().map(str::to_string)
}

/// The backends and workers representatives replay on, opened once each: a worker that
/// imports a framework takes seconds to start, and a campaign has many groups.
#[derive(Default)]
struct Backends {
    open: std::collections::HashMap<String, Result<Target, String>>,
}

impl Backends {
    /// Calls `f` with a replay of `case` on its recorded backend or worker, or with none and
    /// why.
    fn with_replay(
        &mut self,
        args: &TriageArgs,
        case: &Case,
        name: &str,
        f: impl FnOnce(Option<Replay>, &str),
    ) {
        if args.no_replay {
            return f(None, "--no-replay");
        }
        let recorded = match Recorded::of(case, "the representative") {
            Ok(r) => r,
            Err(e) => return f(None, &format!("its replay record is unreadable: {e}")),
        };
        let profile = recorded.profile.unwrap_or(Profile::Native);
        let (env, salt, defines) = match &recorded.replay {
            Some(r) => (
                EnvView::from_pairs(r.env.clone()),
                r.salt,
                r.kernel_defines.join(" "),
            ),
            None => (EnvView::from_pairs(Vec::new()), 0, String::new()),
        };
        let planted: Vec<&str> = recorded.planted.iter().map(|m| m.name()).collect();
        let worker = (name == "exec")
            .then(|| super::repro::recorded_worker(case))
            .flatten();
        let through = match (&worker, planted.is_empty()) {
            (Some(w), _) => format!("the worker '{w}'"),
            (None, true) => format!("the {name} backend"),
            (None, false) => format!("the {name} backend with {} planted", planted.join(",")),
        };
        let key = format!(
            "{name}\n{}\n{}\n{}\n{defines}",
            worker.as_deref().unwrap_or(""),
            profile.name(),
            planted.join(",")
        );
        let opened = self.open.entry(key).or_insert_with(|| {
            // The CUDA backend reads its defines when it opens, and workers inherit them.
            if defines.is_empty() {
                std::env::remove_var(KERNEL_DEFINES_ENV);
            } else {
                std::env::set_var(KERNEL_DEFINES_ENV, &defines);
            }
            open_target(name, worker, profile, &recorded.planted)
        });
        let t = match opened {
            Ok(t) => t,
            Err(e) => return f(None, &format!("{through} cannot be opened here: {e}")),
        };
        let opts = RunOptions {
            profile,
            env,
            ..RunOptions::default()
        };
        let mut checker = Checker::new(t.runner(), opts);
        checker.design = Some(smallseq::harness::conditioning::Design::of_case(case));
        f(
            Some(Replay {
                checker: &checker,
                salt,
                through,
            }),
            "",
        )
    }
}

/// The backend `name` (planted bugs in this process), or a worker for `exec` and the GPUs.
fn open_target(
    name: &str,
    worker: Option<String>,
    profile: Profile,
    planted: &[smallseq::mutants::Mutant],
) -> Result<Target, String> {
    if name == "exec" || target::is_gpu(name) {
        let targs = TargetArgs {
            backend: name.to_string(),
            worker,
            isolate: true,
            in_process: false,
            devices: None,
            case_timeout: None,
            start_timeout: Duration::from_secs(600),
        };
        return target::open_with_env(&targs, profile, Some(1), Vec::new()).map(|(t, _)| t);
    }
    backend::open_planted(name, planted)
        .map(Target::InProcess)
        .map_err(|e| e.to_string())
}
