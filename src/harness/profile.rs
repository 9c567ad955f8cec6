//! The campaign's stage profile (issue 32): what share of the cases' time each stage took and
//! how many cases a second the campaign would reach if that stage cost nothing. The clock is
//! [`crate::stages`]; this is the report's view of it.

use crate::stages::StageTimes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One stage over a campaign, in `report.json`'s `stages`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StageShare {
    /// Thread-seconds spent in the stage, over every case and every thread.
    pub seconds: f64,
    /// Times the stage was entered.
    pub entries: u64,
    /// `seconds` over the seconds of every stage.
    pub share: f64,
    /// The campaign's cases/s divided by `1 - share`: its rate if the stage cost nothing and
    /// the host's work were the limit. None where the stage took all the time.
    pub cases_per_s_if_free: Option<f64>,
}

/// The stages of `times` as report entries, for a campaign that ran at `cases_per_s`.
pub fn shares(times: &StageTimes, cases_per_s: f64) -> BTreeMap<String, StageShare> {
    let total = times.total().as_secs_f64();
    times
        .by_stage
        .iter()
        .map(|(stage, (d, n))| {
            let seconds = d.as_secs_f64();
            (stage.key(), share_of(seconds, *n, total, cases_per_s))
        })
        .collect()
}

fn share_of(seconds: f64, entries: u64, total: f64, cases_per_s: f64) -> StageShare {
    let share = if total > 0.0 { seconds / total } else { 0.0 };
    StageShare {
        seconds,
        entries,
        share,
        cases_per_s_if_free: (share < 1.0).then(|| cases_per_s / (1.0 - share)),
    }
}

/// Recomputes shares and rates after stages were summed (shards merged).
pub fn reshare(stages: &mut BTreeMap<String, StageShare>, cases_per_s: f64) {
    let total: f64 = stages.values().map(|s| s.seconds).sum();
    for s in stages.values_mut() {
        *s = share_of(s.seconds, s.entries, total, cases_per_s);
    }
}

/// Adds `from`'s seconds and entries into `into` (shares are stale until [`reshare`]).
pub fn add(into: &mut BTreeMap<String, StageShare>, from: &BTreeMap<String, StageShare>) {
    for (k, s) in from {
        let t = into.entry(k.clone()).or_default();
        t.seconds += s.seconds;
        t.entries += s.entries;
    }
}

/// `summary.md`'s table, largest share first; empty without stages.
pub fn markdown(stages: &BTreeMap<String, StageShare>) -> String {
    if stages.is_empty() {
        return String::new();
    }
    let mut rows: Vec<_> = stages.iter().collect();
    rows.sort_by(|a, b| b.1.share.total_cmp(&a.1.share).then(a.0.cmp(b.0)));
    let mut m = String::from(
        "Where the cases' time went (thread-seconds per stage; the rate if that stage cost \
         nothing):\n\n| stage | seconds | share | entries | cases/s if free |\n|---|---:|---:|---:|---:|\n",
    );
    for (k, s) in rows {
        let free = s
            .cases_per_s_if_free
            .map_or_else(|| "unbounded".to_string(), |r| format!("{r:.1}"));
        m.push_str(&format!(
            "| {k} | {:.2} | {:.1} % | {} | {free} |\n",
            s.seconds,
            100.0 * s.share,
            s.entries
        ));
    }
    m.push('\n');
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stages::Stage;
    use std::time::Duration;

    #[test]
    fn a_stage_of_a_quarter_of_the_time_frees_a_third_more_cases() {
        let mut t = StageTimes::default();
        t.add(Stage::Reference, Duration::from_millis(250));
        t.add(Stage::Backend, Duration::from_millis(750));
        let s = shares(&t, 30.0);
        assert!((s["reference"].share - 0.25).abs() < 1e-12);
        assert!((s["reference"].cases_per_s_if_free.unwrap() - 40.0).abs() < 1e-9);
        assert_eq!(s["backend"].entries, 1);
        let mut merged = s.clone();
        add(&mut merged, &s);
        reshare(&mut merged, 60.0);
        assert!((merged["backend"].seconds - 1.5).abs() < 1e-12);
        assert!((merged["backend"].share - 0.75).abs() < 1e-12);
        let md = markdown(&merged);
        let backend = md.find("| backend").unwrap();
        assert!(backend < md.find("| reference").unwrap(), "{md}");
    }
}
