//! The library's typed errors: plain data, independent of the enabled features. Nothing here
//! names a backend's or a worker's own types; each backend converts its errors into these
//! (`impl From<HipError> for Error` lives in the HIP backend, `CudaError`'s in the CUDA one).

use smallseq_reference::LayoutError;
use thiserror::Error;

/// Everything the library can refuse or fail at. Each variant names what was wrong and where.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("config: {0}")]
    Config(String),
    #[error("case file {path}: {detail}")]
    CaseFile { path: String, detail: String },
    #[error("tensor {tensor}: {detail}")]
    Tensor { tensor: String, detail: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("workspace: {0}")]
    Workspace(String),
    /// What a backend cannot do or failed at outside its device: a kernel build, a grid too
    /// large, a broken reply. A failure of the property that asked.
    #[error("backend {backend}: {detail}")]
    Backend { backend: String, detail: String },
    #[error(transparent)]
    Misaligned(#[from] Misaligned),
    /// The device or its runtime failed: a driver or runtime call returned an error (an
    /// allocation, a copy, a launch, a synchronisation: illegal address, trap, lost context),
    /// or the device has no kernels to load. A worker reports it as `device`, a crash
    /// (`docs/worker-protocol.md`).
    #[error("backend {backend}: {detail}")]
    Device { backend: String, detail: String },
    #[error("backend {backend} is not available: {detail}")]
    NoDevice { backend: String, detail: String },
    #[error(
        "smallseq was built without the `{feature}` feature (build it with `cargo build \
         --release --features {feature}`, or install it with `cargo install --path . \
         --features {feature}`)"
    )]
    NotCompiledWith { feature: &'static str },
    /// A worker process crashed or hung on the case (`docs/worker-protocol.md`, Faults).
    #[error("worker {}: {}", .0.kind.name(), .0.detail)]
    Fault(Fault),
    /// A worker broke the protocol before any case (handshake, version, caps).
    #[error("worker {command}: {detail}")]
    WorkerStart { command: String, detail: String },
    /// A report page that cannot be made: an unreadable `report.json`, a chart.
    #[error("report: {0}")]
    Report(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Shorthand for a config error.
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }

    /// Whether this error means "no device here" (exit status 2 and a one-line message).
    pub fn is_no_device(&self) -> bool {
        matches!(
            self,
            Error::NoDevice { .. } | Error::NotCompiledWith { .. } | Error::WorkerStart { .. }
        )
    }
}

/// A tensor that a kernel reads or writes 16 bytes per lane at a time does not start on 16
/// bytes (`crate::backend::kernel_args::check_aligned`).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{kernel}: tensor {tensor} at {addr:#x} is not 16-byte aligned (vector loads and stores)")]
pub struct Misaligned {
    /// The kernel kind (`SmallSeqBwd`, `TiledFwd`, …).
    pub kernel: &'static str,
    pub tensor: &'static str,
    pub addr: u64,
}

/// How a worker failed a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// It exited, was killed, broke the protocol, or reported a device error.
    Crash,
    /// It did not answer within the case timeout.
    Hang,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Crash => "crash",
            FaultKind::Hang => "hang",
        }
    }

    /// "crashed" / "hung", for sentences.
    pub fn past(self) -> &'static str {
        match self {
            FaultKind::Crash => "crashed",
            FaultKind::Hang => "hung",
        }
    }
}

/// A worker fault, with what the worker printed last.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub kind: FaultKind,
    pub detail: String,
    /// The tail of the worker's stderr.
    pub stderr: String,
    /// The case timeout a hang ran out of, in seconds (`--case-timeout`, else the default of
    /// the case's size): recorded in the capsule, so that `repro` waits as long and no
    /// longer. `None` for a crash.
    pub timeout_s: Option<f64>,
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The first line of a caught panic's message.
pub(crate) fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}
