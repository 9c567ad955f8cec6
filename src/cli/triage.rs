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
use smallseq::harness::shrink::shrink_capped;
use smallseq::harness::triage::{self, Group, Signature};
use smallseq::harness::triage_report::{Triage, Triaged};
use smallseq::harness::triage_script;
use smallseq::harness::triage_verdict::{judge, Finding, Replay, Verdict};
use smallseq::wrapper::RunOptions;
use smallseq::Case;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Group a campaign's failures, shrink and script a representative of each, and give each
/// group a verdict: defect, design or range limit, or harness error.
#[derive(clap::Args, Debug)]
pub struct TriageArgs {
    /// Campaign output directories (each with report.json and capsules/).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where triage.md, triage.json and triage/ (each group's representative capsule, shrunk
    /// or copied, and its script) go (default: the first DIR).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Time spent shrinking a representative the campaign left unshrunk (0s: none).
    #[arg(long, default_value = "20s", value_parser = super::parse_duration)]
    pub shrink_time: Duration,
    /// At most this many reruns while shrinking one representative (a worker's case can take
    /// seconds).
    #[arg(long, default_value_t = 200)]
    pub shrink_reruns: usize,
    /// Groups triaged at once (default: one per core). Each worker-run implementation gets a
    /// pool of up to 4 workers, shared by the groups in flight.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Start no group after this long: the groups in flight stop shrinking and finish, the
    /// rest are written as "not triaged (time)". Ctrl-C and SIGTERM do the same at once.
    #[arg(long, value_parser = super::parse_duration)]
    pub time: Option<Duration>,
    /// Judge from the capsules alone: do not rerun representatives on their backend or worker.
    #[arg(long)]
    pub no_replay: bool,
    /// The adapters folder, which holds standalone.py (default: SMALLSEQ_ADAPTERS, else the
    /// source tree's adapters/ this binary was built from, else ./adapters). It runs under
    /// SMALLSEQ_PYTHON when set, else python3, which needs numpy and safetensors.
    #[arg(long)]
    pub adapters: Option<PathBuf>,
}

/// What every thread of a triage shares: the groups, the finished verdicts (in group order)
/// and the files they are written to after each group.
struct Shared<'g> {
    groups: &'g [Group],
    done: Mutex<Vec<Option<Triaged>>>,
    dirs: Vec<String>,
    out: PathBuf,
}

