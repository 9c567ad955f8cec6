//! A GPU backend in the campaign's own process, one lane per concurrent case
//! (`smallseq fuzz --in-process`, bench/NOTES.md v21).
//!
//! For cases of at most 17 tokens a worker's round trip (case files, a request, an upload, a
//! download, a reply) costs far more host time than the kernels take; in this process a run is
//! an upload, the launches and a download. One backend is opened per lane, each with its own
//! stream (CUDA) so that one case's synchronise does not wait for another's launches; a call
//! takes a free lane for its duration.
//!
//! What is given up is the isolation: a device fault here poisons the context every lane
//! shares. The first device error therefore becomes a `crash` verdict of the case that met it
//! and the campaign is stopped (the flag of [`BackendInfo::stop_on_loss`]); every later call
//! is refused with the same words. Which of the cases in flight caused it is not known here,
//! so the capsule's `smallseq repro` reruns it in a worker, where it is isolated.

use super::{Backend, BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use crate::config::AttnConfig;
use crate::design::Design;
use crate::dispatch::gate::GateDefects;
use crate::dispatch::Arch;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::mutants::Defects;
use smallseq_reference::Layout;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

/// Several backends of one device used as one, a call at a time per lane.
pub struct Lanes {
    lanes: Vec<Box<dyn Backend>>,
    free: Mutex<Vec<usize>>,
    freed: Condvar,
    /// What lost the device, once something has.
    lost: Mutex<Option<String>>,
    stop: Mutex<Option<Arc<AtomicBool>>>,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("backend", &self.lanes[0].name())
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Lanes {
    /// `lanes` (at least one) as one backend; the first answers for all of them (name, arch,
    /// budgets, provenance), so they must be the same backend on the same device.
    ///
    /// # Errors
    /// [`Error::Config`] for no lane, or lanes of different backends or devices.
    pub fn new(lanes: Vec<Box<dyn Backend>>) -> Result<Self> {
        let Some(first) = lanes.first() else {
            return Err(Error::config("a backend of lanes needs at least one lane"));
        };
        // The design too: lanes judged as one backend must round where one backend does.
        let who = |b: &dyn Backend| (b.name().to_string(), b.arch(), b.provenance(), b.design());
        let one = who(first.as_ref());
        if let Some(other) = lanes.iter().find(|b| who(b.as_ref()) != one) {
            return Err(Error::config(format!(
                "lanes of one backend must be alike: {} on {} (design {}) beside {} on {} \
                 (design {})",
                one.0,
                one.1.name(),
                one.3.name(),
                other.name(),
                other.arch().name(),
                other.design().name()
            )));
        }
        Ok(Lanes {
            free: Mutex::new((0..lanes.len()).rev().collect()),
            lanes,
            freed: Condvar::new(),
            lost: Mutex::new(None),
            stop: Mutex::new(None),
        })
    }

    /// How many calls may run at once.
    pub fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Always false: a backend of lanes has at least one.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    fn refusal(why: &str) -> Error {
        Error::Fault(Fault {
            kind: FaultKind::Crash,
            detail: why.to_string(),
            stderr: String::new(),
            timeout_s: None,
        })
    }

    /// Runs `f` on a free lane (waiting for one). A device error becomes a crash and stops
    /// the campaign; after it, every call is refused.
    fn on_lane<T>(&self, f: impl FnOnce(&dyn Backend) -> Result<T>) -> Result<T> {
        if let Some(why) = locked(&self.lost).as_ref() {
            return Err(Self::refusal(why));
        }
        let lane = {
            let mut free = locked(&self.free);
            loop {
                if let Some(i) = free.pop() {
                    break i;
                }
                free = self
                    .freed
                    .wait(free)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let r = f(self.lanes[lane].as_ref());
        locked(&self.free).push(lane);
        self.freed.notify_one();
        match r {
            Err(e @ Error::Device { .. }) => {
                let why = {
                    let mut lost = locked(&self.lost);
                    lost.get_or_insert_with(|| {
                        format!(
                            "device error in the campaign's process (--in-process: no \
                             isolation, so the campaign stops here; `smallseq repro` reruns the \
                             capsule in a worker): {e}"
                        )
                    })
                    .clone()
                };
                if let Some(stop) = locked(&self.stop).as_ref() {
                    stop.store(true, Ordering::SeqCst);
                }
                Err(Self::refusal(&why))
            }
            r => r,
        }
    }
}

impl BackendInfo for Lanes {
    fn name(&self) -> &str {
        self.lanes[0].name()
    }
    fn arch(&self) -> Arch {
        self.lanes[0].arch()
    }
    fn has_small_seq(&self) -> bool {
        self.lanes[0].has_small_seq()
    }
    fn computes_dropout(&self) -> bool {
        self.lanes[0].computes_dropout()
    }
    fn computes_bias(&self) -> bool {
        self.lanes[0].computes_bias()
    }
    fn provenance(&self) -> BTreeMap<String, String> {
        self.lanes[0].provenance()
    }
    fn concurrent_cases(&self) -> bool {
        true
    }
    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        self.lanes[0].rounding_budget(tensor)
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        self.lanes[0].fallback_fwd_kernel(config, layout)
    }
    fn design(&self) -> Design {
        self.lanes[0].design()
    }
    fn lost(&self) -> Option<String> {
        locked(&self.lost).clone()
    }
    fn stop_on_loss(&self, stop: Arc<AtomicBool>) {
        *locked(&self.stop) = Some(stop);
    }
}

impl Compute for Lanes {
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.on_lane(|b| b.small_seq_fwd(args, out))
    }
    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        self.on_lane(|b| b.fallback_fwd(args, out))
    }
    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.on_lane(|b| b.small_seq_bwd(args, out))
    }
    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        self.on_lane(|b| b.fallback_bwd(args, out))
    }
}

