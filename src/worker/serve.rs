//! `smallseq worker`: an in-tree backend served over `smallseq-worker/1`.
//!
//! The worker runs the wrappers (dispatch, workspace, don't-care zeroing) and the kernels; the
//! campaign keeps the judging. A panic or abort ends the process, which the campaign sees as a
//! crash of the case in flight: nothing here catches it.

use super::io::{read_outputs_file, write_outputs};
use super::protocol::{
    options_of, wire_error, Handshake, Paths, Reply, Request, WireError, Workspaces, PROTOCOL,
};
use crate::backend::Backend;
use crate::case::Case;
use crate::case_file::read_case;
use crate::dispatch::Profile;
use crate::error::{Error, Result};
use crate::runner::{run_pair, Caps};
use crate::wrapper::{self, RunOptions};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A planted worker fault (`SMALLSEQ_MUTANT_FAULT`): what the CPU worker does on a case that
/// triggers it, standing in for a kernel that faults or never returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedFault {
    /// `panic!`: the process exits with status 101.
    Panic,
    /// `abort()`: killed by SIGABRT.
    Abort,
    /// Sleeps forever: the campaign's case timeout must fire.
    Hang,
    /// `panic!` on the first attempt at a case only: the rerun on a fresh worker completes,
    /// so the campaign calls the fault flaky. See [`PlantedFault::first_attempt`].
    PanicOnce,
    /// `panic!` on every case: a device whose every launch faults (`ci/fault-on-device.sh`
    /// plants it on one device, where a fault on some cases only would depend on which cases
    /// the scheduler happens to send there).
    PanicAlways,
}

/// The variable that plants a fault in a CPU worker.
pub const FAULT_VAR: &str = "SMALLSEQ_MUTANT_FAULT";

impl PlantedFault {
    /// The fault named by [`FAULT_VAR`], if any.
    ///
    /// # Errors
    /// [`Error::Config`] for a value other than `panic`, `abort`, `hang`, `panic-once`.
    pub fn from_env() -> Result<Option<PlantedFault>> {
        match std::env::var(FAULT_VAR).ok().as_deref() {
            None | Some("") => Ok(None),
            Some("panic") => Ok(Some(PlantedFault::Panic)),
            Some("abort") => Ok(Some(PlantedFault::Abort)),
            Some("hang") => Ok(Some(PlantedFault::Hang)),
            Some("panic-once") => Ok(Some(PlantedFault::PanicOnce)),
            Some("panic-always") => Ok(Some(PlantedFault::PanicAlways)),
            Some(other) => Err(Error::config(format!(
                "{FAULT_VAR}={other}: expected panic, abort, hang, panic-once or panic-always"
            ))),
        }
    }

    /// The value of [`FAULT_VAR`] that plants it (what the handshake's provenance records,
    /// and `smallseq repro` sets again).
    pub fn name(self) -> &'static str {
        match self {
            PlantedFault::Panic => "panic",
            PlantedFault::Abort => "abort",
            PlantedFault::Hang => "hang",
            PlantedFault::PanicOnce => "panic-once",
            PlantedFault::PanicAlways => "panic-always",
        }
    }

    /// Cases that trigger a planted fault: a query sequence of exactly 7 tokens (the kernel
    /// mutants `SMALLSEQ_MUTANT_OOB_WRITE`, `_TRAP` and `_HANG` fire on the same cases);
    /// every case for [`PlantedFault::PanicAlways`].
    pub fn triggers(self, case: &Case) -> bool {
        self == PlantedFault::PanicAlways
            || (0..case.layout.slots()).any(|s| case.layout.q.len(s) == 7)
    }

    /// Whether a triggering `case`, read from `case_file`, is the first attempt at its case;
    /// for [`PlantedFault::PanicOnce`] it is marked attempted here, before the fault fires.
    ///
    /// The campaign reruns a faulted case on a fresh worker process, so "first" cannot be a
    /// count in this process (it would fire again there and the fault would be deterministic);
    /// it is a marker file beside the case file, in the campaign's scratch directory, which
    /// every worker of the campaign shares and the campaign removes at its end (so each
    /// campaign, and each `smallseq repro`, starts with the fault armed). A case is its
    /// 7-token query slots: the rerun also sends the runs derived from the case (re-poisoned
    /// padding, slots reversed or split, K and V repeated, V scaled), whose files and
    /// geometry differ but which carry the query rows of at least one of those slots
    /// unchanged; a marker per slot, by the bits of its query rows, covers them all.
    ///
    /// # Errors
    /// [`Error::Io`] when a marker cannot be written (the fault would otherwise recur and
    /// pass for a deterministic one).
    fn first_attempt(self, case: &Case, case_file: &Path) -> Result<bool> {
        if self != PlantedFault::PanicOnce {
            return Ok(true);
        }
        let dir = case_file.parent().unwrap_or(Path::new("."));
        let q = &case.layout.q;
        let markers: Vec<PathBuf> = (0..q.slots())
            .filter(|&s| q.len(s) == 7)
            .map(|s| {
                use std::hash::{Hash, Hasher};
                let mut h = std::hash::DefaultHasher::new();
                // Rows past the buffer are not there to hash: the case file was validated.
                for row in case.q.outer_iter().skip(q.offset(s)).take(7) {
                    row.iter().for_each(|x| x.to_bits().hash(&mut h));
                }
                dir.join(format!("panic-once-{:016x}.attempted", h.finish()))
            })
            .collect();
        if markers.iter().any(|m| m.exists()) {
            return Ok(false);
        }
        for m in &markers {
            std::fs::write(m, b"").map_err(|source| Error::Io {
                path: m.display().to_string(),
                source,
            })?;
        }
        Ok(true)
    }

    fn fire(self) -> ! {
        match self {
            PlantedFault::Panic => panic!("planted fault: {FAULT_VAR}=panic on a 7-token query"),
            PlantedFault::PanicOnce => panic!(
                "planted fault: {FAULT_VAR}=panic-once on the first attempt at a 7-token query"
            ),
            PlantedFault::PanicAlways => panic!("planted fault: {FAULT_VAR}=panic-always"),
            PlantedFault::Abort => std::process::abort(),
            PlantedFault::Hang => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
        }
    }
}

