//! The `smallseq` command line: a thin layer over the library. `anyhow` and progress bars
//! live here only.

pub mod bench;
pub mod calibrate;
pub mod explain;
pub mod fuzz;
pub mod merge;
pub mod mutants;
pub mod reference_bench;
pub mod report;
pub mod repro;
pub mod run;
pub mod target;
pub mod worker;

use std::time::Duration;

/// Exit status for usage and infrastructure errors (bad input, no device).
pub const EXIT_USAGE: i32 = 2;
/// Exit status of a command stopped by Ctrl-C or SIGTERM before its verdict was known (the
/// shell's 128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

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
        .ok_or_else(|| format!("invalid duration {s:?} (e.g. 60s, 10m, 2h)"))
}
