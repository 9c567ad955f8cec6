//! The fuzz campaign: draw cases, check every property, write capsules for failures (then
//! shrink them), and keep the counts that go into `report.json` and `junit.xml`.

use super::capsule;
use super::classes::{self, classify};
use super::fit::fit_to_caps;
use super::gen::{build, draw_geometry_for};
use super::in_order::{self, Merger};
use super::props::{CaseRun, Checker, Failure, Outcome, Prop};
use super::rng::Rng;
use super::shrink::shrink;
use crate::case::Case;
use crate::error::{panic_text, Error, Result};
use crate::runner::Runner;
use crate::stages::{self, Stage, StageTimes};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// When to stop.
#[derive(Clone, Copy, Debug)]
pub enum Budget {
    Cases(u64),
    Time(Duration),
}

/// Pass/fail/skip counts of one property.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Counts {
    pub pass: u64,
    pub fail: u64,
    pub skip: u64,
    /// Failures that are wholly a range limit of a 16-bit design (`props::range_limit`),
    /// counted apart from `fail`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub range_limit: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Percentiles of a margin distribution.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// A tensor's largest margin over a campaign and the case it came from (the first of equals):
/// where a correct implementation came nearest the failure line, to rerun with
/// `smallseq fuzz --seed S --cases N` or study.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct MarginAt {
    pub margin: f64,
    pub case: u64,
}

impl MarginAt {
    /// Keeps the larger margin of `self` and `other`, the earlier case of equal ones.
    pub fn keep_larger(&mut self, other: MarginAt) {
        if other.margin > self.margin || (other.margin == self.margin && other.case < self.case) {
            *self = other;
        }
    }
}

/// Keeps, per tensor, the larger of `into`'s and `m`.
pub fn keep_largest_margin(into: &mut BTreeMap<String, MarginAt>, tensor: &str, m: MarginAt) {
    match into.get_mut(tensor) {
        Some(cur) => cur.keep_larger(m),
        None => {
            into.insert(tensor.to_string(), m);
        }
    }
}

/// One failure in the report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FailureEntry {
    pub case: u64,
    pub property: String,
    pub detail: String,
    pub capsule: String,
    pub shrunk_capsule: Option<String>,
    pub shrunk_size: Option<ShrunkSize>,
    pub repro: String,
}

/// The size of a shrunk case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShrunkSize {
    pub slots: usize,
    /// The most tokens of any slot, on either side.
    pub max_tokens: usize,
}

/// `report.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The command line that ran the campaign (set by the CLI; empty from the library).
    pub command: String,
    /// The commit the harness was built from.
    pub commit: Option<String>,
    pub budget: Budget,
    pub jobs: usize,
    pub cases: u64,
    pub seed: u64,
    pub backend: String,
    pub profile: String,
    pub elapsed_s: f64,
    pub cases_per_s: f64,
    pub properties: BTreeMap<String, Counts>,
    pub skip_reasons: BTreeMap<String, u64>,
    pub coverage: BTreeMap<String, u64>,
    pub paths: BTreeMap<String, u64>,
    pub margins: BTreeMap<String, Percentiles>,
    /// Per tensor, the verdicts that an output of all zeros would have passed although its
    /// elements lie outside their own rounding noise (`Judgement::blind`): blind spots of the
    /// yardstick. 0 is the target.
    pub blind_verdicts: BTreeMap<String, u64>,
    /// Per tensor, the verdicts whose every element lies inside the rounding noise of its own
    /// terms, where zeros pass on the floors and allowances alone (`Judgement::indeterminate`):
    /// the value is not determined at the working precision.
    #[serde(default)]
    pub indeterminate_verdicts: BTreeMap<String, u64>,
    /// Per tensor, the largest margin and its case.
    #[serde(default)]
    pub largest_margins: BTreeMap<String, MarginAt>,
    /// The same margins, log-binned, for the histograms of `report.html`.
    pub margin_histograms: BTreeMap<String, super::histogram::Histogram>,
    pub failures: Vec<FailureEntry>,
    /// Cases whose every failure is a range limit of a 16-bit design, with its
    /// characterisation as `detail`: listed, not counted as defects (`failed` ignores them;
    /// `fuzz --fail-on-range-limit` fails on them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub range_limits: Vec<FailureEntry>,
    pub interrupted: bool,
    /// The worker command, when cases ran in worker processes.
    #[serde(default)]
    pub worker: Option<String>,
    /// What the implementation cannot express, so the campaign never drew it.
    #[serde(default)]
    pub not_covered: Vec<String>,
    /// When cases ran in worker processes: per request, the round trip minus the worker's
    /// own `elapsed_us`, in microseconds (`docs/worker-protocol.md`, "Replies").
    #[serde(default)]
    pub protocol_overhead_us: Option<Percentiles>,
    /// `I/N` when this is one shard of a campaign (`--shard`).
    #[serde(default)]
    pub shard: Option<String>,
    /// Every margin of every tensor, for merging shards (written to `margins.json`).
    #[serde(skip)]
    pub margin_samples: BTreeMap<String, Vec<f64>>,
    /// Written while the campaign ran (`report_io::PartialReports`): the process has not
    /// finished it (or was killed); the margins are in the final report only.
    #[serde(default)]
    pub partial: bool,
    /// Values drawn per dimension, and those admitted but never drawn (issue 18).
    #[serde(default)]
    pub dimensions: super::coverage::Coverage,
    /// Where the cases' time went, per stage (issue 32): timings, like `elapsed_s`.
    #[serde(default)]
    pub stages: BTreeMap<String, super::profile::StageShare>,
}

