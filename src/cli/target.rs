//! The implementation a command tests: an in-tree backend in this process, or worker
//! processes (in-tree backends with `--isolate` and on GPUs, any program with `--backend exec`).

use smallseq::backend::{self, Backend};
use smallseq::dispatch::Profile;
use smallseq::harness::capsule::KERNEL_DEFINES_ENV;
use smallseq::mutants::Mutant;
use smallseq::runner::{InProcess, Runner};
use smallseq::worker::{Pool, PoolConfig, SpawnFor};
use std::time::Duration;

/// Where cases run.
#[derive(clap::Args, Debug, Clone)]
pub struct TargetArgs {
    /// What to test: cpu, cuda, hip, te625-model, or exec (a worker program, see --worker).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// The worker command for --backend exec, e.g. 'python3 adapters/torch_sdpa.py --kernel
    /// flash' (split on spaces; quotes group words). See docs/worker-protocol.md.
    #[arg(long)]
    pub worker: Option<String>,
    /// Run an in-tree backend in worker processes, one per job (the default on GPUs; the CPU
    /// backends run in this process unless this is given).
    #[arg(long)]
    pub isolate: bool,
    /// Run a GPU backend in this process, one stream per job, instead of in worker processes:
    /// no case files, no protocol, several times the cases per second on short sequences, but
    /// no isolation (a device fault ends the campaign after the cases in flight; the capsule's
    /// `smallseq repro` reruns it in a worker).
    #[arg(long, conflicts_with = "isolate")]
    pub in_process: bool,
    /// Devices to spread workers over, e.g. 0,1,2,3 (default: every device the first worker
    /// reports).
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Time a worker may take for one run of a case before it is killed and the case gets a
    /// `hang` verdict (default: 30 s + 1 s per 1e8 multiply-adds of the case).
    #[arg(long, value_parser = super::parse_duration)]
    pub case_timeout: Option<Duration>,
    /// Time a worker may take to start and send its handshake (a cold GPU worker compiles its
    /// kernels first).
    #[arg(long, value_parser = super::parse_duration, default_value = "600s")]
    pub start_timeout: Duration,
}

/// An opened target.
pub enum Target {
    InProcess(Box<dyn Backend>),
    Workers(Box<Pool>),
}

impl Target {
    /// The runner the checker calls.
    pub fn runner(&self) -> Box<dyn Runner + '_> {
        match self {
            Target::InProcess(be) => Box::new(InProcess::new(be.as_ref())),
            Target::Workers(p) => Box::new(p.as_ref()),
        }
    }

    /// Whether cases run in worker processes.
    pub fn in_workers(&self) -> bool {
        matches!(self, Target::Workers(_))
    }
}

/// Splits a command line on spaces, keeping quoted words together ('…' or "…").
pub fn split_command(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut in_word = false;
    for ch in s.chars() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(ch);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err(format!("unbalanced quote in the worker command {s:?}"));
    }
    if in_word {
        words.push(cur);
    }
    if words.is_empty() {
        return Err("the worker command is empty".into());
    }
    Ok(words)
}

/// Whether `args` put cases in worker processes: `exec`, `--isolate`, or a GPU backend
/// without `--in-process`.
pub fn in_workers(args: &TargetArgs) -> bool {
    args.backend == "exec" || args.isolate || (is_gpu(&args.backend) && !args.in_process)
}

/// Opens `args`'s backend in this process for `jobs` cases at once (`None`: one per core
/// where the backend takes cases concurrently, else one).
fn open_here(
    args: &TargetArgs,
    jobs: Option<usize>,
    plant: &[Mutant],
) -> Result<(Target, usize), String> {
    let spec = backend::Spec {
        name: &args.backend,
        device: args
            .devices
            .as_ref()
            .and_then(|d| d.first().copied())
            .unwrap_or(0),
        mutants: plant,
        warm: false,
    };
    let be = if is_gpu(&args.backend) {
        precheck(&args.backend)?;
        let lanes = jobs.unwrap_or_else(cores);
        backend::open_lanes(&spec, lanes).map_err(|e| e.to_string())?
    } else {
        backend::open_with(&spec).map_err(|e| e.to_string())?
    };
    let jobs = jobs.unwrap_or_else(|| if be.concurrent_cases() { cores() } else { 1 });
    Ok((Target::InProcess(be), jobs))
}

/// Whether `name` is a GPU backend (cases run in workers by default there).
pub fn is_gpu(name: &str) -> bool {
    matches!(name, "cuda" | "hip")
}

/// Cores of this machine.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Opens the target for `jobs` cases at once (`None`: the default for the target). Returns
/// the target and the jobs it was opened for.
///
/// # Errors
/// A one-line message for exit status 2: unknown backend, no device, a worker that does not
/// start or breaks the handshake.
pub fn open(
    args: &TargetArgs,
    profile: Profile,
    jobs: Option<usize>,
) -> Result<(Target, usize), String> {
    open_with_env(args, profile, jobs, Vec::new())
}