impl MutationHooks for Lanes {
    fn gate_defects(&self) -> GateDefects {
        self.lanes[0].gate_defects()
    }
    fn zeroes_dont_care(&self) -> bool {
        self.lanes[0].zeroes_dont_care()
    }
    fn segment_defects(&self) -> Defects {
        self.lanes[0].segment_defects()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use std::sync::atomic::AtomicUsize;

    /// The CPU backend, failing with a device error on the call numbered `fail_at`, and
    /// counting how many of its calls overlap.
    struct Flaky {
        inner: CpuBackend,
        calls: Arc<AtomicUsize>,
        inside: Arc<AtomicUsize>,
        most_inside: Arc<AtomicUsize>,
        fail_at: Option<usize>,
    }

    impl BackendInfo for Flaky {
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn arch(&self) -> Arch {
            self.inner.arch()
        }
        fn has_small_seq(&self) -> bool {
            self.inner.has_small_seq()
        }
    }
    impl MutationHooks for Flaky {}
    impl Flaky {
        fn call(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_inside.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(2));
            let r = if Some(n) == self.fail_at {
                Err(Error::Device {
                    backend: "cpu".into(),
                    detail: "an illegal memory access was encountered".into(),
                })
            } else {
                f()
            };
            self.inside.fetch_sub(1, Ordering::SeqCst);
            r
        }
    }
    impl Compute for Flaky {
        fn small_seq_fwd(&self, a: &FwdArgs, o: &mut FwdBufs) -> Result<()> {
            self.call(|| self.inner.small_seq_fwd(a, o))
        }
        fn fallback_fwd(&self, a: &FwdArgs, o: &mut FwdBufs) -> Result<()> {
            self.call(|| self.inner.fallback_fwd(a, o))
        }
        fn small_seq_bwd(&self, a: &BwdArgs, o: &mut BwdBufs) -> Result<()> {
            self.call(|| self.inner.small_seq_bwd(a, o))
        }
        fn fallback_bwd(&self, a: &BwdArgs, o: &mut BwdBufs) -> Result<()> {
            self.call(|| self.inner.fallback_bwd(a, o))
        }
    }

    fn lanes(n: usize, fail_at: Option<usize>) -> (Lanes, Arc<AtomicUsize>) {
        let (calls, inside, most) = Default::default();
        let most: Arc<AtomicUsize> = most;
        let members = (0..n)
            .map(|_| {
                Box::new(Flaky {
                    inner: CpuBackend::default(),
                    calls: Arc::clone(&calls),
                    inside: Arc::clone(&inside),
                    most_inside: Arc::clone(&most),
                    fail_at,
                }) as Box<dyn Backend>
            })
            .collect();
        (Lanes::new(members).unwrap(), most)
    }

    fn case() -> crate::case::Case {
        crate::case::samples::one_query_two_keys(0.5, [1.0, -2.0], [0.25, 3.0], 1.5)
    }

    #[test]
    fn calls_overlap_up_to_the_lanes_and_no_further() {
        let (be, most) = lanes(3, None);
        let case = case();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..4 {
                        crate::runner::run_pair(&be, &case, &Default::default()).unwrap();
                    }
                });
            }
        });
        let most = most.load(Ordering::SeqCst);
        assert!((2..=3).contains(&most), "{most} calls at once on 3 lanes");
    }

    #[test]
    fn a_device_error_is_a_crash_that_stops_the_campaign_and_refuses_what_follows() {
        let (be, _) = lanes(2, Some(1));
        let stop = Arc::new(AtomicBool::new(false));
        be.stop_on_loss(Arc::clone(&stop));
        let case = case();
        let Err(Error::Fault(f)) = crate::runner::run_pair(&be, &case, &Default::default()) else {
            panic!("the device error is not a fault")
        };
        assert_eq!(f.kind, FaultKind::Crash);
        assert!(f.detail.contains("illegal memory access"), "{}", f.detail);
        assert!(stop.load(Ordering::SeqCst), "the campaign is told to stop");
        assert!(be.lost().is_some());
        let again = crate::runner::run_pair(&be, &case, &Default::default());
        assert!(
            matches!(again, Err(Error::Fault(_))),
            "a later call is refused"
        );
    }

    #[test]
    fn lanes_of_different_backends_are_refused() {
        let mixed: Vec<Box<dyn Backend>> = vec![
            Box::new(CpuBackend::default()),
            Box::new(CpuBackend::te625_model()),
        ];
        let e = Lanes::new(mixed).unwrap_err().to_string();
        assert!(e.contains("cpu") && e.contains("te625-model"), "{e}");
        assert!(Lanes::new(Vec::new()).is_err());
    }

    /// The campaign judges lanes under their design (D from the stored O here), so lanes of
    /// two designs are refused as lanes of two backends are.
    #[test]
    fn lanes_declare_their_backends_design_and_refuse_two() {
        let alike: Vec<Box<dyn Backend>> = (0..2)
            .map(|_| Box::new(CpuBackend::default().with_d_from_o()) as Box<dyn Backend>)
            .collect();
        assert_eq!(Lanes::new(alike).unwrap().design(), Design::ProjectDFromO);
        let mixed: Vec<Box<dyn Backend>> = vec![
            Box::new(CpuBackend::default()),
            Box::new(CpuBackend::default().with_d_from_o()),
        ];
        assert!(Lanes::new(mixed).is_err());
    }
}
