//! `smallseq repro`: replay a capsule.

use super::target::{self, TargetArgs};
use anyhow::Result;
use smallseq::case_file::read_case;
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::capsule::{FAULT, PROVENANCE};
use smallseq::harness::props::Checker;
use smallseq::harness::repro::{judge_stored, rerun};
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
    /// Time the worker may take for one run of the case (default: from the case's size).
    #[arg(long, value_parser = super::parse_duration)]
    pub case_timeout: Option<std::time::Duration>,
    /// Dispatch profile for a rerun (default: the capsule's, else native).
    #[arg(long)]
    pub profile: Option<Profile>,
}

pub fn run(args: &ReproArgs) -> Result<i32> {
    let case = match read_case(&args.capsule) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let diag = match &args.backend {
        None => judge_stored(&case)?,
        Some(name) => {
            let fault = case.meta.get(FAULT);
            let recorded_worker = fault
                .and_then(|f| serde_json::from_str::<serde_json::Value>(f).ok())
                .and_then(|f| f.get("worker")?.as_array().cloned())
                .map(|w| {
                    w.iter()
                        .filter_map(|x| x.as_str().map(shell_word))
                        .collect::<Vec<_>>()
                        .join(" ")
                });
            let targs = TargetArgs {
                backend: name.clone(),
                worker: args
                    .worker
                    .clone()
                    .or_else(|| (name == "exec").then_some(recorded_worker).flatten()),
                isolate: args.isolate || fault.is_some(),
                devices: None,
                case_timeout: args.case_timeout,
                start_timeout: std::time::Duration::from_secs(600),
            };
            let env = replayed_worker_env(&case);
            for (k, v) in &env {
                println!("replaying the capsule's worker environment: {k}={v}");
            }
            if let Some(f) = fault {
                let kind = serde_json::from_str::<serde_json::Value>(f)
                    .ok()
                    .and_then(|v| Some(v.get("kind")?.as_str()?.to_string()))
                    .unwrap_or_else(|| "fault".into());
                println!("the capsule records a worker {kind}; rerunning in a worker process");
            }
            let profile = args
                .profile
                .or_else(|| {
                    case.meta
                        .get("smallseq.profile")
                        .and_then(|p| p.parse().ok())
                })
                .unwrap_or(Profile::Native);
            let (t, _) = match target::open_with_env(&targs, profile, Some(1), env) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("smallseq: {e}");
                    return Ok(super::EXIT_USAGE);
                }
            };
            let checker = Checker::new(
                t.runner(),
                RunOptions {
                    profile,
                    env: EnvView::from_process(),
                    ..RunOptions::default()
                },
            );
            rerun(&checker, &case)?
        }
    };
    for l in &diag.lines {
        println!("{l}");
    }
    Ok(if diag.failed { 1 } else { 0 })
}

/// Worker variables a capsule's provenance records (a planted fault, kernel defines): set
/// for the rerun's worker, so the printed repro command needs no environment of its own.
fn replayed_worker_env(case: &smallseq::Case) -> Vec<(String, String)> {
    let Some(p) = case
        .meta
        .get(PROVENANCE)
        .and_then(|p| serde_json::from_str::<std::collections::BTreeMap<String, String>>(p).ok())
    else {
        return Vec::new();
    };
    let mut env = Vec::new();
    if let Some(f) = p.get("planted_fault") {
        env.push((smallseq::worker::serve::FAULT_VAR.to_string(), f.clone()));
    }
    if let Some(d) = p.get("defines") {
        env.push(("SMALLSEQ_KERNEL_DEFINES".to_string(), d.clone()));
    }
    env
}

/// A word quoted for `split_command` when it holds a space.
fn shell_word(w: &str) -> String {
    if w.contains(char::is_whitespace) {
        format!("'{w}'")
    } else {
        w.to_string()
    }
}
