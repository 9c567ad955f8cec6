//! Worker processes behind the [`Runner`] the properties call: one worker per job, spread
//! over devices; a worker that faults is replaced before its slot is used again.

use super::client::{Spawn, Worker};
use super::io::{read_outputs_file, write_outputs};
use super::protocol::{from_wire, path_of, run_request, Handshake, Reply, Request};
use crate::case::Case;
use crate::case_file::input_bytes;
use crate::case_file::Outputs32;
use crate::config::AttnConfig;
use crate::dispatch::gate::{Dispatcher, GateDefects};
use crate::error::{Error, Result};
use crate::runner::{budget_by_name, in_tree_fallback_kernel, Caps, Fault, Pair, Runner};
use crate::wrapper::{BwdResult, FwdResult, RunOptions, WorkspaceReport};
use ndarray::{Array2, Array3};
use smallseq_reference::Layout;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How a pool starts its workers.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// The command of a worker on device `d`.
    pub spawn: SpawnFor,
    /// Workers (= cases at once).
    pub jobs: usize,
    /// Devices to spread them over; `None`: every device the first worker reports.
    pub devices: Option<Vec<usize>>,
    /// A fixed case timeout; `None`: [`default_case_timeout`].
    pub case_timeout: Option<Duration>,
    /// How long a worker may take to say hello (a cold GPU worker compiles its kernels).
    pub start_timeout: Duration,
    /// The in-tree backend the workers serve (`cpu`, `cuda`, `hip`), whose launch rules the
    /// campaign knows; `None` for an external implementation.
    pub in_tree: Option<String>,
    /// Whether the runs of a case that share its inputs (the base run, the rerun, the
    /// flipped environment, the fallback, the mixed-path backward) name one case file,
    /// written once, instead of a fresh file each (`docs/worker-protocol.md`, "Case files").
    /// On by default; off only to compare the two (`tests/workers.rs`).
    pub reuse_inputs: bool,
}

/// A worker command, by device.
#[derive(Clone, Debug)]
pub enum SpawnFor {
    /// `smallseq worker --backend B --device D --profile P` from this executable.
    InTree {
        exe: String,
        backend: String,
        profile: String,
        env: Vec<(String, String)>,
    },
    /// A user's command; the device goes into `CUDA_VISIBLE_DEVICES`,
    /// `HIP_VISIBLE_DEVICES` and `SMALLSEQ_DEVICE`.
    Exec {
        argv: Vec<String>,
        env: Vec<(String, String)>,
    },
}

impl SpawnFor {
    pub fn on(&self, device: usize) -> Spawn {
        match self {
            SpawnFor::InTree {
                exe,
                backend,
                profile,
                env,
            } => Spawn {
                argv: [
                    exe.as_str(),
                    "worker",
                    "--backend",
                    backend,
                    "--device",
                    &device.to_string(),
                    "--profile",
                    profile,
                ]
                .map(String::from)
                .to_vec(),
                env: env.clone(),
            },
            SpawnFor::Exec { argv, env } => {
                let mut env = env.clone();
                for var in ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"] {
                    let inherited = std::env::var(var).ok();
                    env.push((var.into(), visible_device(inherited.as_deref(), device)));
                }
                env.push(("SMALLSEQ_DEVICE".into(), device.to_string()));
                Spawn {
                    argv: argv.clone(),
                    env,
                }
            }
        }
    }
}

/// What a worker on campaign device `device` gets as `CUDA_VISIBLE_DEVICES` or
/// `HIP_VISIBLE_DEVICES`: the campaign numbers the devices it sees, so where the variable
/// already narrows them (`2,3`), device 1 is the list's second entry (`3`), not the host's
/// device 1. Past the list's end (or without one) the ordinal itself.
pub fn visible_device(inherited: Option<&str>, device: usize) -> String {
    inherited
        .map(|list| list.split(',').map(str::trim).filter(|s| !s.is_empty()))
        .and_then(|mut ids| ids.nth(device))
        .map_or_else(|| device.to_string(), String::from)
}

