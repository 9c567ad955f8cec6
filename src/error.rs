//! The library's typed errors.

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
    #[error("backend {backend}: {detail}")]
    Backend { backend: String, detail: String },
    #[error(transparent)]
    Misaligned(#[from] crate::backend::launch::Misaligned),
    /// A failure of the HIP backend: a HIP call, a code object, a launch.
    #[cfg(feature = "hip")]
    #[error("backend hip: {0}")]
    Hip(crate::backend::hip::HipError),
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
    Fault(crate::runner::Fault),
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
