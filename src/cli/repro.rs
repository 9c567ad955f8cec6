//! `smallseq repro`: replay a capsule.

use super::target::{self, TargetArgs};
use anyhow::Result;
use smallseq::backend;
use smallseq::dispatch::{apply_profile_defaults, EnvView, Profile};
use smallseq::harness::capsule::{self, FAULT, KERNEL_DEFINES_ENV, PROVENANCE, WORKER};
use smallseq::harness::props::Checker;
use smallseq::harness::repro::{judge_stored, rerun, Recorded};
use smallseq::mutants::Mutant;
use smallseq::runner::InProcess;
use smallseq::wrapper::RunOptions;
use std::path::PathBuf;

/// Re-judge a capsule's stored outputs here, or run it again on a backend.
#[derive(clap::Args, Debug)]
pub struct ReproArgs {
    /// The capsule (case file).
    pub capsule: PathBuf,
    /// Run the case again on this backend (cpu, cuda, hip, te625-model, exec with --worker).
    /// A capsule of a worker crash or hang is rerun in a worker process.
    #[arg(long)]
    pub backend: Option<String>,
    /// The worker command, with --backend exec (default: the one the capsule records).
    #[arg(long)]
    pub worker: Option<String>,
    /// Run an in-tree backend in a worker process.
    #[arg(long)]
    pub isolate: bool,
    /// Time the worker may take for one run of the case (default: the case timeout a hang
    /// capsule records, else from the case's size).
    #[arg(long, value_parser = super::parse_duration)]
    pub case_timeout: Option<std::time::Duration>,
    /// Dispatch profile for a rerun (default: the capsule's, else native).
    #[arg(long)]
    pub profile: Option<Profile>,
    /// Use this shell's dispatch variables and SMALLSEQ_KERNEL_DEFINES for a rerun instead of
    /// those the capsule recorded (the default replays the capsule's, and says so).
    #[arg(long)]
    pub current_env: bool,
}

