//! The implementation under test as the properties see it: something that runs a case
//! (forward, then backward from that forward) under [`RunOptions`] and says what it knows of
//! itself. In this process ([`InProcess`], over a [`Backend`]) or in worker processes
//! ([`crate::worker::Pool`], `docs/worker-protocol.md`).

pub mod caps;
pub mod pair;

/// A worker's fault: plain data of the error module, named here where runners report it.
pub use crate::error::{Fault, FaultKind};
pub use caps::{Caps, NoKeyRow, WireCaps};
pub use pair::{run_pair, Pair};

use crate::backend::{rounding_budget_of, Backend};
use crate::case::Case;
use crate::config::AttnConfig;
use crate::dispatch::gate::Dispatcher;
use crate::error::{Error, Result};
use crate::wrapper::{self, BwdResult, RunOptions};
use ndarray::{Array2, Array3};
use smallseq_reference::Layout;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// What runs cases for the properties.
pub trait Runner: Send + Sync {
    /// Short name (`cpu`, `cuda`, a worker's handshake name).
    fn name(&self) -> &str;
    /// What it computes.
    fn caps(&self) -> &Caps;
    /// Device and build of the outputs, written into capsules.
    fn provenance(&self) -> BTreeMap<String, String>;
    /// The dispatcher whose decisions the implementation follows, where the harness can
    /// predict them (in-tree backends); `None` skips `eligibility`.
    fn dispatcher(&self, opts: &RunOptions) -> Option<Dispatcher>;
    /// The `emulation_conformance` rate budget of `tensor`, where it is judged.
    fn rounding_budget(&self, tensor: &str) -> Option<f64>;
    /// Which fallback forward kernel a launch takes, where there are several (the backward
    /// picks its kernels by the same rule, so the name tells both).
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String>;
    /// Forward, then backward from that forward when the case has `d_o`.
    ///
    /// # Errors
    /// What the implementation refuses ([`Error::Unsupported`], [`Error::Workspace`]) or
    /// fails at; [`Error::Fault`] when a worker crashed or hung.
    fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair>;
    /// The backward alone, from a given forward's `o` and `lse` (the mixed-path check: a
    /// fallback backward from the small-seq forward). Only runners with `harness_options`.
    ///
    /// # Errors
    /// As [`Runner::run_pair`].
    fn run_bwd_from(
        &self,
        case: &Case,
        o: &Array3<f32>,
        lse: &Array2<f32>,
        opts: &RunOptions,
    ) -> Result<BwdResult>;
    /// The command that serves this runner in a worker process, for capsules and repro
    /// lines; `None` in-process.
    fn worker_command(&self) -> Option<Vec<String>> {
        None
    }
    /// Whether the implementation is not one of ours (`--backend exec`): it may decline a
    /// case its capabilities admit, which is a skip, not a failure.
    fn external(&self) -> bool {
        false
    }
    /// Per answered worker request so far, its round trip minus the worker's own
    /// `elapsed_us`, in microseconds: the protocol's overhead. Empty in-process.
    fn protocol_overhead_us(&self) -> Vec<f64> {
        Vec::new()
    }
}

/// A backend called in this process.
pub struct InProcess<'a> {
    backend: &'a dyn Backend,
    caps: Caps,
}

impl<'a> InProcess<'a> {
    pub fn new(backend: &'a dyn Backend) -> Self {
        let caps = Caps::in_tree(
            backend.arch().name(),
            backend.has_small_seq(),
            1,
            (backend.computes_dropout(), backend.computes_bias()),
        )
        .with_design(backend.design());
        InProcess { backend, caps }
    }

    pub fn backend(&self) -> &'a dyn Backend {
        self.backend
    }

    /// This backend declaring `caps` instead of the in-tree ones: what a worker's handshake
    /// would say (`caps.nondeterministic`, `caps.no_key_row`), for tests of how the
    /// properties read a declaration without a worker process.
    pub fn with_caps(self, caps: Caps) -> Self {
        InProcess { caps, ..self }
    }
}

impl Runner for InProcess<'_> {
    fn name(&self) -> &str {
        self.backend.name()
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn provenance(&self) -> BTreeMap<String, String> {
        self.backend.provenance()
    }
    fn dispatcher(&self, opts: &RunOptions) -> Option<Dispatcher> {
        Some(wrapper::dispatcher(self.backend, opts))
    }
    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        self.backend.rounding_budget(tensor)
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        self.backend.fallback_fwd_kernel(config, layout)
    }
    fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
        run_pair(self.backend, case, opts)
    }
    fn run_bwd_from(
        &self,
        case: &Case,
        o: &Array3<f32>,
        lse: &Array2<f32>,
        opts: &RunOptions,
    ) -> Result<BwdResult> {
        wrapper::bwd(self.backend, case, o, lse, opts)
    }
}

