//! `smallseq run`: compute a case's outputs on a backend (or the f64 reference) into a file.

use anyhow::Result;
use smallseq::backend;
use smallseq::case_file::{read_case, write_case, OutputPrecision};
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::capsule;
use smallseq::harness::props::run_pair;
use smallseq::reference::forward_backward;
use smallseq::wrapper::RunOptions;
use smallseq::Outputs;
use std::path::PathBuf;

/// Run one case file and write its outputs.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// reference (f64 outputs), cpu, cuda, hip or te625-model.
    #[arg(long, default_value = "reference")]
    pub backend: String,
    /// Input case file.
    #[arg(long)]
    pub case: PathBuf,
    /// Output case file (inputs plus outputs).
    #[arg(long)]
    pub out: PathBuf,
    /// Dispatch profile.
    #[arg(long, default_value = "native")]
    pub profile: Profile,
}

pub fn run(args: &RunArgs) -> Result<i32> {
    let mut case = match read_case(&args.case) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let precision = if args.backend == "reference" {
        let (f, g) = forward_backward(&case.problem()?);
        case.outputs = Outputs {
            o: Some(f.o),
            lse: Some(f.lse),
            dq: g.as_ref().map(|g| g.dq.clone()),
            dk: g.as_ref().map(|g| g.dk.clone()),
            dv: g.map(|g| g.dv),
        };
        case.meta
            .insert("smallseq.backend".into(), "reference".into());
        OutputPrecision::Reference
    } else {
        let be = match backend::open(&args.backend) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
        let opts = RunOptions {
            profile: args.profile,
            env: EnvView::from_process(),
            ..RunOptions::default()
        };
        let pair = match run_pair(be.as_ref(), &case, &opts) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
        case.outputs = pair.outputs();
        capsule::stamp(&mut case.meta, be.as_ref());
        let path = pair.fwd.path.map_or("none", |p| p.name());
        case.meta.insert("smallseq.path".into(), path.into());
        OutputPrecision::Device
    };
    write_case(&case, &args.out, precision)?;
    Ok(0)
}
