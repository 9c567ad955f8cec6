//! A stand-in for a device backend's quirks in the properties' tests: the CPU backend with
//! its fallback launches' outputs edited afterwards, and optionally naming fallback forward
//! kernels, as CUDA and HIP do.

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BwdArgs, BwdBufs, FwdArgs, FwdBufs};
use crate::config::AttnConfig;
use crate::dispatch::Arch;
use crate::error::Result;
use smallseq_reference::Layout;

type FwdHook = Box<dyn Fn(&FwdArgs, &mut FwdBufs) + Send + Sync>;
type BwdHook = Box<dyn Fn(&BwdArgs, &mut BwdBufs) + Send + Sync>;

/// The CPU backend, its fallback launches' outputs passed through `after_fwd`/`after_bwd`.
pub(super) struct HookedCpu {
    pub cpu: CpuBackend,
    pub kernel_name: Option<fn(&Layout) -> String>,
    pub after_fwd: FwdHook,
    pub after_bwd: BwdHook,
}

impl HookedCpu {
    pub fn new() -> Self {
        HookedCpu {
            cpu: CpuBackend::default(),
            kernel_name: None,
            after_fwd: Box::new(|_, _| {}),
            after_bwd: Box::new(|_, _| {}),
        }
    }
}

impl Backend for HookedCpu {
    fn name(&self) -> &str {
        "hooked-cpu"
    }
    fn arch(&self) -> Arch {
        self.cpu.arch()
    }
    fn has_small_seq(&self) -> bool {
        true
    }
    fn fallback_fwd_kernel(&self, _: &AttnConfig, layout: &Layout) -> Option<String> {
        self.kernel_name.map(|f| f(layout))
    }
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.cpu.small_seq_fwd(args, out)
    }
    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.cpu.fallback_fwd(args, out)?;
        (self.after_fwd)(args, out);
        Ok(())
    }
    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.cpu.small_seq_bwd(args, out)
    }
    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.cpu.fallback_bwd(args, out)?;
        (self.after_bwd)(args, out);
        Ok(())
    }
}
