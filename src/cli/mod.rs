//! The `smallseq` command line: a thin layer over the library. `anyhow` and progress bars
//! live here only.

pub mod bench;
pub mod calibrate;
pub mod case;
pub mod explain;
pub mod fuzz;
pub mod merge;
pub mod mutants;
pub mod reference_bench;
pub mod report;
pub mod repro;
pub mod run;
pub mod target;
pub mod triage;
pub mod worker;

use std::time::Duration;

/// Exit status for usage and infrastructure errors (bad input, no device).
pub const EXIT_USAGE: i32 = 2;
/// Exit status of a command stopped by Ctrl-C or SIGTERM before its verdict was known (the
/// shell's 128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

/// How printed repro commands name this program: `smallseq` when that name on `PATH` is this
/// binary, else the binary's own path (a `cargo build` tree, not installed), so the line works
/// as printed.
pub fn repro_program() -> String {
    let Ok(me) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "smallseq".into();
    };
    let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("smallseq"))
            .collect::<Vec<_>>()
    });
    for candidate in on_path {
        if candidate.is_file() {
            // The first `smallseq` on PATH is what the shell runs.
            return if std::fs::canonicalize(&candidate).is_ok_and(|c| c == me) {
                "smallseq".into()
            } else {
                me.display().to_string()
            };
        }
    }
    me.display().to_string()
}

/// Reads a case file for a command: on an error prints it (one line, naming the file) and
/// gives the usage exit status; says when the file leaves `scale` to its default.
pub fn open_case(path: &std::path::Path) -> Result<smallseq::Case, i32> {
    let case = smallseq::case_file::read_case(path).map_err(|e| {
        tell!("smallseq: {e}");
        EXIT_USAGE
    })?;
    let config = case.meta.get("smallseq.config");
    let has_scale = config
        .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
        .is_some_and(|v| v.get("scale").is_some());
    if !has_scale {
        let p = &case.config.params;
        tell!(
            "smallseq: {}: no scale in smallseq.config: using the default 1/sqrt(head_dim_qk) \
             = 1/sqrt({}) = {}",
            path.display(),
            p.head_dim_qk,
            p.scale
        );
    }
    Ok(case)
}

/// Parses a case count of at least 1 (`--cases 0` would run nothing and pass).
pub fn parse_cases(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("at least 1 case (0 would run nothing and report a pass)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a number of cases")),
    }
}

/// The files of a finished campaign: the harness's reports, then the page drawn from them.
/// The page redraws every failure's error picture from the reference, so a partial report
/// (a merged shard that was still running) gets none.
pub fn write_reports(
    dir: &std::path::Path,
    rep: &smallseq::harness::campaign::Report,
) -> smallseq::Result<()> {
    smallseq::harness::report_io::write_reports(dir, rep)?;
    if rep.partial {
        return Ok(());
    }
    smallseq::report::write_html(dir, rep)
}

/// The refusal of [`prepare_out`] alone, which touches nothing: a command calls it before it
/// starts workers or opens a device, so a wrong `--out` costs no start-up.
pub fn refuse_previous(
    command: &str,
    out: &std::path::Path,
    also: &[std::path::PathBuf],
    force: bool,
) -> Result<(), i32> {
    use smallseq::harness::report_io::previous_report_files;
    let previous: usize = std::iter::once(out)
        .chain(also.iter().map(|d| d.as_path()))
        .map(|d| previous_report_files(d).len())
        .sum();
    if previous > 0 && !force {
        tell!(
            "smallseq {command}: {} holds the report of a previous run ({previous} file(s)); \
             pass --force to replace it, or give another --out",
            out.display()
        );
        return Err(EXIT_USAGE);
    }
    Ok(())
}

/// Readies `out` for `command`'s report: refuses (usage status) when it, or one of `also`
/// (subfolders a command writes reports into), holds a previous smallseq report and `force`
/// is off, so a rerun never wipes the last night's capsules unasked and CI paths stay
/// predictable; with `force`, removes that report (other files stay). Then creates `out`,
/// naming it and the OS's reason when that fails.
pub fn prepare_out(
    command: &str,
    out: &std::path::Path,
    also: &[std::path::PathBuf],
    force: bool,
) -> Result<(), i32> {
    use smallseq::harness::report_io::clean_previous;
    refuse_previous(command, out, also, force)?;
    let dirs: Vec<&std::path::Path> = std::iter::once(out)
        .chain(also.iter().map(|d| d.as_path()))
        .collect();
    let mut removed = 0;
    for d in &dirs {
        match clean_previous(d) {
            Ok(r) => removed += r.len(),
            Err(e) => {
                tell!("smallseq {command}: --force: {e}");
                return Err(EXIT_USAGE);
            }
        }
    }
    if removed > 0 {
        tell!(
            "smallseq {command}: --force: removed {removed} file(s) a previous run wrote in {} \
             (its reports and capsules; other files are left)",
            out.display()
        );
    }
    if let Err(e) = std::fs::create_dir_all(out) {
        tell!(
            "smallseq {command}: cannot create the output folder {}: {e}",
            out.display()
        );
        return Err(EXIT_USAGE);
    }
    Ok(())
}

/// The command line as typed, each word quoted for a POSIX shell where it needs it.
pub fn command_line() -> String {
    let words: Vec<String> = std::env::args()
        .map(|a| smallseq::harness::repro::shell_quote(&a))
        .collect();
    words.join(" ")
}

/// Parses `90`, `90s`, `10m`, `2h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('s') => (&s[..s.len() - 1], 1.0),
        Some('m') => (&s[..s.len() - 1], 60.0),
        Some('h') => (&s[..s.len() - 1], 3600.0),
        _ => (s, 1.0),
    };
    num.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .map(|x| Duration::from_secs_f64(x * mult))
        .ok_or_else(|| format!("invalid duration '{s}' (e.g. 60s, 10m, 2h)"))
}
