//! One worker process, seen from the campaign: started in its own process group, its stdout
//! read line by line on a thread (so every wait has a timeout), its stderr kept as a tail.

use super::protocol::{Handshake, Reply, Request, PROTOCOL};
use crate::error::{Error, Result};
use crate::runner::{Fault, FaultKind};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of stderr kept per worker (what a crash capsule records).
pub const STDERR_TAIL: usize = 64 * 1024;

/// How to start a worker.
#[derive(Clone, Debug)]
pub struct Spawn {
    pub argv: Vec<String>,
    /// Added to the campaign's environment.
    pub env: Vec<(String, String)>,
}

impl Spawn {
    /// The command as one line, for messages and capsules.
    pub fn display(&self) -> String {
        self.argv.join(" ")
    }
}

/// The last bytes a worker wrote to stderr.
#[derive(Default)]
struct Tail(VecDeque<u8>);

impl Tail {
    fn push(&mut self, b: &[u8]) {
        self.0.extend(b);
        let over = self.0.len().saturating_sub(STDERR_TAIL);
        self.0.drain(..over);
    }
}

/// A running worker.
pub struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Tail>>,
    pub handshake: Handshake,
    command: String,
}

impl Worker {
    /// Starts `spec` and waits up to `timeout` for its handshake.
    ///
    /// # Errors
    /// [`Error::WorkerStart`] naming the command and what it printed: it could not be
    /// started, printed no handshake in time, or a handshake of another protocol.
    pub fn start(spec: &Spawn, timeout: Duration) -> Result<Worker> {
        let command = spec.display();
        let start_err = |detail: String| Error::WorkerStart {
            command: command.clone(),
            detail,
        };
        let (prog, args) = spec
            .argv
            .split_first()
            .ok_or_else(|| start_err("the worker command is empty".into()))?;
        let mut child = Command::new(prog)
            .args(args)
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: a hung worker is killed with whatever it started.
            .process_group(0)
            .spawn()
            .map_err(|e| start_err(format!("cannot start {prog}: {e}")))?;
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let tail = Arc::new(Mutex::new(Tail::default()));
        {
            let tail = tail.clone();
            let mut stderr = stderr;
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    tail.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(&buf[..n]);
                }
            });
        }
        let mut w = Worker {
            child,
            stdin: None,
            lines,
            stderr: tail,
            handshake: Handshake {
                protocol: String::new(),
                name: String::new(),
                version: String::new(),
                provenance: Default::default(),
                caps: Default::default(),
            },
            command: command.clone(),
        };
        w.stdin = w.child.stdin.take();
        let first = match w.lines.recv_timeout(timeout) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                let tail = w.stderr_tail();
                w.kill();
                return Err(start_err(format!(
                    "no handshake within {} s{}",
                    timeout.as_secs(),
                    last_lines(&tail)
                )));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = w.exit_status();
                return Err(start_err(format!(
                    "{status} before its handshake{}",
                    last_lines(&w.stderr_tail())
                )));
            }
        };
        let hs: Handshake = serde_json::from_str(&first).map_err(|e| {
            start_err(format!(
                "its first line is not a handshake ({e}): {}",
                clip(&first)
            ))
        })?;
        if hs.protocol != PROTOCOL {
            w.kill();
            return Err(start_err(format!(
                "speaks protocol {:?}, this campaign {PROTOCOL:?}",
                hs.protocol
            )));
        }
        w.handshake = hs;
        Ok(w)
    }

    /// Sends `req` and waits up to `timeout` for its reply.
    ///
    /// # Errors
    /// The [`Fault`] when the worker died, broke the protocol or did not answer; the worker
    /// is killed then and must not be used again.
    pub fn call(&mut self, req: &Request, timeout: Duration) -> std::result::Result<Reply, Fault> {
        let line = serde_json::to_string(req).expect("requests serialise");
        let sent = self
            .stdin
            .as_mut()
            .map(|s| writeln!(s, "{line}").and_then(|()| s.flush()));
        if !matches!(sent, Some(Ok(()))) {
            let status = self.exit_status();
            return Err(self.crash(format!("{status} (its stdin is closed)")));
        }
        match self.lines.recv_timeout(timeout) {
            Ok(l) => match serde_json::from_str::<Reply>(&l) {
                Ok(r) if r.id == req.id => Ok(r),
                Ok(r) => Err(self.crash(format!(
                    "answered request {} while {} was in flight",
                    r.id, req.id
                ))),
                Err(e) => Err(self.crash(format!(
                    "printed a line that is not a reply ({e}): {}",
                    clip(&l)
                ))),
            },
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.exit_status();
                Err(self.crash(status))
            }
            Err(RecvTimeoutError::Timeout) => {
                let tail = self.stderr_tail();
                self.kill();
                Err(Fault {
                    kind: FaultKind::Hang,
                    detail: format!(
                        "no reply within {:.1} s (case timeout); worker killed",
                        timeout.as_secs_f64()
                    ),
                    stderr: tail,
                    timeout_s: Some(timeout.as_secs_f64()),
                })
            }
        }
    }

    /// A crash fault with the stderr tail; the worker is killed.
    pub fn crash(&mut self, detail: String) -> Fault {
        let tail = self.stderr_tail();
        self.kill();
        Fault {
            kind: FaultKind::Crash,
            detail: format!("{detail}{}", last_lines(&tail)),
            stderr: tail,
            timeout_s: None,
        }
    }

    /// How the process ended (waiting up to 2 s for it), in words.
    fn exit_status(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    // The stderr thread may still be draining the last lines.
                    std::thread::sleep(Duration::from_millis(50));
                    return match (st.code(), st.signal()) {
                        (Some(c), _) => format!("exited with status {c}"),
                        (None, Some(s)) => format!("killed by signal {s} ({})", signal_name(s)),
                        _ => "ended".into(),
                    };
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(None) => return "closed its stdout but is still running".into(),
                Err(e) => return format!("cannot be waited for ({e})"),
            }
        }
    }

    /// The last bytes of its stderr, as text.
    pub fn stderr_tail(&self) -> String {
        let t = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&t.0.iter().copied().collect::<Vec<_>>()).into_owned()
    }

    /// SIGTERM to its process group, SIGKILL after 2 s, then reaped.
    pub fn kill(&mut self) {
        self.stdin = None;
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let pgid = self.child.id() as i32;
        // SAFETY: kill(2) on the group this worker leads; no memory is touched.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// Asks it to finish (a `shutdown` request, then closed stdin), killing it if it has not
    /// after `grace`.
    pub fn shutdown(mut self, grace: Duration) {
        if let Some(s) = self.stdin.as_mut() {
            let _ = writeln!(s, r#"{{"id": 0, "op": "shutdown"}}"#).and_then(|()| s.flush());
        }
        self.stdin = None;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }

    pub fn command(&self) -> &str {
        &self.command
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        _ => "signal",
    }
}

fn clip(s: &str) -> String {
    let mut c: String = s.chars().take(200).collect();
    if c.len() < s.len() {
        c.push('…');
    }
    c
}

/// The last two lines of a stderr tail, as a suffix for a one-line message.
fn last_lines(tail: &str) -> String {
    let lines: Vec<&str> = tail.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    // A Rust panic's message follows its "panicked at" line; a backtrace would bury it.
    if let Some(i) = lines.iter().rposition(|l| l.contains("panicked at")) {
        let end = (i + 2).min(lines.len());
        return format!("; stderr: {}", clip(&lines[i..end].join(" | ")));
    }
    let from = lines.len().saturating_sub(2);
    format!("; stderr: {}", clip(&lines[from..].join(" | ")))
}