/// Serves `be` until `shutdown` or the end of `input`. Returns the exit status.
///
/// # Errors
/// I/O errors on `output`; a malformed request line (after saying so on stderr).
pub fn serve(
    be: &dyn Backend,
    profile: Profile,
    devices: usize,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<i32> {
    let planted = PlantedFault::from_env()?;
    let mut provenance: BTreeMap<String, serde_json::Value> = be
        .provenance()
        .into_iter()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .collect();
    if let Some(f) = planted {
        provenance.insert(
            "planted_fault".into(),
            serde_json::Value::String(f.name().into()),
        );
    }
    let hs = Handshake {
        protocol: PROTOCOL.into(),
        name: be.name().into(),
        version: format!(
            "smallseq {} ({})",
            env!("CARGO_PKG_VERSION"),
            crate::build_commit().unwrap_or("unknown commit")
        ),
        provenance,
        caps: Caps::in_tree(
            be.arch().name(),
            be.has_small_seq(),
            devices,
            (be.computes_dropout(), be.computes_bias()),
        )
        .with_design(be.design())
        .to_wire(),
    };
    send(&mut output, &hs)?;
    let base = RunOptions {
        profile,
        ..RunOptions::default()
    };
    let device_errors = matches!(be.name(), "cuda" | "hip");
    let mut cases = CaseCache::default();
    for line in input.lines() {
        let line = line.map_err(|source| Error::Io {
            path: "<stdin>".into(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let req: Request = serde_json::from_str(&line).map_err(|e| {
            Error::config(format!(
                "worker: a request line is not JSON of the protocol: {e}"
            ))
        })?;
        match req.op.as_str() {
            "shutdown" => return Ok(0),
            "run" => {}
            other => {
                let reply = error_reply(req.id, "internal", format!("unknown op {other:?}"));
                send(&mut output, &reply)?;
                continue;
            }
        }
        let start = Instant::now();
        let reply = match handle(be, &req, &base, planted, &mut cases) {
            Ok((paths, workspace)) => Reply {
                id: req.id,
                ok: true,
                path: Some(paths),
                elapsed_us: Some(start.elapsed().as_micros() as u64),
                workspace: Some(workspace),
                error: None,
            },
            Err(e) => {
                let mut w = wire_error(&e);
                // A GPU backend's runtime errors (a launch, a sync) leave its context unusable.
                if device_errors && w.kind == "internal" {
                    w.kind = "device".into();
                }
                Reply {
                    id: req.id,
                    ok: false,
                    error: Some(w),
                    ..Reply::default()
                }
            }
        };
        send(&mut output, &reply)?;
    }
    Ok(0)
}

fn error_reply(id: u64, kind: &str, message: String) -> Reply {
    Reply {
        id,
        ok: false,
        error: Some(WireError {
            kind: kind.into(),
            message,
        }),
        ..Reply::default()
    }
}

fn send(out: &mut impl Write, msg: &impl serde::Serialize) -> Result<()> {
    let io = |source| Error::Io {
        path: "<stdout>".into(),
        source,
    };
    let line = serde_json::to_string(msg).expect("protocol messages serialise");
    writeln!(out, "{line}").map_err(io)?;
    out.flush().map_err(io)
}

/// Case files read lately, by name: the campaign names one file in every run that shares
/// its inputs (`docs/worker-protocol.md`, "Case files"), and reading, decoding and validating
/// it again was most of this worker's time per run. A file is taken from here only while its
/// size, modification time and inode are those it was read with.
#[derive(Default)]
struct CaseCache {
    /// Most recent last.
    entries: Vec<(FileKey, Case)>,
}

/// The case files kept: a case's base inputs survive a re-poisoned or derived case between
/// two of its runs.
const CASES_KEPT: usize = 2;

#[derive(Clone, PartialEq, Eq)]
struct FileKey {
    path: String,
    len: u64,
    modified: Option<std::time::SystemTime>,
    dev: u64,
    ino: u64,
}

impl CaseCache {
    fn get(&mut self, path: &str) -> Result<&Case> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?;
        let key = FileKey {
            path: path.into(),
            len: meta.len(),
            modified: meta.modified().ok(),
            dev: meta.dev(),
            ino: meta.ino(),
        };
        match self.entries.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let e = self.entries.remove(i);
                self.entries.push(e);
            }
            None => {
                let case = read_case(Path::new(path))?;
                self.entries.retain(|(k, _)| k.path != key.path);
                if self.entries.len() >= CASES_KEPT {
                    self.entries.remove(0);
                }
                self.entries.push((key, case));
            }
        }
        Ok(&self.entries.last().expect("pushed above").1)
    }
}

fn handle(
    be: &dyn Backend,
    req: &Request,
    base: &RunOptions,
    planted: Option<PlantedFault>,
    cases: &mut CaseCache,
) -> Result<(Paths, Workspaces)> {
    let (Some(case_path), Some(out)) = (&req.case, &req.out) else {
        return Err(Error::config("a run request needs case and out"));
    };
    let case = cases.get(case_path)?;
    let opts = options_of(req, base)?;
    if let Some(f) = planted.filter(|f| f.triggers(case)) {
        if f.first_attempt(case, Path::new(case_path))? {
            f.fire();
        }
    }
    let out = Path::new(out);
    if let Some(from) = &req.lse_from {
        let fwd = read_outputs_file(Path::new(from), case)?;
        let (Some(o), Some(lse)) = (fwd.o, fwd.lse) else {
            return Err(Error::config(format!("lse_from {from}: needs o and lse")));
        };
        let b = wrapper::bwd(be, case, &o, &lse, &opts)?;
        write_outputs(out, &gradients(&b))?;
        let paths = Paths {
            fwd: None,
            bwd: Some(path_name(b.path)),
        };
        let ws = Workspaces {
            bwd: b.workspace,
            ..Workspaces::default()
        };
        return Ok((paths, ws));
    }
    let p = run_pair(be, case, &opts)?;
    let mut tensors = vec![
        ("o", p.fwd.o.view().into_dyn()),
        ("lse", p.fwd.lse.view().into_dyn()),
    ];
    if let Some(b) = &p.bwd {
        tensors.extend(gradients(b));
    }
    write_outputs(out, &tensors)?;
    let paths = Paths {
        fwd: Some(path_name(p.fwd.path)),
        bwd: p.bwd.as_ref().map(|b| path_name(b.path)),
    };
    let ws = Workspaces {
        fwd: p.fwd.workspace.clone(),
        bwd: p.bwd.map(|b| b.workspace).unwrap_or_default(),
    };
    Ok((paths, ws))
}

fn path_name(p: Option<crate::dispatch::Path>) -> String {
    p.map_or("none", |p| p.name()).to_string()
}

/// A backward's outputs as the reply's tensors, with dBias of a post-scale bias
/// (docs/semantics.md §1.9): the handshake declares `caps.dbias` with `caps.bias`, and the
/// `want` list is not read (it names dBias exactly when the case has one).
fn gradients(b: &wrapper::BwdResult) -> Vec<(&'static str, ndarray::ArrayViewD<'_, f32>)> {
    let mut tensors = vec![
        ("dq", b.dq.view().into_dyn()),
        ("dk", b.dk.view().into_dyn()),
        ("dv", b.dv.view().into_dyn()),
    ];
    if let Some(d) = &b.dbias {
        tensors.push(("dbias", d.view().into_dyn()));
    }
    tensors
}

#[cfg(test)]
mod tests {
    use super::CaseCache;
    use crate::case::samples::one_query_two_keys;
    use crate::case_file::{write_case, OutputPrecision};

    /// A name met again is read again when the file behind it changed (the protocol says the
    /// campaign never does that; a driver that does still gets the new inputs).
    #[test]
    fn a_case_file_replaced_under_its_name_is_read_again() {
        let dir = std::env::temp_dir().join(format!("smallseq-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("1.in.safetensors");
        let name = path.display().to_string();
        let mut cache = CaseCache::default();
        let write = |q: f32| {
            let case = one_query_two_keys(q, [0.5, 0.25], [1.0, 2.0], 1.0);
            write_case(&case, &path, OutputPrecision::Device).unwrap();
        };
        write(1.0);
        assert_eq!(cache.get(&name).unwrap().q[(0, 0, 0)], 1.0);
        assert_eq!(cache.get(&name).unwrap().q[(0, 0, 0)], 1.0);
        write(3.0);
        assert_eq!(cache.get(&name).unwrap().q[(0, 0, 0)], 3.0);
        assert_eq!(cache.entries.len(), 1, "one entry per name");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
