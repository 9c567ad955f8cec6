//! `smallseq worker`: serve an in-tree backend over `smallseq-worker/1` on stdin/stdout.

use anyhow::Result;
use smallseq::backend::{self, Backend};
use smallseq::dispatch::Profile;
use smallseq::worker::serve::serve;

/// Serve a backend to a campaign (started by `smallseq fuzz`; see docs/worker-protocol.md).
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Backend to serve: cpu, cuda, hip, te625-model.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Device ordinal (as the runtime numbers them after CUDA_VISIBLE_DEVICES /
    /// HIP_VISIBLE_DEVICES).
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Dispatch profile of the wrappers: native or te625.
    #[arg(long, default_value = "native")]
    pub profile: Profile,
}

pub fn run(args: &WorkerArgs) -> Result<i32> {
    let (be, devices) = match open(args) {
        Ok(b) => b,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    let stdin = std::io::stdin().lock();
    let stdout = std::io::stdout().lock();
    Ok(serve(be.as_ref(), args.profile, devices, stdin, stdout)?)
}

/// The backend, its kernels compiled before the handshake (so the first case does not count
/// compile time against its timeout), and the devices it could serve.
fn open(args: &WorkerArgs) -> smallseq::Result<(Box<dyn Backend>, usize)> {
    #[cfg(feature = "cuda")]
    if args.backend == "cuda" && std::env::var_os(backend::gpu::cuda::SYNC_VAR).is_none() {
        // Workers share the host's cores with their campaign's judging threads.
        std::env::set_var(backend::gpu::cuda::SYNC_VAR, "blocking");
    }
    let be = backend::open_with(&backend::Spec {
        name: &args.backend,
        device: args.device,
        warm: true,
        ..backend::Spec::default()
    })?;
    Ok((be, backend::device_count(&args.backend).max(1)))
}