impl Shared<'_> {
    /// The triage as it stands: finished groups with their verdicts, the others not triaged.
    fn snapshot(&self, done: &[Option<Triaged>]) -> Triage {
        Triage {
            dirs: self.dirs.clone(),
            groups: (self.groups.iter().zip(done))
                .map(|(g, t)| t.clone().unwrap_or_else(|| Triaged::not_triaged(g)))
                .collect(),
        }
    }

    /// Records group `i`'s verdict and rewrites triage.md and triage.json, so that a triage
    /// cut off by a time limit (even by SIGKILL) leaves every group finished before it.
    fn finish(&self, i: usize, t: Triaged) -> Result<(), String> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        done[i] = Some(t);
        let snap = self.snapshot(&done);
        snap.write(&self.out).map(|_| ()).map_err(|e| e.to_string())
    }
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
    // Largest first (`triage::group`'s order): a triage cut off by its time loses the small
    // groups, not the ones that hold most failures.
    let groups = triage::group(items);
    let work = out.join("triage");
    if let Err(e) = std::fs::create_dir_all(&work) {
        tell!("smallseq triage: cannot create {}: {e}", work.display());
        return Ok(super::EXIT_USAGE);
    }
    let shared = Shared {
        groups: &groups,
        done: Mutex::new(vec![None; groups.len()]),
        dirs: args.dirs.iter().map(|d| d.display().to_string()).collect(),
        out: out.clone(),
    };
    // Written before the first group: a triage killed at once still leaves the groups.
    if let Err(e) = shared.snapshot(&vec![None; groups.len()]).write(&out) {
        tell!("smallseq triage: {e}");
        return Ok(super::EXIT_USAGE);
    }
    let jobs = args
        .jobs
        .unwrap_or_else(super::target::cores)
        .clamp(1, groups.len().max(1));
    let bar = ProgressBar::new(groups.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("triage [{bar:30}] {pos}/{len} groups: {msg}")
            .expect("a fixed template"),
    );
    let backends = Backends::for_groups(&groups, jobs);
    let next = AtomicUsize::new(0);
    let finished = AtomicBool::new(false);
    let write_error = Mutex::new(None::<String>);
    std::thread::scope(|s| {
        if let Some(limit) = args.time {
            let (stop, finished) = (&stop, &finished);
            s.spawn(move || {
                let start = Instant::now();
                while !finished.load(Ordering::SeqCst) {
                    if start.elapsed() >= limit {
                        if !stop.swap(true, Ordering::SeqCst) {
                            tell!(
                                "smallseq triage: --time reached: finishing the groups in flight"
                            );
                        }
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        }
        let threads: Vec<_> = (0..jobs)
            .map(|_| {
                s.spawn(|| loop {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(g) = groups.get(i) else { return };
                    bar.set_message(format!("{} {}", g.signature.property, g.signature.tensor));
                    if bar.is_hidden() {
                        tell!(
                            "triage: group {}/{}: {} {} ({} case(s))",
                            i + 1,
                            groups.len(),
                            g.signature.property,
                            g.signature.tensor,
                            g.items.len()
                        );
                    }
                    let t = one_group(args, &backends, (&work, i + 1), g, &stop);
                    if let Err(e) = shared.finish(i, t) {
                        let mut w = write_error.lock().unwrap_or_else(|p| p.into_inner());
                        w.get_or_insert(e);
                    }
                    bar.inc(1);
                })
            })
            .collect();
        for t in threads {
            let _ = t.join();
        }
        finished.store(true, Ordering::SeqCst);
    });
    bar.finish_and_clear();
    let t = shared.snapshot(&shared.done.lock().unwrap_or_else(|p| p.into_inner()));
    let written = match write_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => t.write(&out).map_err(|e| e.to_string()),
    };
    let (json, md) = match written {
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
    if t.count(Verdict::NotTriaged) > 0 {
        return Ok(super::EXIT_INTERRUPTED);
    }
    let open = t.count(Verdict::Defect) + t.count(Verdict::HarnessError);
    Ok(if open > 0 { 1 } else { 0 })
}

/// The triage of one group, whatever goes wrong on the way (each failure becomes evidence).
fn one_group(
    args: &TriageArgs,
    backends: &Backends,
    (work, n): (&Path, usize),
    g: &Group,
    stop: &AtomicBool,
) -> Triaged {
    let mut t = Triaged::not_triaged(g);
    t.finding = Finding {
        verdict: Verdict::HarnessError,
        clause: None,
        evidence: Vec::new(),
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
    backends.with_replay(
        args,
        &case.clone(),
        &repro_backend,
        &g.signature,
        |replay, why| {
            let mut salt_replay = replay;
            let prop = Prop::ALL
                .into_iter()
                .find(|p| p.name() == g.signature.property);
            if let (false, Some(r), Some(prop), false) =
                (shrunk, salt_replay.as_ref(), prop, g.signature.range_limit)
            {
                if !args.shrink_time.is_zero() {
                    let (small, steps) = shrink_capped(
                        r.checker,
                        &case,
                        prop,
                        args.shrink_time,
                        args.shrink_reruns,
                        stop,
                    );
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
        },
    );
    // The representative travels with triage.md: campaign folders can be too large to bring
    // back from a device call, a capsule is a few kilobytes.
    if !t.shrunk_here {
        let copy = work.join(format!("group-{n:02}.safetensors"));
        match std::fs::copy(&path, &copy) {
            Ok(_) => {
                t.source = Some(path.display().to_string());
                path = copy;
            }
            Err(e) => t.finding.evidence.push(format!(
                "the representative could not be copied to {}: {e}",
                copy.display()
            )),
        }
    }
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

/// One backend or worker pool, opened on first use by whichever thread needs it first.
type Opened = Arc<OnceLock<Result<Target, String>>>;

/// The backends and workers representatives replay on, opened once each and shared by the
/// threads: a worker that imports a framework takes seconds to start, and a campaign has many
/// groups.
struct Backends {
    open: Mutex<HashMap<String, Opened>>,
    /// Workers per pool, by implementation: its groups, at most the jobs and at most 4.
    workers: HashMap<String, usize>,
}

impl Backends {
    fn for_groups(groups: &[Group], jobs: usize) -> Backends {
        let mut workers: HashMap<String, usize> = HashMap::new();
        for g in groups {
            *workers
                .entry(g.signature.implementation.clone())
                .or_default() += 1;
        }
        for n in workers.values_mut() {
            *n = (*n).min(jobs).min(4);
        }
        Backends {
            open: Mutex::new(HashMap::new()),
            workers,
        }
    }

    /// Calls `f` with a replay of `case` (of a group of `sig`) on its recorded backend or
    /// worker, or with none and why.
    fn with_replay(
        &self,
        args: &TriageArgs,
        case: &Case,
        name: &str,
        sig: &Signature,
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
        // A hang's representative reruns under the case timeout it ran out of, as `repro`
        // does (in a pool of its own: the others keep the default of their size).
        let timeout = capsule::recorded_case_timeout(case);
        // A worker's crash or hang reruns in a worker, with the environment that worker had
        // (a planted fault), as `repro` reruns it: in this process it could not fault.
        let fault_env = case
            .meta
            .contains_key(capsule::FAULT)
            .then(|| super::repro::replayed_worker_env(case));
        let key = format!(
            "{name}\n{}\n{}\n{}\n{defines}\n{:?}\n{fault_env:?}",
            worker.as_deref().unwrap_or(""),
            profile.name(),
            planted.join(","),
            timeout.map(|t| t.as_millis())
        );
        let slot = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.entry(key).or_default().clone()
        };
        let workers = self.workers.get(&sig.implementation).copied().unwrap_or(1);
        // Outside the map's lock: two implementations' workers start side by side.
        let opened = slot.get_or_init(|| {
            open_target(
                name,
                worker,
                profile,
                &recorded.planted,
                &defines,
                Pool {
                    workers,
                    case_timeout: timeout,
                    fault_env,
                },
            )
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

/// How a replay's workers are run.
struct Pool {
    workers: usize,
    /// The case timeout a hang capsule records (`None`: the default of the case's size).
    case_timeout: Option<Duration>,
    /// A worker fault's capsule: the environment its worker had (it reruns in a worker).
    fault_env: Option<Vec<(String, String)>>,
}

/// The backend `name` (planted bugs in this process), or a pool of `workers` workers for
/// `exec`, the GPUs and a worker fault's capsule (`fault_env`: the environment its worker had;
/// the case timeout it ran out of), which get the recorded kernel `defines` in their
/// environment (not this process's: threads opening other targets read it).
fn open_target(
    name: &str,
    worker: Option<String>,
    profile: Profile,
    planted: &[smallseq::mutants::Mutant],
    defines: &str,
    pool: Pool,
) -> Result<Target, String> {
    let Pool {
        workers,
        case_timeout,
        fault_env,
    } = pool;
    if name == "exec" || target::is_gpu(name) || fault_env.is_some() {
        let targs = TargetArgs {
            backend: name.to_string(),
            worker,
            isolate: true,
            in_process: false,
            devices: None,
            case_timeout,
            start_timeout: Duration::from_secs(600),
        };
        let mut env = vec![(KERNEL_DEFINES_ENV.to_string(), defines.to_string())];
        env.extend(fault_env.unwrap_or_default());
        return target::open_with_env(&targs, profile, Some(workers), env).map(|(t, _)| t);
    }
    backend::open_planted(name, planted)
        .map(Target::InProcess)
        .map_err(|e| e.to_string())
}