impl Report {
    pub fn failed(&self) -> bool {
        !self.failures.is_empty()
    }

    /// Classes no case of the campaign hit.
    pub fn classes_missed(&self) -> Vec<&str> {
        self.coverage
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(k, _)| k.as_str())
            .collect()
    }
}

/// Campaign settings.
pub struct Campaign<'a> {
    pub checker: Checker<'a>,
    pub seed: u64,
    pub budget: Budget,
    pub out: PathBuf,
    /// Time allowed to shrink each failure.
    pub shrink_budget: Duration,
    /// Stop at the first failing case (mutation runs).
    pub stop_on_failure: bool,
    /// Cases checked at once, on as many threads (1: on the calling thread). The report is
    /// the same for any value: cases are merged in order, as one thread would have run them.
    pub jobs: usize,
    /// Which of the campaign's cases this run checks.
    pub shard: Shard,
}

/// One shard of a campaign: the cases whose index is `index` mod `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: u64,
    pub count: u64,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { index: 0, count: 1 }
    }
}

impl Shard {
    /// The campaign-wide index of this shard's `k`-th case.
    pub fn global(self, k: u64) -> u64 {
        self.index + k * self.count
    }

    /// Whether the campaign has several shards.
    pub fn is_split(self) -> bool {
        self.count > 1
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid shard {s:?} (expected I/N with 0 <= I < N, e.g. 2/8)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse::<u64>().map_err(|_| bad())?,
            n.trim().parse::<u64>().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// The seed of case `i` of a campaign.
pub fn case_seed(seed: u64, i: u64) -> u64 {
    Rng::new(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
}

/// Progress callback data.
pub struct Progress<'r> {
    pub report: &'r Report,
    pub fraction: Option<f64>,
}

/// One case, drawn, built and checked: the part of a campaign that may run on any thread.
struct Checked {
    case: Case,
    classes: Vec<&'static str>,
    run: CaseRun,
    stages: StageTimes,
}

impl Checked {
    /// Drops the tensors and outputs of a case that passed: the merge counts it by its
    /// config, layout and classes only, and what waits to be merged stays small.
    fn hollow(&mut self) {
        let empty = || ndarray::Array3::<f32>::zeros((0, 0, 0));
        (self.case.q, self.case.k, self.case.v) = (empty(), empty(), empty());
        if let Some(d) = self.case.d_o.as_mut() {
            *d = empty();
        }
        self.case.outputs = Default::default();
        self.run.outputs = Default::default();
    }
}

/// Cases a worker may run ahead of the merged ones, per job. The merge takes cases in order,
/// so one slow case (a long fallback sequence's f64 reference takes seconds) holds back every
/// later one: at 16 jobs and 4 ahead per job, 22 % of the job threads' time went to waiting
/// (bench/NOTES.md v21). Passing cases wait hollowed ([`Checked::hollow`]), so the bound is
/// what failing cases hold while the merging thread shrinks one.
const AHEAD_PER_JOB: u64 = 128;

impl Campaign<'_> {
    /// Runs until the budget is spent, `stop` is set, or (optionally) a failure.
    ///
    /// # Errors
    /// Infrastructure errors (cannot write the output directory, a case the harness cannot
    /// run), those of the lowest-numbered case first.
    pub fn run(&self, stop: &AtomicBool, progress: &mut dyn FnMut(Progress)) -> Result<Report> {
        let capsules = self.out.join("capsules");
        std::fs::create_dir_all(&capsules).map_err(|source| Error::Io {
            path: capsules.display().to_string(),
            source,
        })?;
        let mut merge = Merge {
            campaign: self,
            capsules,
            rep: self.empty_report(),
            margins: BTreeMap::new(),
            start: Instant::now(),
            stages: StageTimes::default(),
        };
        if self.jobs <= 1 {
            let mut i = 0;
            while !merge.halt_before(i, stop) {
                let checked = self.check_case(i);
                if !merge.take(i, checked, stop, progress)? {
                    break;
                }
                i += 1;
            }
        } else {
            self.run_parallel(&mut merge, stop, progress)?;
        }
        Ok(merge.finish())
    }

    /// Cases on `jobs` threads, merged in case order by [`in_order::run`]. A thread's panic is
    /// the error of its case. `stop` ends the campaign after the cases already started, as
    /// with one thread: a fault one of them met (a crash, a hang that took its timeout) has its
    /// capsule and failure like any other.
    fn run_parallel(
        &self,
        merge: &mut Merge,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<()> {
        // A time budget ends where threads stop starting cases, not where the merge stops
        // taking them: what finished by then (a fault's timeout included) is kept.
        let start = merge.start;
        let exists = |i| match self.budget {
            Budget::Cases(n) => self.shard.global(i) < n,
            Budget::Time(t) => start.elapsed() < t,
        };
        let work = |i| {
            catch_unwind(AssertUnwindSafe(|| self.check_case(i))).unwrap_or_else(|p| {
                Err(Error::Backend {
                    backend: self.checker.runner.name().into(),
                    detail: format!("case {i} panicked: {}", panic_text(p)),
                })
            })
        };
        let ahead = self.jobs as u64 * AHEAD_PER_JOB;
        let mut sink = InCaseOrder {
            merge,
            stop,
            progress,
        };
        if in_order::run(self.jobs, ahead, stop, &exists, &work, &mut sink)? {
            sink.merge.rep.interrupted = true;
        }
        Ok(())
    }

    /// This shard's case `k`: drawn (inside what the implementation computes), built and
    /// checked. A worker fault is rerun once on a fresh worker, to tell a deterministic fault
    /// from a flaky one.
    fn check_case(&self, k: u64) -> Result<Checked> {
        let (checked, stages) = stages::collect(|| self.check_case_unclocked(k));
        checked.map(|c| Checked { stages, ..c })
    }

    fn check_case_unclocked(&self, k: u64) -> Result<Checked> {
        let cs = case_seed(self.seed, self.shard.global(k));
        let (g, case) = stages::timed(Stage::Generation, || -> Result<_> {
            let mut rng = Rng::new(cs);
            let mut g = draw_geometry_for(&mut rng, self.checker.opts.profile);
            fit_to_caps(&mut g, self.checker.runner.caps(), &mut rng)?;
            let case = build(&g, cs ^ 0xda7a)?;
            Ok((g, case))
        })?;
        let mut run = self.checker.check(&case, cs)?;
        // A fault in this process (a GPU backend's lanes) has no fresh worker to rerun on:
        // its context is lost, and the campaign is stopping.
        let in_worker = self.checker.runner.worker_command().is_some();
        if run.fault.is_some() && in_worker {
            let again = self.checker.check(&case, cs)?;
            let how = match &again.fault {
                Some(f) => format!(
                    "deterministic: it {} again on a fresh worker",
                    f.kind.past()
                ),
                None => "flaky: the rerun on a fresh worker completed".into(),
            };
            for (_, o) in &mut run.outcomes {
                if let Outcome::Fail(f) = o {
                    f.detail = format!("{} ({how})", f.detail);
                }
            }
        }
        let classes = classify(&case, g.segments.is_some(), g.poison);
        let mut checked = Checked {
            case,
            classes,
            run,
            stages: StageTimes::default(),
        };
        if checked.run.failures().is_empty() {
            checked.hollow();
        }
        Ok(checked)
    }

    fn empty_report(&self) -> Report {
        Report {
            command: String::new(),
            commit: capsule::build_commit().map(String::from),
            budget: self.budget,
            jobs: self.jobs,
            partial: false,
            cases: 0,
            seed: self.seed,
            backend: self.checker.runner.name().into(),
            profile: self.checker.opts.profile.name().into(),
            elapsed_s: 0.0,
            cases_per_s: 0.0,
            properties: Prop::ALL
                .iter()
                .map(|p| (p.name().to_string(), Counts::default()))
                .collect(),
            skip_reasons: BTreeMap::new(),
            coverage: classes::ALL.iter().map(|c| (c.to_string(), 0)).collect(),
            paths: BTreeMap::new(),
            margins: BTreeMap::new(),
            blind_verdicts: BTreeMap::new(),
            indeterminate_verdicts: BTreeMap::new(),
            largest_margins: BTreeMap::new(),
            margin_histograms: BTreeMap::new(),
            failures: Vec::new(),
            range_limits: Vec::new(),
            interrupted: false,
            worker: self.checker.runner.worker_command().map(|c| c.join(" ")),
            not_covered: self.checker.runner.caps().not_covered(),
            protocol_overhead_us: None,
            shard: self.shard.is_split().then(|| self.shard.to_string()),
            margin_samples: BTreeMap::new(),
            dimensions: super::coverage::Coverage::new(self.checker.opts.profile),
            stages: BTreeMap::new(),
        }
    }
}

/// The report as cases are merged, in case order.
struct Merge<'c, 'a> {
    campaign: &'c Campaign<'a>,
    capsules: PathBuf,
    rep: Report,
    margins: BTreeMap<String, Vec<f64>>,
    start: Instant,
    stages: StageTimes,
}

impl Merge<'_, '_> {
    fn fraction(&self, i: u64) -> f64 {
        match self.campaign.budget {
            Budget::Cases(n) => self.campaign.shard.global(i) as f64 / n.max(1) as f64,
            Budget::Time(t) => self.start.elapsed().as_secs_f64() / t.as_secs_f64(),
        }
    }

    /// Whether the budget is spent before case `i`.
    fn spent_before(&self, i: u64) -> bool {
        match self.campaign.budget {
            Budget::Cases(n) => self.campaign.shard.global(i) >= n,
            Budget::Time(t) => self.start.elapsed() >= t,
        }
    }

    /// Whether the campaign ends before case `i` (budget spent, or `stop` set: then the
    /// report is marked interrupted).
    fn halt_before(&mut self, i: u64, stop: &AtomicBool) -> bool {
        let spent = self.spent_before(i);
        if !spent && stop.load(Ordering::SeqCst) {
            self.rep.interrupted = true;
            return true;
        }
        spent
    }

    /// Counts case `i`; on a failure writes its capsule, reports it, and shrinks it. Returns
    /// whether the campaign goes on.
    fn take(
        &mut self,
        i: u64,
        checked: Result<Checked>,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<bool> {
        let Checked {
            case,
            classes,
            run,
            stages,
        } = checked?;
        self.stages.absorb(&stages);
        let fraction = self.fraction(i);
        let local = i;
        let i = self.campaign.shard.global(i);
        let c = self.campaign;
        let be = c.checker.runner.as_ref();
        let rep = &mut self.rep;
        rep.dimensions.add(&case, &classes, run.path_fwd);
        rep.dimensions.add_regimes(&run.regimes);
        for class in classes {
            *rep.coverage.entry(class.into()).or_default() += 1;
        }
        let path = run.path_fwd.map_or("none", |p| p.name());
        *rep.paths.entry(path.into()).or_default() += 1;
        for (p, o) in &run.outcomes {
            let n = rep.properties.entry(p.name().into()).or_default();
            match o {
                Outcome::Pass => n.pass += 1,
                Outcome::Fail(f) if !f.is_defect() => n.range_limit += 1,
                Outcome::Fail(_) => n.fail += 1,
                Outcome::Skip { reason } => {
                    n.skip += 1;
                    *rep.skip_reasons
                        .entry(format!("{p}: {}", generic(reason)))
                        .or_default() += 1;
                }
            }
        }
        for j in &run.judgements {
            self.margins
                .entry(j.tensor.clone())
                .or_default()
                .push(j.margin);
            if j.margin.is_finite() {
                let at = MarginAt {
                    margin: j.margin,
                    case: i,
                };
                keep_largest_margin(&mut rep.largest_margins, &j.tensor, at);
            }
            if j.blind {
                *rep.blind_verdicts.entry(j.tensor.clone()).or_default() += 1;
            }
            if j.indeterminate {
                *rep.indeterminate_verdicts
                    .entry(j.tensor.clone())
                    .or_default() += 1;
            }
        }
        rep.cases = local + 1;
        let failures = run.failures();
        let defect = failures.iter().find(|f| f.is_defect());
        if let (None, Some(limit)) = (defect, failures.first()) {
            take_range_limit(c, &self.capsules, rep, (i, &case, &run), limit)?;
        } else if let Some(first) = defect {
            let capsule_start = Instant::now();
            let name = format!("case-{i:06}-{}.safetensors", first.prop);
            let cap = self.capsules.join(&name);
            // The capsule is on disk before anything reports the failure.
            let origin = capsule::Origin {
                campaign_seed: c.seed,
                case: i,
                jobs: c.jobs,
            };
            let salt = case_seed(c.seed, i);
            capsule::write(&cap, &case, &run, &c.checker, salt, Some(origin))?;
            let mut entry = FailureEntry {
                case: i,
                property: first.prop.name().into(),
                detail: first.detail.clone(),
                capsule: cap.display().to_string(),
                shrunk_capsule: None,
                shrunk_size: None,
                repro: repro_cmd(&cap, repro_backend(be), &rep.profile),
            };
            rep.failures.push(entry.clone());
            progress(Progress {
                report: rep,
                fraction: Some(fraction),
            });
            if !c.shrink_budget.is_zero() {
                let (small, steps) = shrink(&c.checker, &case, first.prop, c.shrink_budget, stop);
                // No step (nothing smaller fails, or `stop` came first): no second capsule.
                let srun = if steps > 0 {
                    c.checker.check(&small, 0).ok()
                } else {
                    None
                };
                if let Some(srun) = srun {
                    let scap = self
                        .capsules
                        .join(name.replace(".safetensors", "-shrunk.safetensors"));
                    // Shrinking checks with salt 0 (shrink.rs).
                    capsule::write(&scap, &small, &srun, &c.checker, 0, Some(origin))?;
                    let l = &small.layout;
                    let max_tok = (0..l.slots())
                        .map(|s| l.q.len(s).max(l.kv.len(s)))
                        .max()
                        .unwrap_or(0);
                    entry.shrunk_capsule = Some(scap.display().to_string());
                    entry.shrunk_size = Some(ShrunkSize {
                        slots: l.slots(),
                        max_tokens: max_tok,
                    });
                    entry.repro = repro_cmd(&scap, repro_backend(be), &rep.profile);
                    *rep.failures.last_mut().expect("just pushed") = entry;
                }
            }
            self.stages.add(Stage::Capsules, capsule_start.elapsed());
            if c.stop_on_failure {
                return Ok(false);
            }
        }
        rep.elapsed_s = self.start.elapsed().as_secs_f64();
        progress(Progress {
            report: rep,
            fraction: Some(fraction),
        });
        Ok(true)
    }

    fn finish(mut self) -> Report {
        self.rep.elapsed_s = self.start.elapsed().as_secs_f64();
        self.rep.cases_per_s = self.rep.cases as f64 / self.rep.elapsed_s.max(1e-9);
        self.rep.stages = super::profile::shares(&self.stages, self.rep.cases_per_s);
        self.rep.margin_histograms = (self.margins.iter())
            .map(|(k, v)| (k.clone(), super::histogram::Histogram::of(v)))
            .collect();
        self.rep.margins = self
            .margins
            .iter()
            .map(|(k, v)| (k.clone(), percentiles(v.clone())))
            .collect();
        self.rep.margin_samples = std::mem::take(&mut self.margins);
        let overhead = self.campaign.checker.runner.protocol_overhead_us();
        self.rep.protocol_overhead_us = (!overhead.is_empty()).then(|| percentiles(overhead));
        self.rep
    }
}

/// A case whose failures are all range limits: its capsule (no shrink: the case is
/// characterised, not reduced) and its entry among the range limits.
fn take_range_limit(
    c: &Campaign,
    capsules: &Path,
    rep: &mut Report,
    (i, case, run): (u64, &Case, &CaseRun),
    limit: &Failure,
) -> Result<()> {
    let cap = capsules.join(format!("case-{i:06}-range_limit.safetensors"));
    let origin = capsule::Origin {
        campaign_seed: c.seed,
        case: i,
        jobs: c.jobs,
    };
    capsule::write(
        &cap,
        case,
        run,
        &c.checker,
        case_seed(c.seed, i),
        Some(origin),
    )?;
    let be = c.checker.runner.as_ref();
    rep.range_limits.push(FailureEntry {
        case: i,
        property: limit.prop.name().into(),
        detail: limit.range_limit.clone().unwrap_or_default(),
        capsule: cap.display().to_string(),
        shrunk_capsule: None,
        shrunk_size: None,
        repro: repro_cmd(&cap, repro_backend(be), &rep.profile),
    });
    Ok(())
}

/// [`Merge`] as the merging side of [`in_order::run`], with what its `take` needs besides.
struct InCaseOrder<'m, 'c, 'a> {
    merge: &'m mut Merge<'c, 'a>,
    stop: &'m AtomicBool,
    progress: &'m mut dyn FnMut(Progress),
}

impl Merger<Result<Checked>> for InCaseOrder<'_, '_, '_> {
    fn spent_before(&self, i: u64) -> bool {
        // On several threads a time budget is spent where `exists` says so.
        matches!(self.merge.campaign.budget, Budget::Cases(_)) && self.merge.spent_before(i)
    }

    fn take(&mut self, i: u64, checked: Result<Checked>) -> Result<bool> {
        self.merge.take(i, checked, self.stop, self.progress)
    }

    fn waited(&mut self, total: Duration) {
        if !total.is_zero() {
            self.merge.stages.add(Stage::MergeWait, total);
        }
    }
}

/// Strips case-specific numbers from a skip reason so reasons aggregate.
fn generic(reason: &str) -> String {
    reason.split(':').next().unwrap_or(reason).to_string()
}

pub fn percentiles(mut v: Vec<f64>) -> Percentiles {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Percentiles {
        n: v.len(),
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: v.last().copied().unwrap_or(0.0),
    }
}

/// The backend a repro line names: `exec` for an implementation outside the tree, whose
/// worker command the capsule records ([`capsule::WORKER`]), else the runner's own name.
fn repro_backend(r: &dyn Runner) -> &str {
    if r.external() {
        "exec"
    } else {
        r.name()
    }
}

/// The one-line command that reproduces a capsule.
pub fn repro_cmd(capsule: &Path, backend: &str, profile: &str) -> String {
    let mut cmd = format!(
        "{} repro {} --backend {backend}",
        super::repro::program(),
        super::repro::shell_quote(&capsule.display().to_string())
    );
    if profile != "native" {
        cmd.push_str(&format!(" --profile {profile}"));
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_margin_keeps_the_earliest_case_of_equals_in_any_order() {
        let at = |margin, case| MarginAt { margin, case };
        let orders = [
            [at(0.3, 5), at(0.7, 9), at(0.7, 2), at(0.1, 1)],
            [at(0.7, 2), at(0.1, 1), at(0.3, 5), at(0.7, 9)],
        ];
        for order in orders {
            let mut m = BTreeMap::new();
            for a in order {
                keep_largest_margin(&mut m, "dk", a);
            }
            assert_eq!(m["dk"], at(0.7, 2));
        }
    }
}
