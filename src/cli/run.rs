//! `smallseq run`: compute a case's outputs on a backend (or the f64 reference) into a file.

use anyhow::Result;
use smallseq::backend;
use smallseq::case_file::{write_case, OutputPrecision};
use smallseq::dispatch::{EnvView, Profile};
use smallseq::harness::capsule::{self, COMMIT, PROVENANCE, REPLAY};
use smallseq::harness::props::run_pair;
use smallseq::reference::forward_backward;
use smallseq::wrapper::RunOptions;
use smallseq::Outputs;
use std::path::{Path, PathBuf};

/// Run one case file and write its outputs.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// reference (f64 outputs), cpu, cuda, hip or te625-model.
    #[arg(long, default_value = "reference")]
    pub backend: String,
    /// Input case file.
    #[arg(long)]
    pub case: PathBuf,
    /// Output case file (inputs plus outputs); must not be the input.
    #[arg(long)]
    pub out: PathBuf,
    /// Dispatch profile.
    #[arg(long, default_value = "native")]
    pub profile: Profile,
}

/// Metadata that describes how an earlier file's outputs were made: dropped before new outputs
/// are written, so a new file never carries another run's verdict, path or provenance.
const RUN_META: [&str; 8] = [
    "smallseq.verdict",
    "smallseq.backend",
    "smallseq.path",
    "smallseq.path_bwd",
    "smallseq.profile",
    PROVENANCE,
    COMMIT,
    REPLAY,
];

/// Whether `a` and `b` name the same file (the output may not exist yet).
fn same_file(a: &Path, b: &Path) -> bool {
    let full = |p: &Path| {
        std::fs::canonicalize(p).unwrap_or_else(|_| {
            let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
            let dir = parent.map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            std::fs::canonicalize(&dir)
                .unwrap_or(dir)
                .join(p.file_name().unwrap_or_default())
        })
    };
    full(a) == full(b)
}

pub fn run(args: &RunArgs) -> Result<i32> {
    if same_file(&args.case, &args.out) {
        tell!(
            "smallseq: --out {} is the input case file: write the outputs to another file",
            args.out.display()
        );
        return Ok(super::EXIT_USAGE);
    }
    let mut case = match super::open_case(&args.case) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    for key in RUN_META {
        case.meta.remove(key);
    }
    let (precision, path) = if args.backend == "reference" {
        let (f, g) = forward_backward(&case.problem()?);
        case.outputs = Outputs {
            o: Some(f.o),
            lse: Some(f.lse),
            dq: g.as_ref().map(|g| g.dq.clone()),
            dk: g.as_ref().map(|g| g.dk.clone()),
            dbias: g.as_ref().and_then(|g| g.dbias.clone()),
            dv: g.map(|g| g.dv),
        };
        case.meta
            .insert("smallseq.backend".into(), "reference".into());
        (OutputPrecision::Reference, None)
    } else {
        let be = match backend::open(&args.backend) {
            Ok(b) => b,
            Err(e) => {
                tell!("smallseq: {e}");
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
                tell!("smallseq: {e}");
                return Ok(super::EXIT_USAGE);
            }
        };
        case.outputs = pair.outputs();
        capsule::stamp(&mut case.meta, be.as_ref());
        let path = pair.fwd.path.map_or("none", |p| p.name());
        case.meta.insert("smallseq.path".into(), path.into());
        case.meta
            .insert("smallseq.profile".into(), args.profile.name().into());
        (OutputPrecision::Device, Some(path))
    };
    write_case(&case, &args.out, precision)?;
    let o = &case.outputs;
    let tensors: Vec<&str> = [
        ("o", o.o.is_some()),
        ("lse", o.lse.is_some()),
        ("dq", o.dq.is_some()),
        ("dk", o.dk.is_some()),
        ("dv", o.dv.is_some()),
    ]
    .iter()
    .filter(|(_, some)| *some)
    .map(|(n, _)| *n)
    .collect();
    say!(
        "wrote {}: the inputs of {} and outputs {} from {}{}",
        args.out.display(),
        args.case.display(),
        tensors.join(", "),
        match precision {
            OutputPrecision::Reference => "the f64 reference (stored as f64)".to_string(),
            OutputPrecision::Device =>
                format!("backend {}, profile {}", args.backend, args.profile),
        },
        path.map_or(String::new(), |p| format!(", path {p}"))
    );
    Ok(0)
}
