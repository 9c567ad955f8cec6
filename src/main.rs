//! The `smallseq` command.

#[macro_use]
#[path = "cli/say.rs"]
mod say;

mod cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "smallseq",
    version,
    about = "Small-sequence fused attention: reference, backends and fuzz harness"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Fuzz a backend against the f64 reference and every property.
    Fuzz(cli::fuzz::FuzzArgs),
    /// Replay a capsule: re-judge its outputs here, or rerun it on a backend.
    Repro(cli::repro::ReproArgs),
    /// Compute a case's outputs on a backend or the reference.
    Run(cli::run::RunArgs),
    /// Case files: `case new` writes one from flags.
    Case(cli::case::CaseArgs),
    /// Explain the dispatch decision for a case.
    Explain(cli::explain::ExplainArgs),
    /// Run the campaign against every planted bug (mutation score).
    Mutants(cli::mutants::MutantsArgs),
    /// Benchmark the f64 reference on the standard case.
    BenchReference(cli::reference_bench::BenchReferenceArgs),
    /// Time the GPU kernels against a same-bytes device copy.
    Bench(cli::bench::BenchArgs),
    /// Measure how often a backend's small-seq outputs sit more than one ulp from the emulation.
    Calibrate(cli::calibrate::CalibrateArgs),
    /// Serve a backend to a campaign over the worker protocol (stdin/stdout).
    Worker(cli::worker::WorkerArgs),
    /// Join the shard directories of a campaign into one report.
    Merge(cli::merge::MergeArgs),
    /// Render one HTML page over several runs' reports (trends, then each run).
    Report(cli::report::ReportArgs),
    /// Group campaigns' failures by signature; shrink, script and give each group a verdict.
    Triage(cli::triage::TriageArgs),
}

/// Keeps freed heap memory in the process instead of giving it back to the kernel.
///
/// Every case allocates and frees megabytes (the reference alone returns ~10 MB of f64
/// outputs on the standard case). With glibc's default thresholds the freed block coalesces
/// into the heap top, is trimmed, and the next case faults every page back in: on the main
/// thread that cost more than the whole f64 reference computation (2270 faults per case,
/// `bench-reference` 1 thread at 74 instead of 196-239 cases/s under the same load).
/// Setting the thresholds also pins glibc's otherwise self-tuning mmap threshold, hence both.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    const M_TRIM_THRESHOLD: i32 = -1;
    const M_MMAP_THRESHOLD: i32 = -3;
    // SAFETY: mallopt only changes allocator parameters; called before any thread exists.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 512 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    smallseq::harness::repro::set_program(cli::repro_program());
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // Ctrl-C or SIGTERM: `fuzz` and `mutants` read the flag, stop shrinking, finish their
        // case and write the report of what ran; `triage` finishes its groups in flight and
        // writes the others as not triaged. Further signals change nothing: `timeout`
        // signals the child and then its process group, so two arrive at once, and a report
        // must never be skipped (SIGKILL still leaves the last partial report). Every other
        // command exits at once, as without a handler.
        let graceful = matches!(
            cli.command,
            Command::Fuzz(_) | Command::Mutants(_) | Command::Triage(_)
        );
        let _ = ctrlc::set_handler(move || {
            if !graceful {
                std::process::exit(cli::EXIT_INTERRUPTED);
            }
            if !stop.swap(true, Ordering::SeqCst) {
                tell!("smallseq: stopping: finishing the current case, then writing the report");
            }
        });
    }
    let result = match &cli.command {
        Command::Fuzz(a) => cli::fuzz::run(a, stop),
        Command::Repro(a) => cli::repro::run(a),
        Command::Triage(a) => cli::triage::run(a, stop.clone()),
        Command::Run(a) => cli::run::run(a),
        Command::Explain(a) => cli::explain::run(a),
        Command::Case(a) => cli::case::run(a),
        Command::Mutants(a) => cli::mutants::run(a, &stop),
        Command::BenchReference(a) => cli::reference_bench::run(a),
        Command::Bench(a) => cli::bench::run(a).map(|()| 0),
        Command::Calibrate(a) => cli::calibrate::run(a),
        Command::Worker(a) => cli::worker::run(a),
        Command::Merge(a) => cli::merge::run(a),
        Command::Report(a) => cli::report::run(a),
    };
    match result {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            // Each cause once: an error that names its path already carries the OS error.
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    msg = format!("{msg}: {c}");
                }
            }
            tell!("smallseq: {msg}");
            ExitCode::from(cli::EXIT_USAGE as u8)
        }
    }
}