/// The default case timeout: 30 s, plus 1 s per 10^8 multiply-adds of a forward and
/// backward (generous for a CPU worker, far beyond any GPU case; a hang is what it catches).
pub fn default_case_timeout(case: &Case) -> Duration {
    let p = &case.config.params;
    let l = &case.layout;
    let pairs: f64 = (0..l.slots())
        .map(|s| (l.q.len(s) * l.kv.len(s)) as f64)
        .sum();
    let macs = pairs * p.num_heads as f64 * (p.head_dim_qk + p.head_dim_v) as f64 * 3.0;
    Duration::from_secs_f64(30.0 + macs / 1e8)
}

/// The time one call of `case` may take: `--case-timeout` where given, else the default,
/// never below what the worker declares one call may take (`caps.case_timeout_s`).
pub fn case_timeout(fixed: Option<Duration>, caps: &Caps, case: &Case) -> Duration {
    fixed.unwrap_or_else(|| {
        let declared = caps
            .case_timeout_s
            .map_or(Duration::ZERO, Duration::from_secs_f64);
        default_case_timeout(case).max(declared)
    })
}

/// The words [`default_case_timeout`] is printed with.
pub const DEFAULT_TIMEOUT_RULE: &str =
    "30 s + 1 s per 1e8 multiply-adds of the case (--case-timeout to fix it)";

struct Slot {
    device: usize,
    worker: Option<Worker>,
    /// The host thread that used it last: a thread gets its own slot back where it can, so
    /// the worker still holds the case file the thread names again.
    last: Option<ThreadId>,
}

/// Case files a host thread wrote and may name again: the two it used last (a case's base
/// inputs stay while a re-poisoned or derived case runs between two of its runs).
const FILES_PER_THREAD: usize = 2;

/// A case file in the scratch directory and the inputs it holds, compared bit for bit
/// before the file is named again (a NaN payload or `-0.0` is a different input).
struct Written {
    path: PathBuf,
    config: String,
    layout: Layout,
    tensors: Vec<Array3<f32>>,
    /// The bias values' bits (`docs/semantics.md` §1.9): a bias is an input too, and two
    /// runs of one case may differ in it alone (metamorphic's bias relations).
    bias: Vec<u32>,
}

fn bias_bits(case: &Case) -> Vec<u32> {
    match &case.config.params.bias {
        smallseq_reference::AttnBias::PostScale(t) => t.iter().map(|x| x.to_bits()).collect(),
        smallseq_reference::AttnBias::Alibi(s) => s.iter().map(|x| x.to_bits()).collect(),
        smallseq_reference::AttnBias::None => Vec::new(),
    }
}

impl Written {
    fn of(case: &Case, path: PathBuf) -> Written {
        Written {
            path,
            config: case.config.to_json(),
            layout: case.layout.clone(),
            tensors: case.inputs().into_iter().map(|(_, t)| t.clone()).collect(),
            bias: bias_bits(case),
        }
    }

    fn holds(&self, case: &Case) -> bool {
        let inputs = case.inputs();
        self.layout == case.layout
            && self.tensors.len() == inputs.len()
            && self
                .tensors
                .iter()
                .zip(&inputs)
                .all(|(a, (_, b))| same_bits(a, b))
            && self.config == case.config.to_json()
            && self.bias == bias_bits(case)
    }
}

fn same_bits(a: &Array3<f32>, b: &Array3<f32>) -> bool {
    if a.shape() != b.shape() {
        return false;
    }
    let eq = |x: &f32, y: &f32| x.to_bits() == y.to_bits();
    match (a.as_slice(), b.as_slice()) {
        // Compared in blocks without an early exit inside one, which vectorises.
        (Some(x), Some(y)) => x
            .chunks(256)
            .zip(y.chunks(256))
            .all(|(p, q)| p.iter().zip(q).fold(true, |ok, (u, v)| ok & eq(u, v))),
        _ => a.iter().zip(b.iter()).all(|(x, y)| eq(x, y)),
    }
}

/// A pool of workers.
pub struct Pool {
    cfg: PoolConfig,
    slots: Mutex<Vec<Slot>>,
    freed: Condvar,
    handshake: Handshake,
    caps: Caps,
    scratch: PathBuf,
    next_id: AtomicU64,
    command: Vec<String>,
    /// Round trip minus the worker's `elapsed_us` of each answered request, in µs.
    overhead_us: Mutex<Vec<f64>>,
    /// Per host thread, the case files it may name again, most recent last.
    written: Mutex<HashMap<ThreadId, Vec<Written>>>,
    /// Case files written so far.
    files_written: AtomicU64,
}

