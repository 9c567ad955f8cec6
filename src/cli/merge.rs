//! `smallseq merge`: the shards of a campaign joined into one report.

use super::write_reports;
use anyhow::Result;
use smallseq::harness::merge::merge;
use std::path::PathBuf;

/// Join shard directories (`fuzz --shard I/N --out DIR`) into one report.
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The shards' output directories, every one of 0/N … N-1/N.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where to write report.json, junit.xml, summary.md, margins.json and capsules/.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the report of a previous run in --out (without it, a --out that holds one is
    /// refused, so no run silently wipes another's capsules).
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: &MergeArgs) -> Result<i32> {
    // --force would remove a shard's own report before it is read.
    let same = |d: &PathBuf| match (d.canonicalize(), args.out.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => d == &args.out,
    };
    if let Some(d) = args.dirs.iter().find(|d| same(d)) {
        tell!(
            "smallseq merge: --out {} is one of the shards to merge; give another folder",
            d.display()
        );
        return Ok(super::EXIT_USAGE);
    }
    if let Err(code) = super::prepare_out("merge", &args.out, &[], args.force) {
        return Ok(code);
    }
    let rep = match merge(&args.dirs, &args.out) {
        Ok(r) => r,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    write_reports(&args.out, &rep)?;
    say!(
        "merged {} shard(s): {} cases, {} failure(s); report: {}",
        args.dirs.len(),
        rep.cases,
        rep.failures.len(),
        args.out.join("report.json").display()
    );
    Ok(if rep.failed() { 1 } else { 0 })
}
