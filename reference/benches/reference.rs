//! Cases per second of the f64 reference (forward + backward) on the standard case:
//! 16 slots, `Lq`, `Lk` uniform in `1..=17`, `H = Hkv = 16`, `D = 128`, bf16, random `d_o`.
//! One thread, then one thread per core, each with its own cases.

#[path = "../tests/common/mod.rs"]
mod common;

use common::{standard_case, Case, Rng};
use std::hint::black_box;
use std::time::{Duration, Instant};

const CASES: usize = 64;
const MIN_TIME: Duration = Duration::from_secs(3);

fn cases(seed: u64) -> Vec<Case> {
    let mut rng = Rng::new(seed);
    (0..CASES).map(|_| standard_case(&mut rng)).collect()
}

/// Runs the cases round-robin for at least [`MIN_TIME`]; returns (cases run, seconds).
fn run(cases: &[Case], f: Bench) -> (usize, f64) {
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < MIN_TIME {
        for c in cases {
            f(c);
        }
        n += cases.len();
    }
    (n, start.elapsed().as_secs_f64())
}

type Bench = fn(&Case);

fn reference(c: &Case) {
    black_box(smallseq_reference::forward_backward(&c.problem()));
}

fn emulation(c: &Case) {
    black_box(smallseq_reference::emulate::forward_backward(
        &c.problem(),
        c.dtype,
    ));
}

fn bench(name: &str, f: Bench) {
    let single = cases(1);
    f(&single[0]);
    // A spawned thread, like each of the all-core threads below, so both figures use the
    // same kind of malloc arena.
    let (n, t) = std::thread::scope(|s| s.spawn(|| run(&single, f)).join().unwrap());
    println!("{name}: 1 thread: {:.1} cases/s", n as f64 / t);

    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sets: Vec<Vec<Case>> = (0..threads).map(|i| cases(100 + i as u64)).collect();
    let start = Instant::now();
    let total: usize = std::thread::scope(|s| {
        let handles: Vec<_> = sets
            .iter()
            .map(|set| s.spawn(move || run(set, f).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let t = start.elapsed().as_secs_f64();
    println!("{name}: {threads} threads: {:.1} cases/s", total as f64 / t);
}

fn main() {
    // `cargo bench -p smallseq-reference -- emulation` runs only the benches whose name
    // contains "emulation".
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let benches: [(&str, Bench); 2] = [
        ("reference f64 fwd+bwd", reference),
        ("emulation bf16 fwd+bwd", emulation),
    ];
    for (name, f) in benches {
        if filter.is_empty() || filter.iter().any(|w| name.contains(w.as_str())) {
            bench(name, f);
        }
    }
}
