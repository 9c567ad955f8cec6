//! Where a case's time goes (issue 32): a per-thread clock that charges the time between two
//! stage changes to the stage that was current, so nested stages are exclusive (a relation's
//! rerun of the backend counts as backend time, not as the relation's). The clock runs only
//! inside [`collect`]; elsewhere [`enter`] costs one thread-local read and charges nothing.
//! Low in the tree on purpose: the runner, the oracle and the properties all mark their
//! stages, and none of them may import the campaign.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A stage of one case's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Drawing the geometry, fitting it to the runner's capabilities, building the tensors.
    Generation,
    /// A backend call, forward plus backward, with its transfers (and, for workers, the
    /// protocol and the case file): the main run and every rerun a property asks for.
    Backend,
    /// The f64 reference.
    Reference,
    /// The device-faithful emulation.
    Emulation,
    /// The rounding allowances (conditioning) and the numeric regimes.
    Allowances,
    /// Judging outputs against the yardstick, tensor by tensor and row by row.
    Judging,
    /// A property's own host work (building a transformed case, comparing runs), named by
    /// its report key; what it spends in the stages above is theirs.
    Property(&'static str),
    /// Writing capsules and shrinking failures, on the merging thread.
    Capsules,
    /// A job thread waiting to start its next case because the merge, which takes cases in
    /// order, is that many cases behind (one slow case holds back every later one).
    MergeWait,
    /// What no stage claimed.
    Other,
}

impl Stage {
    /// The stage's key in `report.json` and its row in `summary.md`.
    pub fn key(self) -> String {
        match self {
            Stage::Generation => "generation".into(),
            Stage::Backend => "backend".into(),
            Stage::Reference => "reference".into(),
            Stage::Emulation => "emulation".into(),
            Stage::Allowances => "allowances".into(),
            Stage::Judging => "judging".into(),
            Stage::Property(p) => format!("property {p}"),
            Stage::Capsules => "capsules and shrinking".into(),
            Stage::MergeWait => "waiting for the merge".into(),
            Stage::Other => "other".into(),
        }
    }
}

/// Seconds and entries per stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTimes {
    pub by_stage: BTreeMap<Stage, (Duration, u64)>,
}

impl StageTimes {
    /// Charges `d` to `stage`, as one entry.
    pub fn add(&mut self, stage: Stage, d: Duration) {
        let e = self.by_stage.entry(stage).or_default();
        e.0 += d;
        e.1 += 1;
    }

    /// Adds every stage of `other`.
    pub fn absorb(&mut self, other: &StageTimes) {
        for (s, (d, n)) in &other.by_stage {
            let e = self.by_stage.entry(*s).or_default();
            e.0 += *d;
            e.1 += n;
        }
    }

    /// The sum over all stages.
    pub fn total(&self) -> Duration {
        self.by_stage.values().map(|(d, _)| *d).sum()
    }

    fn charge(&mut self, stage: Stage, d: Duration, entered: bool) {
        let e = self.by_stage.entry(stage).or_default();
        e.0 += d;
        e.1 += u64::from(entered);
    }
}

struct Clock {
    current: Stage,
    since: Instant,
    times: StageTimes,
}

thread_local! {
    static CLOCK: RefCell<Option<Clock>> = const { RefCell::new(None) };
}

/// Charges the time since the last change to the current stage and makes `next` current;
/// returns the stage that was current. `None` when no clock runs on this thread.
fn switch(next: Stage, entered: bool) -> Option<Stage> {
    CLOCK.with(|c| {
        let mut c = c.borrow_mut();
        let clock = c.as_mut()?;
        let now = Instant::now();
        let prev = clock.current;
        clock.times.charge(prev, now - clock.since, false);
        clock.current = next;
        clock.since = now;
        if entered {
            clock.times.charge(next, Duration::ZERO, true);
        }
        Some(prev)
    })
}

/// Leaves the stage it was made for when dropped, on every way out (an early return, `?`).
pub struct InStage(Option<Stage>);

impl Drop for InStage {
    fn drop(&mut self) {
        if let Some(prev) = self.0 {
            switch(prev, false);
        }
    }
}

/// Makes `stage` current on this thread until the returned guard drops.
#[must_use = "the stage ends when the guard drops"]
pub fn enter(stage: Stage) -> InStage {
    InStage(switch(stage, true))
}

/// `f` timed in `stage`.
pub fn timed<R>(stage: Stage, f: impl FnOnce() -> R) -> R {
    let _in = enter(stage);
    f()
}

/// Runs `f` with a clock on this thread and returns what each stage took. Time no stage
/// claimed is [`Stage::Other`]. Nested calls keep the outer clock running and return the
/// inner span's stages only.
pub fn collect<R>(f: impl FnOnce() -> R) -> (R, StageTimes) {
    let outer = CLOCK.with(|c| {
        c.borrow_mut().replace(Clock {
            current: Stage::Other,
            since: Instant::now(),
            times: StageTimes::default(),
        })
    });
    let r = f();
    let inner = CLOCK.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    let times = inner.map_or_else(StageTimes::default, |mut c| {
        let d = c.since.elapsed();
        c.times.charge(c.current, d, false);
        c.times
    });
    (r, times)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(ms: u64) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(ms) {}
    }

    #[test]
    fn nested_stages_are_charged_exclusively_to_the_innermost() {
        let ((), t) = collect(|| {
            let _p = enter(Stage::Property("metamorphic"));
            spin(20);
            timed(Stage::Backend, || spin(30));
            spin(20);
        });
        let secs = |s| t.by_stage.get(&s).map_or(0.0, |(d, _)| d.as_secs_f64());
        assert!(
            (0.035..0.1).contains(&secs(Stage::Property("metamorphic"))),
            "{t:?}"
        );
        assert!((0.025..0.08).contains(&secs(Stage::Backend)), "{t:?}");
        assert_eq!(t.by_stage[&Stage::Backend].1, 1);
        assert!(t.total() >= Duration::from_millis(70));
    }

    #[test]
    fn without_a_clock_stages_charge_nothing_and_a_guard_restores_the_outer_stage() {
        timed(Stage::Judging, || spin(1));
        let ((), t) = collect(|| {
            {
                let _b = enter(Stage::Backend);
                spin(5);
            }
            spin(15);
        });
        assert!(
            t.by_stage[&Stage::Other].0 >= Duration::from_millis(14),
            "{t:?}"
        );
        assert!(!t.by_stage.contains_key(&Stage::Judging));
    }
}
