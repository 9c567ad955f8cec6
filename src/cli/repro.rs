//! `smallseq repro`: replay a capsule.

use anyhow::Result;
use smallseq::backend;
use smallseq::dispatch::{apply_profile_defaults, EnvView, Profile};
use smallseq::harness::capsule::{Replay, KERNEL_DEFINES_ENV};
use smallseq::harness::props::Checker;
use smallseq::harness::repro::{judge_stored, rerun};
use smallseq::mutants::Mutant;
use smallseq::wrapper::RunOptions;
use std::path::PathBuf;

/// Re-judge a capsule's stored outputs here, or run it again on a backend.
#[derive(clap::Args, Debug)]
pub struct ReproArgs {
    /// The capsule (case file).
    pub capsule: PathBuf,
    /// Run the case again on this backend (cpu, cuda, hip, te625-model).
    #[arg(long)]
    pub backend: Option<String>,
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
    let Some(name) = &args.backend else {
        let diag = judge_stored(&case)?;
        for l in &diag.lines {
            println!("{l}");
        }
        return Ok(if diag.failed { 1 } else { 0 });
    };
    let replay = match Replay::from_meta(&case.meta).transpose() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("smallseq: {}: {e}", args.capsule.display());
            return Ok(super::EXIT_USAGE);
        }
    };
    let profile = args
        .profile
        .or_else(|| {
            let recorded = replay.as_ref().map(|r| r.profile.clone());
            recorded
                .or_else(|| case.meta.get("smallseq.profile").cloned())
                .and_then(|p| p.parse().ok())
        })
        .unwrap_or(Profile::Native);
    let mut planted = Vec::new();
    let (env, salt) = match &replay {
        Some(r) => {
            for name in &r.planted {
                match name.parse::<Mutant>() {
                    Ok(m) => planted.push(m),
                    Err(e) => {
                        eprintln!("smallseq: {}: planted bug: {e}", args.capsule.display());
                        return Ok(super::EXIT_USAGE);
                    }
                }
            }
            if args.current_env {
                let mut env = EnvView::from_process();
                let set = apply_profile_defaults(profile, &mut env);
                println!(
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
                println!(
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
            println!(
                "the capsule records no replay inputs (written by an older smallseq): dispatch \
                 variables from this shell, salt 0{}",
                defaulted_text(&set)
            );
            (env, 0)
        }
    };
    let be = match backend::open_planted(name, &planted) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    if let Some(r) = replay.as_ref().filter(|r| r.arch != be.arch().name()) {
        println!(
            "note: the capsule's gate was asked about arch {}; this backend is {} (a device's \
             arch cannot be replayed)",
            r.arch,
            be.arch()
        );
    }
    let checker = Checker {
        backend: be.as_ref(),
        opts: RunOptions {
            profile,
            env,
            ..RunOptions::default()
        },
    };
    let diag = rerun(&checker, &case, salt)?;
    for l in &diag.lines {
        println!("{l}");
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
