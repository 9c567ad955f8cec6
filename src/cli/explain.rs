//! `smallseq explain`: the dispatch decision for a case, with every reason.

use anyhow::Result;
use smallseq::dispatch::{Arch, Dispatcher, EnvView, Profile, RuntimeFacts};
use std::path::PathBuf;

/// Print whether a case takes the small-seq path, and why not.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The case file.
    #[arg(long)]
    pub case: PathBuf,
    /// native or te625.
    #[arg(long, default_value = "native")]
    pub profile: Profile,
    /// KEY=VALUE; with any --env, only these variables are seen.
    #[arg(long = "env", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// cpu, sm_90, gfx942, gfx950, ... (default: the CPU backend's device).
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
    let env = if args.env.is_empty() {
        EnvView::from_process()
    } else {
        EnvView::from_pairs(args.env.iter().cloned())
    };
    let arch = args.arch.clone().unwrap_or_else(Arch::cpu);
    let d = Dispatcher {
        profile: args.profile,
        backend_has_kernel: smallseq::dispatch::surface::NATIVE_ARCHES.contains(&arch.name()),
        arch,
        env,
        defects: Default::default(),
    };
    let decision = d.decide(
        &d.plan(&case.config),
        &RuntimeFacts::new(case.config.layout, &case.layout),
    );
    if args.json {
        println!("{}", decision.to_json());
    } else {
        println!(
            "path: {} (profile {}, arch {})",
            decision.path, decision.profile, d.arch
        );
        for r in &decision.reasons {
            println!("  {:<12} {}", r.code.name(), r.detail);
        }
    }
    Ok(0)
}