pub fn run(args: &ReproArgs) -> Result<i32> {
    let case = match super::open_case(&args.capsule) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    // A crash or hang stored no outputs to judge: without --backend it is rerun where it
    // faulted (the recorded worker, else the recorded backend), and fails if it faults again.
    let fault_backend = case.meta.get(FAULT).and_then(|_| recorded_backend(&case));
    if let (None, Some(b)) = (&args.backend, &fault_backend) {
        say!("the capsule records a worker fault and no outputs to judge: rerunning it on --backend {b}");
    }
    let Some(name) = args.backend.as_ref().or(fault_backend.as_ref()) else {
        let diag = judge_stored(&case)?;
        for l in &diag.lines {
            say!("{l}");
        }
        // Stored outputs that pass say nothing of a relation the capsule failed: that is not
        // "not reproduced", so it exits as a refusal (the line above says to rerun it).
        return Ok(if diag.failed {
            1
        } else if diag.unreplayed.is_empty() {
            0
        } else {
            super::EXIT_USAGE
        });
    };
    let recorded = match Recorded::of(&case, &args.capsule.display().to_string()) {
        Ok(r) => r,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let profile = args.profile.or(recorded.profile).unwrap_or(Profile::Native);
    let planted = recorded.planted;
    let replay = recorded.replay;
    let (env, salt) = match &replay {
        Some(r) => {
            if args.current_env {
                let mut env = EnvView::from_process();
                let set = apply_profile_defaults(profile, &mut env);
                say!(
                    "replaying salt {}{}; dispatch variables and kernel defines from this shell \
                     (--current-env){}",
                    r.salt,
                    planted_text(&planted),
                    defaulted_text(&set)
                );
                (env, r.salt)
            } else {
                // The CUDA backend reads its defines when it opens (one process, one thread
                // here): the capsule's replace this shell's.
                if r.kernel_defines.is_empty() {
                    std::env::remove_var(KERNEL_DEFINES_ENV);
                } else {
                    std::env::set_var(KERNEL_DEFINES_ENV, r.kernel_defines.join(" "));
                }
                let env = EnvView::from_pairs(r.env.clone());
                let mut shown = r.clone();
                shown.profile = profile.name().into();
                say!(
                    "replaying the capsule's inputs: {} (--current-env uses this shell's \
                     environment instead)",
                    shown.describe()
                );
                (env, r.salt)
            }
        }
        None => {
            let mut env = EnvView::from_process();
            let set = apply_profile_defaults(profile, &mut env);
            say!(
                "the capsule records no replay inputs (written by an older smallseq): dispatch \
                 variables from this shell, salt 0{}",
                defaulted_text(&set)
            );
            (env, 0)
        }
    };
    let opts = RunOptions {
        profile,
        env,
        ..RunOptions::default()
    };
    let fault = case.meta.get(FAULT);
    let workers = fault.is_some() || args.isolate || name == "exec" || target::is_gpu(name);
    let t;
    let be;
    let checker = if workers {
        if !planted.is_empty() && !target::is_gpu(name) {
            tell!(
                "smallseq: the capsule's planted bugs ({}) run in this process: drop --isolate",
                planted_text(&planted).trim_start_matches(", planted ")
            );
            return Ok(super::EXIT_USAGE);
        }
        // A hang reruns under the case timeout it ran out of (unless --case-timeout says
        // otherwise): the default for the case's size can be far longer than the campaign's.
        let recorded_timeout = capsule::recorded_case_timeout(&case);
        if let Some(f) = fault {
            let v = serde_json::from_str::<serde_json::Value>(f).ok();
            let kind = (v.as_ref())
                .and_then(|v| Some(v.get("kind")?.as_str()?.to_string()))
                .unwrap_or_else(|| "fault".into());
            match (recorded_timeout, args.case_timeout) {
                (Some(t), None) => say!(
                    "the capsule records a worker {kind}; rerunning in a worker process with its \
                     case timeout of {:.1} s",
                    t.as_secs_f64()
                ),
                _ => say!("the capsule records a worker {kind}; rerunning in a worker process"),
            }
        }
        let targs = TargetArgs {
            backend: name.clone(),
            worker: args
                .worker
                .clone()
                .or_else(|| (name == "exec").then(|| recorded_worker(&case)).flatten()),
            isolate: true,
            in_process: false,
            devices: None,
            case_timeout: args.case_timeout.or(recorded_timeout),
            start_timeout: std::time::Duration::from_secs(600),
        };
        let env = if args.current_env {
            Vec::new()
        } else {
            replayed_worker_env(&case)
        };
        for (k, v) in &env {
            say!("replaying the capsule's worker environment: {k}={v}");
        }
        t = match target::open_with_env(&targs, profile, Some(1), env) {
            Ok((t, _)) => t,
            Err(e) => {
                tell!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
        Checker::new(t.runner(), opts)
    } else {
        be = match backend::open_planted(name, &planted) {
            Ok(b) => b,
            Err(e) => {
                tell!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
        Checker::new(Box::new(InProcess::new(be.as_ref())), opts)
    };
    let mut checker = checker;
    // Judged as the campaign judged it (`fuzz --design` included), not by what this build of
    // the worker declares.
    checker.design = Some(smallseq::harness::conditioning::Design::of_case(&case));
    let arch = checker.runner.caps().arch.clone().unwrap_or_default();
    if let Some(r) = replay.as_ref().filter(|r| r.arch != arch) {
        say!(
            "note: the capsule's gate was asked about arch {}; this backend is {arch} (a \
             device's arch cannot be replayed)",
            r.arch
        );
    }
    let diag = rerun(&checker, &case, salt)?;
    for l in &diag.lines {
        say!("{l}");
    }
    Ok(if diag.failed { 1 } else { 0 })
}

fn planted_text(planted: &[Mutant]) -> String {
    if planted.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = planted.iter().map(|m| m.name()).collect();
        format!(", planted {}", names.join(","))
    }
}

fn defaulted_text(set: &[String]) -> String {
    if set.is_empty() {
        String::new()
    } else {
        format!(" ({} unset here: defaulted by the profile)", set.join(" "))
    }
}

/// The backend a fault capsule ran on, as `--backend` takes it: `exec` where it records an
/// outside implementation's worker, else its recorded backend.
fn recorded_backend(case: &smallseq::Case) -> Option<String> {
    if case.meta.contains_key(WORKER) {
        return Some("exec".into());
    }
    case.meta.get("smallseq.backend").cloned()
}

/// The worker command a capsule records ([`WORKER`], or a fault's worker), as one line for
/// `--worker`.
pub(super) fn recorded_worker(case: &smallseq::Case) -> Option<String> {
    let words = match case.meta.get(WORKER) {
        Some(w) => serde_json::from_str::<serde_json::Value>(w).ok()?,
        None => {
            let f: serde_json::Value = serde_json::from_str(case.meta.get(FAULT)?).ok()?;
            f.get("worker")?.clone()
        }
    };
    let words: Vec<String> = words
        .as_array()?
        .iter()
        .filter_map(|x| x.as_str())
        .map(|w| {
            if w.contains(char::is_whitespace) {
                format!("'{w}'")
            } else {
                w.to_string()
            }
        })
        .collect();
    Some(words.join(" "))
}

/// Worker variables a capsule's provenance records (a planted worker fault): set for the
/// rerun's worker, so the printed repro command needs no environment of its own. (Kernel
/// defines are replayed through this process's environment, which workers inherit.)
pub(super) fn replayed_worker_env(case: &smallseq::Case) -> Vec<(String, String)> {
    case.meta
        .get(PROVENANCE)
        .and_then(|p| serde_json::from_str::<std::collections::BTreeMap<String, String>>(p).ok())
        .and_then(|p| p.get("planted_fault").cloned())
        .map(|f| vec![(smallseq::worker::serve::FAULT_VAR.to_string(), f)])
        .unwrap_or_default()
}
