//! `smallseq repro`: replay a capsule.

use anyhow::Result;
use smallseq::backend;
use smallseq::case_file::read_case;
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::props::Checker;
use smallseq::harness::repro::{judge_stored, rerun};
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
            let be = match backend::open(name) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("smallseq: {e}");
                    return Ok(super::EXIT_USAGE);
                }
            };
            let profile = args
                .profile
                .or_else(|| {
                    case.meta
                        .get("smallseq.profile")
                        .and_then(|p| p.parse().ok())
                })
                .unwrap_or(Profile::Native);
            let checker = Checker {
                backend: be.as_ref(),
                opts: RunOptions {
                    profile,
                    env: EnvView::from_process(),
                    ..RunOptions::default()
                },
            };
            rerun(&checker, &case)?
        }
    };
    for l in &diag.lines {
        println!("{l}");
    }
    Ok(if diag.failed { 1 } else { 0 })
}