impl Pool {
    /// Starts the workers: the first alone (it may fill a kernel cache the others then read),
    /// then the rest side by side.
    ///
    /// # Errors
    /// [`Error::WorkerStart`] when a worker does not start or breaks the handshake;
    /// [`Error::Io`] for the scratch directory.
    pub fn open(cfg: PoolConfig) -> Result<Pool> {
        let first_device = cfg
            .devices
            .as_ref()
            .and_then(|d| d.first().copied())
            .unwrap_or(0);
        let first_spawn = cfg.spawn.on(first_device);
        let first = Worker::start(&first_spawn, cfg.start_timeout)?;
        let handshake = first.handshake.clone();
        let caps = Caps::from_wire(&handshake.caps).map_err(|e| Error::WorkerStart {
            command: first_spawn.display(),
            detail: e.to_string(),
        })?;
        let devices = cfg
            .devices
            .clone()
            .unwrap_or_else(|| (0..caps.devices).collect());
        let placement: Vec<usize> = (0..cfg.jobs.max(1))
            .map(|j| devices[j % devices.len().max(1)])
            .collect();
        let rest: Vec<Result<Worker>> = std::thread::scope(|s| {
            let handles: Vec<_> = placement[1..]
                .iter()
                .map(|&d| {
                    let spawn = cfg.spawn.on(d);
                    let t = cfg.start_timeout;
                    s.spawn(move || Worker::start(&spawn, t))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a worker start does not panic"))
                .collect()
        });
        let mut slots = vec![Slot {
            device: placement[0],
            worker: Some(first),
            last: None,
        }];
        for (w, &d) in rest.into_iter().zip(&placement[1..]) {
            let w = w?;
            if w.handshake.name != handshake.name {
                return Err(Error::WorkerStart {
                    command: w.command().into(),
                    detail: format!(
                        "names itself {:?}, the first worker {:?}",
                        w.handshake.name, handshake.name
                    ),
                });
            }
            slots.push(Slot {
                device: d,
                worker: Some(w),
                last: None,
            });
        }
        let scratch = scratch_dir()?;
        Ok(Pool {
            command: first_spawn.argv.clone(),
            cfg,
            slots: Mutex::new(slots),
            freed: Condvar::new(),
            handshake,
            caps,
            scratch,
            next_id: AtomicU64::new(1),
            overhead_us: Mutex::new(Vec::new()),
            written: Mutex::new(HashMap::new()),
            files_written: AtomicU64::new(0),
        })
    }

    /// The handshake of the first worker.
    pub fn handshake(&self) -> &Handshake {
        &self.handshake
    }

    /// Case files written so far (one per request without [`PoolConfig::reuse_inputs`]).
    pub fn case_files_written(&self) -> u64 {
        self.files_written.load(Ordering::Relaxed)
    }

    /// Devices the workers were placed on, one entry per worker.
    pub fn placement(&self) -> Vec<usize> {
        self.lock().iter().map(|s| s.device).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free slot: the one this thread used last if it is free, else one no other thread
    /// is known to be using, else any.
    fn checkout(&self) -> Slot {
        let me = std::thread::current().id();
        let mut slots = self.lock();
        loop {
            let mine = slots.iter().position(|s| s.last == Some(me));
            let unclaimed = || slots.iter().position(|s| s.last.is_none());
            if let Some(i) = mine.or_else(unclaimed) {
                return slots.swap_remove(i);
            }
            if let Some(s) = slots.pop() {
                return s;
            }
            slots = self.freed.wait(slots).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn checkin(&self, mut slot: Slot) {
        slot.last = Some(std::thread::current().id());
        self.lock().push(slot);
        self.freed.notify_one();
    }

    /// The case file of `case`'s inputs: one this thread wrote for the same inputs, or a new
    /// one. The second value is a file to remove after the request (a file not kept).
    fn case_file(&self, case: &Case) -> Result<(PathBuf, Option<PathBuf>)> {
        let me = std::thread::current().id();
        let mine = match self.cfg.reuse_inputs {
            true => self
                .written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&me),
            false => None,
        };
        let mut mine = mine.unwrap_or_default();
        let hit = mine.iter().position(|w| w.holds(case));
        let (path, fresh) = match hit {
            Some(i) => {
                let w = mine.remove(i);
                let p = w.path.clone();
                mine.push(w);
                (p, None)
            }
            None => {
                // Numbered apart from the requests, whose ids stay 1, 2, 3, ...
                let n = self.files_written.fetch_add(1, Ordering::SeqCst) + 1;
                let path = self.scratch.join(format!("case-{n}.in.safetensors"));
                let bytes = input_bytes(case)?;
                crate::files::write_atomic(&path, &bytes)?;
                if !self.cfg.reuse_inputs {
                    return Ok((path.clone(), Some(path)));
                }
                mine.push(Written::of(case, path.clone()));
                if mine.len() > FILES_PER_THREAD {
                    let _ = std::fs::remove_file(&mine.remove(0).path);
                }
                (path, None)
            }
        };
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(me, mine);
        Ok((path, fresh))
    }

    /// Sends one request on a worker of the pool (restarting the slot's worker if an earlier
    /// fault left it empty) and waits for its reply.
    fn call(&self, case: &Case, mut req: Request, extra: Option<&Path>) -> Result<Reply> {
        let mut slot = self.checkout();
        let result = self.call_on(&mut slot, case, &mut req, extra);
        self.checkin(slot);
        result
    }

    fn call_on(
        &self,
        slot: &mut Slot,
        case: &Case,
        req: &mut Request,
        extra: Option<&Path>,
    ) -> Result<Reply> {
        if slot.worker.is_none() {
            slot.worker = Some(Worker::start(
                &self.cfg.spawn.on(slot.device),
                self.cfg.start_timeout,
            )?);
        }
        let timeout = case_timeout(self.cfg.case_timeout, &self.caps, case);
        let worker = slot.worker.as_mut().expect("started above");
        req.lse_from = extra.map(|p| p.display().to_string());
        let sent = Instant::now();
        let reply = worker.call(req, timeout);
        if let Ok(Reply {
            elapsed_us: Some(us),
            ..
        }) = &reply
        {
            let round_trip = sent.elapsed().as_secs_f64() * 1e6;
            self.overhead_us
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((round_trip - *us as f64).max(0.0));
        }
        let fault = |slot: &mut Slot, f: Fault| {
            slot.worker = None;
            Err(Error::Fault(f))
        };
        match reply {
            Err(f) => fault(slot, f),
            Ok(r) if r.ok => Ok(r),
            Ok(r) => {
                let e = r.error.clone().unwrap_or(super::protocol::WireError {
                    kind: "internal".into(),
                    message: "a failed reply without an error".into(),
                });
                if e.kind == "device" {
                    let w = slot.worker.as_mut().expect("still there");
                    let f = w.crash(format!("device error: {}", e.message));
                    return fault(slot, f);
                }
                Err(from_wire(&self.handshake.name, &e))
            }
        }
    }

    /// A request's id and its output file.
    fn out_file(&self) -> (PathBuf, u64) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        (self.scratch.join(format!("{id}.out.safetensors")), id)
    }

    fn want(&self, case: &Case, fwd: bool) -> Vec<String> {
        let mut w: Vec<&str> = Vec::new();
        if fwd {
            w.push("o");
            if self.caps.lse {
                w.push("lse");
            }
        }
        if case.d_o.is_some() {
            w.extend(["dq", "dk", "dv"]);
        }
        if self.wants_dbias(case) {
            w.push("dbias");
        }
        w.into_iter().map(String::from).collect()
    }

    /// Whether a request for `case` names dBias: the worker declares `caps.dbias`, and the
    /// case has a post-scale bias (ALiBi's slopes take no gradient) and a `d_o`.
    fn wants_dbias(&self, case: &Case) -> bool {
        self.caps.dbias && case.d_o.is_some() && case.config.params.bias.grad_shape().is_some()
    }

    fn path(&self, name: Option<&str>) -> Result<Option<crate::dispatch::Path>> {
        if self.caps.reports_path {
            path_of(name)
        } else {
            Ok(None)
        }
    }

    /// The backward of a reply for `case`: its gradients, path and workspace report. dBias is
    /// read wherever the reply holds it, and must be there when the request named it.
    fn bwd_result(&self, case: &Case, got: Outputs32, reply: &Reply) -> Result<BwdResult> {
        let name = self.name();
        if got.dbias.is_none() && self.wants_dbias(case) {
            return Err(missing(name, "dbias"));
        }
        Ok(BwdResult {
            dq: f32_3(got.dq, name, "dq")?,
            dk: f32_3(got.dk, name, "dk")?,
            dv: f32_3(got.dv, name, "dv")?,
            dbias: got.dbias,
            path: self.path(reply.path.as_ref().and_then(|p| p.bwd.as_deref()))?,
            workspace: self.workspace(reply.workspace.as_ref().map(|w| &w.bwd)),
        })
    }

    fn workspace(&self, w: Option<&WorkspaceReport>) -> WorkspaceReport {
        w.filter(|_| self.caps.reports_workspace)
            .cloned()
            .unwrap_or_default()
    }
}

fn missing(name: &str, t: &str) -> Error {
    Error::Backend {
        backend: name.into(),
        detail: format!("the worker's reply file has no {t}"),
    }
}

fn f32_3(a: Option<Array3<f32>>, name: &str, t: &str) -> Result<Array3<f32>> {
    a.ok_or_else(|| missing(name, t))
}

/// Removes request files whatever happens to the request.
struct Cleanup<'a>(&'a [Option<&'a Path>]);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for p in self.0.iter().flatten() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Runner for Pool {
    fn name(&self) -> &str {
        &self.handshake.name
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn provenance(&self) -> BTreeMap<String, String> {
        let mut p = self.handshake.provenance_text();
        p.insert("worker".into(), self.command.join(" "));
        if !self.handshake.version.is_empty() {
            p.insert("worker_version".into(), self.handshake.version.clone());
        }
        p
    }
    fn dispatcher(&self, opts: &RunOptions) -> Option<Dispatcher> {
        if !self.caps.reports_path {
            return None;
        }
        let arch = self.caps.arch.as_ref()?.parse().ok()?;
        Some(Dispatcher {
            profile: opts.profile,
            arch,
            env: opts.env.clone(),
            backend_has_kernel: self.caps.small_seq,
            defects: GateDefects::default(),
        })
    }
    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        let name = self.cfg.in_tree.as_deref()?;
        budget_by_name(name, self.caps.follows_small_seq_roundings, tensor)
    }
    fn fallback_fwd_kernel(&self, config: &AttnConfig, layout: &Layout) -> Option<String> {
        in_tree_fallback_kernel(self.cfg.in_tree.as_deref()?, config, layout)
    }
    fn worker_command(&self) -> Option<Vec<String>> {
        Some(self.command.clone())
    }
    fn external(&self) -> bool {
        self.cfg.in_tree.is_none()
    }
    fn protocol_overhead_us(&self) -> Vec<f64> {
        self.overhead_us
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
    fn run_pair(&self, case: &Case, opts: &RunOptions) -> Result<Pair> {
        let (inp, fresh) = self.case_file(case)?;
        let (out, id) = self.out_file();
        let _cleanup = Cleanup(&[Some(&out), fresh.as_deref()]);
        let req = run_request(
            id,
            &inp,
            &out,
            self.want(case, true),
            opts,
            self.caps.harness_options,
        );
        let reply = self.call(case, req, None)?;
        let mut got = read_outputs_file(&out, case)?;
        let name = self.name();
        let (tq, h) = (case.layout.q.tokens, case.config.params.num_heads);
        let lse = match got.lse.take() {
            Some(l) => l,
            None if self.caps.lse => return Err(missing(name, "lse")),
            None => Array2::from_elem((tq, h), f32::NAN),
        };
        let paths = reply.path.clone().unwrap_or_default();
        let fwd = FwdResult {
            o: f32_3(got.o.take(), name, "o")?,
            lse,
            path: self.path(paths.fwd.as_deref())?,
            workspace: self.workspace(reply.workspace.as_ref().map(|w| &w.fwd)),
        };
        let bwd = match case.d_o {
            None => None,
            Some(_) => Some(self.bwd_result(case, got, &reply)?),
        };
        Ok(Pair {
            fwd,
            bwd,
            has_lse: self.caps.lse,
        })
    }
    fn run_bwd_from(
        &self,
        case: &Case,
        o: &Array3<f32>,
        lse: &Array2<f32>,
        opts: &RunOptions,
    ) -> Result<BwdResult> {
        if !self.caps.harness_options {
            return Err(Error::Unsupported(
                "the worker cannot run a backward from another forward".into(),
            ));
        }
        let (inp, fresh) = self.case_file(case)?;
        let (out, id) = self.out_file();
        let from = self.scratch.join(format!("{id}.fwd.safetensors"));
        let _cleanup = Cleanup(&[Some(&out), Some(&from), fresh.as_deref()]);
        write_outputs(
            &from,
            &[("o", o.view().into_dyn()), ("lse", lse.view().into_dyn())],
        )?;
        let req = run_request(id, &inp, &out, self.want(case, false), opts, true);
        let reply = self.call(case, req, Some(&from))?;
        self.bwd_result(case, read_outputs_file(&out, case)?, &reply)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut *self.lock());
        std::thread::scope(|s| {
            for w in slots.into_iter().filter_map(|s| s.worker) {
                s.spawn(move || w.shutdown(Duration::from_secs(2)));
            }
        });
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// A fresh scratch directory, in memory where the system has `/dev/shm`.
fn scratch_dir() -> Result<PathBuf> {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = base.join(format!(
        "smallseq-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.display().to_string(),
        source,
    })?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JAX's XLA compiles each new shape: one f32 case of seed 71 outran 30 s on a host running
    /// eight campaigns and passed on a fresh worker. Its adapter declares a floor, which the
    /// default never goes under and `--case-timeout` still overrides.
    #[test]
    fn a_declared_case_timeout_is_a_floor_of_the_default_only() {
        use crate::harness::gen::{build, draw_geometry};
        use crate::harness::rng::Rng;
        let case = build(&draw_geometry(&mut Rng::new(3)), 3).expect("generated case");
        let mut caps = Caps::in_tree("sm_90", true, 1, (true, true));
        let default = default_case_timeout(&case);
        assert_eq!(case_timeout(None, &caps, &case), default);
        caps.case_timeout_s = Some(default.as_secs_f64() + 200.0);
        let floor = Duration::from_secs_f64(default.as_secs_f64() + 200.0);
        assert_eq!(case_timeout(None, &caps, &case), floor);
        let fixed = Duration::from_secs(5);
        assert_eq!(case_timeout(Some(fixed), &caps, &case), fixed);
        caps.case_timeout_s = Some(1.0);
        assert_eq!(case_timeout(None, &caps, &case), default);
    }

    #[test]
    fn a_worker_device_is_an_entry_of_the_inherited_visible_list() {
        assert_eq!(visible_device(None, 1), "1");
        assert_eq!(visible_device(Some(""), 1), "1");
        assert_eq!(visible_device(Some("2,3"), 0), "2");
        assert_eq!(visible_device(Some("2, 3"), 1), "3");
        assert_eq!(visible_device(Some("GPU-a1b2,GPU-c3d4"), 1), "GPU-c3d4");
        // Past the list: the ordinal, which the worker's runtime will refuse by name.
        assert_eq!(visible_device(Some("5"), 1), "1");
    }

    #[test]
    fn exec_workers_get_the_device_in_every_variable() {
        let spawn = SpawnFor::Exec {
            argv: vec!["w".into()],
            env: vec![],
        }
        .on(1);
        let get = |k: &str| {
            spawn
                .env
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        let want = |var: &str| visible_device(std::env::var(var).ok().as_deref(), 1);
        assert_eq!(get("SMALLSEQ_DEVICE").as_deref(), Some("1"));
        assert_eq!(
            get("CUDA_VISIBLE_DEVICES"),
            Some(want("CUDA_VISIBLE_DEVICES"))
        );
        assert_eq!(
            get("HIP_VISIBLE_DEVICES"),
            Some(want("HIP_VISIBLE_DEVICES"))
        );
    }
}