/// A borrowed runner is a runner: a checker can run a case through one it does not own.
impl<R: Runner + ?Sized> Runner for &R {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn caps(&self) -> &Caps {
        (**self).caps()
    }
    fn provenance(&self) -> BTreeMap<String, String> {
        (**self).provenance()
    }
    fn dispatcher(&self, opts: &RunOptions) -> Option<Dispatcher> {
        (**self).dispatcher(opts)
    }
    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        (**self).rounding_budget(tensor)
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        (**self).fallback_fwd_kernel(config, layout)
    }
    fn worker_command(&self) -> Option<Vec<String>> {
        (**self).worker_command()
    }
    fn external(&self) -> bool {
        (**self).external()
    }
    fn protocol_overhead_us(&self) -> Vec<f64> {
        (**self).protocol_overhead_us()
    }
    fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
        (**self).run_pair(case, opts)
    }
    fn run_bwd_from(
        &self,
        case: &Case,
        o: &Array3<f32>,
        lse: &Array2<f32>,
        opts: &RunOptions,
    ) -> Result<BwdResult> {
        (**self).run_bwd_from(case, o, lse, opts)
    }
}

/// The policy of an in-tree backend served by a worker: what the campaign process knows
/// without opening the device (its budgets by name, the launch rules of `backend::launch`).
pub fn in_tree_fallback_kernel(name: &str, config: &AttnConfig, layout: &Layout) -> Option<String> {
    let gpu = crate::backend::launch::Gpu::named(name)?;
    Some(crate::backend::launch::dims_of(config, layout, false).fallback_fwd_kernel(gpu))
}

/// The rounding budget of a runner named `name` that declares (or not) the small-seq
/// roundings: only in-tree names have calibrated budgets.
pub fn budget_by_name(name: &str, follows: bool, tensor: &str) -> Option<f64> {
    if follows {
        rounding_budget_of(name, tensor)
    } else {
        None
    }
}

/// One case's view of a runner: the first fault ends the case. The properties map a run's
/// error into their own verdicts; a worker that crashed or hung must instead end the whole
/// case with that verdict, whichever property's run met it, so the fault is kept here and
/// every later run of the case returns it at once (no second timeout, no second crash).
pub struct FaultLatch<'a> {
    inner: &'a dyn Runner,
    fault: Mutex<Option<Fault>>,
}

impl<'a> FaultLatch<'a> {
    pub fn new(inner: &'a dyn Runner) -> Self {
        FaultLatch {
            inner,
            fault: Mutex::new(None),
        }
    }

    fn latched<T>(&self, run: impl FnOnce() -> Result<T>) -> Result<T> {
        if let Some(f) = self
            .fault
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(Error::Fault(f.clone()));
        }
        let r = crate::stages::timed(crate::stages::Stage::Backend, run);
        if let Err(Error::Fault(f)) = &r {
            *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(f.clone());
        }
        r
    }

    /// The fault that ended the case, if any.
    pub fn take(&self) -> Option<Fault> {
        self.fault.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Runner for FaultLatch<'_> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn caps(&self) -> &Caps {
        self.inner.caps()
    }
    fn provenance(&self) -> BTreeMap<String, String> {
        self.inner.provenance()
    }
    fn dispatcher(&self, opts: &RunOptions) -> Option<Dispatcher> {
        self.inner.dispatcher(opts)
    }
    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        self.inner.rounding_budget(tensor)
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        self.inner.fallback_fwd_kernel(config, layout)
    }
    fn worker_command(&self) -> Option<Vec<String>> {
        self.inner.worker_command()
    }
    fn external(&self) -> bool {
        self.inner.external()
    }
    fn protocol_overhead_us(&self) -> Vec<f64> {
        self.inner.protocol_overhead_us()
    }
    fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
        self.latched(|| self.inner.run_pair(case, opts))
    }
    fn run_bwd_from(
        &self,
        case: &Case,
        o: &Array3<f32>,
        lse: &Array2<f32>,
        opts: &RunOptions,
    ) -> Result<BwdResult> {
        self.latched(|| self.inner.run_bwd_from(case, o, lse, opts))
    }
}
