//! `smallseq explain`: the dispatch decision for a case, with every reason.

use anyhow::Result;
use smallseq::dispatch::{Arch, Dispatcher, EnvView, Profile, RuntimeFacts};
use smallseq::harness::repro::Recorded;
use std::path::PathBuf;

/// Print whether a case takes the small-seq path, and why not.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The case file.
    #[arg(long)]
    pub case: PathBuf,
    /// native or te625 (default: the capsule's, as `repro` replays it, else native).
    #[arg(long)]
    pub profile: Option<Profile>,
    /// KEY=VALUE; with any --env, only these variables are seen (default: those the capsule
    /// recorded, else this shell's).
    #[arg(long = "env", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// cpu, sm_90, gfx942, gfx950, ... (default: the capsule's, else the CPU backend's device).
    #[arg(long)]
    pub arch: Option<Arch>,
    /// Print exactly one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got '{s}'"))
}

pub fn run(args: &ExplainArgs) -> Result<i32> {
    let case = match super::open_case(&args.case) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    let recorded = match Recorded::of(&case, &args.case.display().to_string()) {
        Ok(r) => r,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let profile = args.profile.or(recorded.profile).unwrap_or(Profile::Native);
    let env = if !args.env.is_empty() {
        EnvView::from_pairs(args.env.iter().cloned())
    } else if let Some(pairs) = recorded.env() {
        EnvView::from_pairs(pairs)
    } else {
        EnvView::from_process()
    };
    let arch = args
        .arch
        .clone()
        .or_else(|| recorded.arch())
        .unwrap_or_else(Arch::cpu);
    // Bugs planted in the gate change its decision as they changed the campaign's.
    let defects = if recorded.planted.is_empty() {
        Default::default()
    } else {
        match smallseq::backend::open_planted("cpu", &recorded.planted) {
            Ok(be) => be.gate_defects(),
            Err(e) => {
                tell!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        }
    };
    if let (Some(r), false) = (&recorded.replay, args.json) {
        let mut shown = r.clone();
        shown.profile = profile.name().into();
        shown.arch = arch.name().into();
        if !args.env.is_empty() {
            shown.env = args.env.iter().cloned().collect();
        }
        say!(
            "the capsule's dispatch inputs (flags override them): {}",
            shown.describe()
        );
    }
    let d = Dispatcher {
        profile,
        backend_has_kernel: smallseq::dispatch::surface::NATIVE_ARCHES.contains(&arch.name()),
        arch,
        env,
        defects,
    };
    let decision = d.decide(
        &d.plan(&case.config),
        &RuntimeFacts::new(case.config.layout, &case.layout),
    );
    if args.json {
        say!("{}", decision.to_json());
    } else {
        say!(
            "path: {} (profile {}, arch {})",
            decision.path,
            decision.profile,
            d.arch
        );
        for r in &decision.reasons {
            say!("  {:<12} {}", r.code.name(), r.detail);
        }
    }
    Ok(0)
}