/// [`open`] with bugs planted: in the CPU backend of this process, or as kernel defines of
/// GPU workers.
///
/// # Errors
/// As [`open`]; planted bugs where they cannot go (a CPU worker process, `exec`).
pub fn open_planted(
    args: &TargetArgs,
    profile: Profile,
    jobs: Option<usize>,
    plant: &[Mutant],
) -> Result<(Target, usize), String> {
    if plant.is_empty() {
        return open(args, profile, jobs);
    }
    let workers = in_workers(args);
    if !workers {
        return open_here(args, jobs, plant);
    }
    if !is_gpu(&args.backend) {
        return Err(format!(
            "--plant puts bugs in the {} backend of this process: drop --isolate (GPU workers \
             take them as kernel defines)",
            args.backend
        ));
    }
    let mut defines: Vec<String> = std::env::var(KERNEL_DEFINES_ENV)
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    for m in plant {
        let d = m
            .kernel_define()
            .ok_or_else(|| format!("mutant {m}: the GPU kernels do not carry it"))?;
        defines.push(d.to_string());
    }
    open_with_env(
        args,
        profile,
        jobs,
        vec![(KERNEL_DEFINES_ENV.to_string(), defines.join(" "))],
    )
}

/// [`open`], with variables added to the workers' environment.
///
/// # Errors
/// As [`open`].
pub fn open_with_env(
    args: &TargetArgs,
    profile: Profile,
    jobs: Option<usize>,
    worker_env: Vec<(String, String)>,
) -> Result<(Target, usize), String> {
    if args.backend != "exec" && args.worker.is_some() {
        return Err("--worker is for --backend exec".into());
    }
    if args.in_process && !is_gpu(&args.backend) {
        return Err(format!(
            "--in-process is for the GPU backends (cuda, hip); {} {}",
            args.backend,
            if args.backend == "exec" {
                "runs a program, which is always another process"
            } else {
                "runs in this process already"
            }
        ));
    }
    let workers = in_workers(args);
    if !workers {
        return open_here(args, jobs, &[]);
    }
    let spawn = match args.backend.as_str() {
        "exec" => {
            let line = args
                .worker
                .as_deref()
                .ok_or("--backend exec needs --worker 'COMMAND …'")?;
            SpawnFor::Exec {
                argv: split_command(line)?,
                env: worker_env,
            }
        }
        name if backend::NAMES.contains(&name) => {
            precheck(name)?;
            let exe = std::env::current_exe()
                .map_err(|e| format!("cannot find this executable to start workers: {e}"))?;
            SpawnFor::InTree {
                exe: exe.display().to_string(),
                backend: name.into(),
                profile: profile.name().into(),
                env: worker_env,
            }
        }
        other => {
            return Err(format!(
                "unknown backend '{other}' (expected one of {}, or exec with --worker 'COMMAND')",
                backend::NAMES.join(", ")
            ))
        }
    };
    let in_tree = (args.backend != "exec").then(|| args.backend.clone());
    let devices = args.devices.as_ref().map_or(1, Vec::len).max(1);
    let jobs = jobs.unwrap_or_else(|| default_jobs(&args.backend, devices));
    let pool = Pool::open(PoolConfig {
        spawn,
        jobs,
        devices: args.devices.clone(),
        case_timeout: args.case_timeout,
        start_timeout: args.start_timeout,
        in_tree,
        reuse_inputs: true,
    })
    .map_err(|e| e.to_string())?;
    Ok((Target::Workers(Box::new(pool)), jobs))
}

/// Workers when `--jobs` is not given: one per core (each judges its cases on a host thread
/// beside its worker process), and at least one per device; on a GPU two per core, since a
/// GPU worker waits for its device most of the time (bench/NOTES.md v8: on an H200 host of
/// 16 cores, 16 jobs ran 94.8 cases/s, 24 ran 114.7 and 32 ran 127.2).
fn default_jobs(backend: &str, devices: usize) -> usize {
    let per_core = if is_gpu(backend) { 2 } else { 1 };
    (per_core * cores()).max(devices)
}

/// A GPU backend this build cannot run says so here, in one line, before any worker starts.
fn precheck(name: &str) -> Result<(), String> {
    match name {
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(smallseq::Error::NotCompiledWith { feature: "cuda" }.to_string()),
        #[cfg(feature = "cuda")]
        "cuda" if backend::device_count("cuda") == 0 => {
            backend::open("cuda").map(|_| ()).map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "hip"))]
        "hip" => Err(smallseq::Error::NotCompiledWith { feature: "hip" }.to_string()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::split_command;

    #[test]
    fn commands_split_on_spaces_and_keep_quotes() {
        assert_eq!(
            split_command("python3  'my adapter.py' --kernel \"flash attn\"").unwrap(),
            ["python3", "my adapter.py", "--kernel", "flash attn"]
        );
        assert!(split_command("python3 'open").is_err());
        assert!(split_command("   ").is_err());
    }
}
