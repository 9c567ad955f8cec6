//! Work on several threads, merged in index order: the reorder buffer that makes a campaign's
//! report the same for any `--jobs`. Threads take indices in order and send their results;
//! the calling thread holds what arrives early and merges each result only once every lower
//! index is merged, so the merge sees exactly the sequence one thread would have produced.
//! Apart from the campaign so that its stopping rules can be tested without cases.

use crate::error::Result;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The merging side, called on the thread that called [`run`], in index order.
pub trait Merger<T> {
    /// Whether the budget is spent before index `i`: nothing from `i` on is merged.
    fn spent_before(&self, i: u64) -> bool;
    /// Merges index `i`; returns whether the run goes on.
    ///
    /// # Errors
    /// Whatever ends the run with an error (the first in index order is the run's).
    fn take(&mut self, i: u64, item: T) -> Result<bool>;
    /// The time the threads spent, all together, waiting before an index because it was
    /// `ahead` or more past the merged ones; told once, when the run ends.
    fn waited(&mut self, total: Duration) {
        let _ = total;
    }
}

/// Sets its flag when dropped: on every way out of the merging loop, unwinding included.
struct HaltOnDrop<'a>(&'a AtomicBool);

impl Drop for HaltOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Runs `work(i)` for `i = 0, 1, …` on `jobs` threads while `exists(i)`, and hands the results
/// to `merger` in order. No thread starts an index `ahead` or more past the merged ones: that
/// bounds what waits in memory while the merger is slow (a shrink). Whatever ends the run
/// (the budget, `stop`, a `take` that returns false or an error, a panic on the merging side)
/// halts the threads; results past the end are dropped, as one thread would not have started
/// them. `stop` ends the run after the indices already started: no thread starts another,
/// and those they finish are merged up to the first gap (an index taken but not started).
///
/// Returns whether `stop` interrupted the run: it came while indices remained to merge, and
/// those merged do not complete the budget.
///
/// # Errors
/// The first error of [`Merger::take`], in index order.
pub fn run<T: Send>(
    jobs: usize,
    ahead: u64,
    stop: &AtomicBool,
    exists: &(dyn Fn(u64) -> bool + Sync),
    work: &(dyn Fn(u64) -> T + Sync),
    merger: &mut dyn Merger<T>,
) -> Result<bool> {
    let next = AtomicU64::new(0);
    let merged = AtomicU64::new(0);
    let halt = AtomicBool::new(false);
    let waited_ns = AtomicU64::new(0);
    let r = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<(u64, T)>();
        for _ in 0..jobs {
            let tx = tx.clone();
            let (next, merged, halt, waited_ns) = (&next, &merged, &halt, &waited_ns);
            s.spawn(move || loop {
                if halt.load(Ordering::SeqCst) || stop.load(Ordering::SeqCst) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::SeqCst);
                if !exists(i) {
                    break;
                }
                let wait = Instant::now();
                while i >= merged.load(Ordering::SeqCst) + ahead {
                    // Not started yet: after `stop`, or once it no longer exists (a time
                    // budget ran out while it waited), never.
                    if halt.load(Ordering::SeqCst) || stop.load(Ordering::SeqCst) || !exists(i) {
                        waited_ns.fetch_add(wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                waited_ns.fetch_add(wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
                // The merge may have moved on while this thread looked: a stop that came
                // after the index was taken, but before it starts, leaves it unstarted.
                if halt.load(Ordering::SeqCst) || stop.load(Ordering::SeqCst) {
                    return;
                }
                if tx.send((i, work(i))).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        // A panic while merging (a shrink, a capsule write) must still release the threads.
        let _release = HaltOnDrop(&halt);
        let mut pending: BTreeMap<u64, T> = BTreeMap::new();
        let mut outcome = Ok(());
        let mut merging = true;
        // `stop` came while indices remained to merge: the run is interrupted, unless the
        // indices started before it complete the budget.
        let mut stopped = false;
        loop {
            merging = merging && !merger.spent_before(merged.load(Ordering::SeqCst));
            stopped |= merging && stop.load(Ordering::SeqCst);
            while merging {
                let i = merged.load(Ordering::SeqCst);
                let Some(item) = pending.remove(&i) else {
                    break;
                };
                match merger.take(i, item) {
                    Ok(true) => {
                        merged.store(i + 1, Ordering::SeqCst);
                        merging = !merger.spent_before(i + 1);
                    }
                    Ok(false) => merging = false,
                    Err(e) => {
                        outcome = Err(e);
                        merging = false;
                    }
                }
            }
            if !merging {
                halt.store(true, Ordering::SeqCst);
            }
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok((i, r)) => {
                    pending.insert(i, r);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                // Every thread has exited: what follows the merged indices without a gap is
                // merged above; a gap (an index taken, then abandoned) ends it.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    if !merging || !pending.contains_key(&merged.load(Ordering::SeqCst)) {
                        break;
                    }
                }
            }
        }
        // The stop may come while an index is merged (a shrink cut short by it) and the rest
        // merge before the loop looks again.
        stopped |= merging && stop.load(Ordering::SeqCst);
        outcome.map(|()| stopped && !merger.spent_before(merged.load(Ordering::SeqCst)))
    });
    merger.waited(Duration::from_nanos(waited_ns.load(Ordering::Relaxed)));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// Records what it merges; stops, fails or sets `stop` at chosen indices.
    struct Record<'a> {
        budget: u64,
        merged: Vec<u64>,
        end_at: Option<u64>,
        fail_at: Option<u64>,
        stop_at: Option<(u64, &'a AtomicBool)>,
    }

    impl<'a> Record<'a> {
        fn new(budget: u64) -> Self {
            Record {
                budget,
                merged: Vec::new(),
                end_at: None,
                fail_at: None,
                stop_at: None,
            }
        }
    }

    impl Merger<u64> for Record<'_> {
        fn spent_before(&self, i: u64) -> bool {
            i >= self.budget
        }
        fn take(&mut self, i: u64, item: u64) -> Result<bool> {
            assert_eq!(item, i * 10, "the result of another index");
            if self.fail_at == Some(i) {
                return Err(Error::config(format!("index {i}")));
            }
            self.merged.push(i);
            if let Some((at, stop)) = self.stop_at {
                if at == i {
                    stop.store(true, Ordering::SeqCst);
                }
            }
            Ok(self.end_at != Some(i))
        }
    }

    /// Later indices finish first, so results arrive out of order.
    fn slow_early(i: u64) -> u64 {
        std::thread::sleep(Duration::from_micros(200 * (8 - i % 8)));
        i * 10
    }

    #[test]
    fn results_merge_in_index_order_whatever_order_they_finish_in() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(40);
        let interrupted = run(4, 16, &stop, &|_| true, &slow_early, &mut r).unwrap();
        assert_eq!(r.merged, (0..40).collect::<Vec<_>>());
        assert!(!interrupted);
    }

    #[test]
    fn indices_that_do_not_exist_end_the_run_like_a_spent_budget() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(u64::MAX);
        let interrupted = run(3, 8, &stop, &|i| i < 25, &slow_early, &mut r).unwrap();
        assert_eq!(r.merged, (0..25).collect::<Vec<_>>());
        assert!(!interrupted);
    }

    /// A time budget as the campaign runs it: `exists` turns false once the time is out,
    /// and every index started before that is merged, the slowest (a fault's timeout) too.
    #[test]
    fn indices_started_before_the_end_of_a_time_budget_are_all_merged() {
        let stop = AtomicBool::new(false);
        let open = AtomicBool::new(true);
        let work = |i: u64| {
            if i == 5 {
                open.store(false, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(60));
            }
            i * 10
        };
        let mut r = Record::new(u64::MAX);
        let exists = |_| open.load(Ordering::SeqCst);
        let interrupted = run(4, 16, &stop, &exists, &work, &mut r).unwrap();
        let n = r.merged.len() as u64;
        assert_eq!(r.merged, (0..n).collect::<Vec<_>>());
        assert!(n > 5, "the slow index 5 was dropped: {n} merged");
        assert!(!interrupted);
    }

    #[test]
    fn a_take_that_ends_the_run_merges_nothing_after_it() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(100);
        r.end_at = Some(6);
        let interrupted = run(4, 16, &stop, &|_| true, &slow_early, &mut r).unwrap();
        assert_eq!(r.merged, (0..=6).collect::<Vec<_>>());
        assert!(!interrupted);
    }

    #[test]
    fn the_first_error_in_index_order_is_the_runs() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(100);
        r.fail_at = Some(9);
        let e = run(4, 16, &stop, &|_| true, &slow_early, &mut r).unwrap_err();
        assert!(e.to_string().contains("index 9"), "{e}");
        assert_eq!(r.merged, (0..9).collect::<Vec<_>>());
    }

    #[test]
    fn stop_merges_what_was_started_without_a_gap_and_says_interrupted() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(1000);
        r.stop_at = Some((5, &stop));
        let interrupted = run(4, 8, &stop, &|_| true, &slow_early, &mut r).unwrap();
        let n = r.merged.len() as u64;
        assert_eq!(r.merged, (0..n).collect::<Vec<_>>());
        // Started before the stop: at most the look-ahead past index 5.
        assert!((6..=5 + 8 + 1).contains(&n), "{n} merged");
        assert!(interrupted);
    }

    #[test]
    fn a_stop_after_the_last_index_of_the_budget_is_no_interruption() {
        let stop = AtomicBool::new(false);
        let mut r = Record::new(12);
        r.stop_at = Some((11, &stop));
        let interrupted = run(2, 8, &stop, &|_| true, &slow_early, &mut r).unwrap();
        assert_eq!(r.merged, (0..12).collect::<Vec<_>>());
        assert!(!interrupted);
    }

    #[test]
    fn no_thread_runs_ahead_of_the_merged_indices_by_more_than_the_look_ahead() {
        let merged = AtomicU64::new(0);
        let worst = AtomicU64::new(0);
        struct Slow<'a>(&'a AtomicU64, Record<'a>);
        impl Merger<u64> for Slow<'_> {
            fn spent_before(&self, i: u64) -> bool {
                self.1.spent_before(i)
            }
            fn take(&mut self, i: u64, item: u64) -> Result<bool> {
                std::thread::sleep(Duration::from_millis(2));
                self.0.store(i + 1, Ordering::SeqCst);
                self.1.take(i, item)
            }
        }
        let work = |i: u64| {
            let lead = i.saturating_sub(merged.load(Ordering::SeqCst));
            worst.fetch_max(lead, Ordering::SeqCst);
            i * 10
        };
        let stop = AtomicBool::new(false);
        let mut m = Slow(&merged, Record::new(30));
        run(4, 3, &stop, &|_| true, &work, &mut m).unwrap();
        assert_eq!(m.1.merged, (0..30).collect::<Vec<_>>());
        assert!(
            worst.load(Ordering::SeqCst) < 3,
            "ran {} ahead",
            worst.into_inner()
        );
    }
}
