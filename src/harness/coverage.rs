//! Coverage that says what was not tried: per dimension of the case model (dtype, heads, GQA
//! group, head dims, mask, window, layout, slot counts, length classes, data, dropout, path, and the
//! head counts and dims that reached the small-seq path), the values a campaign drew and how
//! often, and every value the backend's surface admits that it never drew.
//!
//! Unbounded dimensions are bucketed (`17-32` heads), so "admitted" is a finite list: the
//! buckets every backend runs (the fallback takes any geometry of `semantics.md` §1), and for
//! the small-seq dimensions the values the profile's gate admits (native: any head count,
//! D ∈ {64, 128, 256}; te625: H ∈ {16, 32}, D ∈ {128, 256}).

use crate::backend::launch::dims_of;
use crate::case::Case;
use crate::dispatch::{Path, Profile};
use crate::segments::{self, Segmented};
use serde::{Deserialize, Serialize};
use smallseq_reference::{Dtype, Mask, Window};
use std::collections::BTreeMap;

/// One dimension: every value drawn with its count, and the admitted values never drawn.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Dimension {
    pub hit: BTreeMap<String, u64>,
    pub not_drawn: Vec<String>,
}

/// `report.json`'s `dimensions`: one [`Dimension`] per name.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Coverage(pub BTreeMap<String, Dimension>);

const HEAD_BUCKETS: [&str; 9] = ["1", "2", "3", "4", "5-8", "9-16", "17-32", "33-64", "65+"];
const GROUP_BUCKETS: [&str; 6] = ["1", "2", "3", "4", "5-8", "9-16"];
const DIMS: [&str; 8] = ["16", "32", "64", "128", "192", "256", "512", "other"];
const SLOTS: [&str; 5] = ["0", "1", "2-4", "5-16", "17+"];
const LENGTHS: [&str; 11] = [
    "0",
    "1",
    "2-14",
    "15",
    "16",
    "17",
    "18",
    "19-30",
    "32k",
    "32k±1",
    "other 33+",
];
const WINDOWS: [&str; 4] = ["none", "left", "right", "both"];
const LAYOUTS: [&str; 4] = ["thd_packed", "thd_padded", "thd_segments", "bshd"];
const DISTS: [&str; 5] = ["randn", "small_ints", "spiky", "near_tie", "large"];
const DATA: [&str; 6] = [
    "plain",
    "max_on_tile_edge",
    "exp_overflow_row",
    "near_tie_on_edge",
    "dov_max_on_edge",
    "bwd_range_stress",
];
const PATHS: [&str; 2] = ["small_seq", "fallback"];
/// Which small-seq kernels a case's launch takes (`src/backend/gpu/plan.rs`): the general ones,
/// or the `_q1` ones of launches whose slots all hold at most one query.
const SMALL_SEQ_KERNELS: [&str; 2] = ["general", "one_query"];
/// What the segment ids of a case that carries them ask of the conversion.
const SEGMENT_IDS: [&str; 6] = [
    "full_row",
    "empty_row",
    "pad_between",
    "adjacent",
    "unused_slots",
    "seq_q_ne_kv",
];
/// Dropout's probabilities as the generator draws them (`gen::DROPOUT_P`); `0` is p = 0 with
/// a seed or an offset, `none` neither.
const DROPOUTS: [&str; 6] = ["none", "0", "0.1", "0.5", "0.9", "1"];

fn dropout(d: &smallseq_reference::Dropout) -> String {
    if d.p == 0.0 && (d.seed, d.offset) == (0, 0) {
        return "none".into();
    }
    let name = d.p.to_string();
    if DROPOUTS.contains(&name.as_str()) {
        name
    } else {
        "other".into()
    }
}
/// The bias types of §1.9 as the generator draws them (`score_bias::draw_kind`), the
/// post-scale bias by broadcast shape.
const BIASES: [&str; 7] = [
    "none",
    "post_scale_1hss",
    "post_scale_11ss",
    "post_scale_b1ss",
    "post_scale_bhss",
    "alibi",
    "other",
];

fn bias(b: &crate::config::Bias) -> String {
    use crate::config::Bias;
    match b {
        Bias::None => "none".into(),
        Bias::PostScale(s) => format!("post_scale_{}", s.name()),
        Bias::Alibi => "alibi".into(),
        Bias::Other(_) => "other".into(),
    }
}

/// What a post-scale bias's entries hold where the slots read them: `-inf` on some keys, on
/// every key of some row (which then has no visible key), and `+inf` or NaN where no slot
/// reads (which must be ignored).
const BIAS_ENTRIES: [&str; 4] = ["finite", "neg_inf_key", "neg_inf_row", "unread_non_finite"];

fn bias_entries(case: &Case) -> Vec<&'static str> {
    let p = &case.config.params;
    let smallseq_reference::AttnBias::PostScale(t) = &p.bias else {
        return Vec::new();
    };
    let rows: Vec<(crate::case::VisibleRow, bool)> = case
        .visible_rows()
        .map(|r| {
            let lk = case.layout.kv.len(r.slot);
            let lq = case.layout.q.len(r.slot);
            let hidden = (0..lk).any(|c| {
                smallseq_reference::visible(p.mask, p.window, r.row, c, lq, lk)
                    && p.bias.at(r.slot, r.head, r.row, c, lq, lk) == f64::NEG_INFINITY
            });
            (r, hidden)
        })
        .collect();
    let mut out = Vec::new();
    if rows.iter().any(|(r, hidden)| *hidden && !r.keys.is_empty()) {
        out.push("neg_inf_key");
    }
    if rows.iter().any(|(r, hidden)| *hidden && r.keys.is_empty()) {
        out.push("neg_inf_row");
    }
    if t.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        out.push("unread_non_finite");
    }
    if out.is_empty() {
        out.push("finite");
    }
    out
}

/// `props::numeric_regimes`' values.
const REGIMES: [&str; 4] = [
    "in_range",
    "output_past_limit",
    "output_subnormal",
    "ds_past_range",
];

fn heads(n: usize) -> String {
    bucket(
        n,
        &[
            (5, 8, "5-8"),
            (9, 16, "9-16"),
            (17, 32, "17-32"),
            (33, 64, "33-64"),
        ],
    )
    .unwrap_or_else(|| if n > 64 { "65+".into() } else { n.to_string() })
}

fn bucket(n: usize, ranges: &[(usize, usize, &str)]) -> Option<String> {
    ranges
        .iter()
        .find(|(lo, hi, _)| (*lo..=*hi).contains(&n))
        .map(|(_, _, name)| name.to_string())
}

fn dim(d: usize) -> String {
    if DIMS.contains(&d.to_string().as_str()) {
        d.to_string()
    } else {
        "other".into()
    }
}

/// A slot length's bucket: the small-seq tile edges one by one, and past 31 the fallback's
/// (a multiple of 32, `32k`; one either side of it, `32k±1`).
fn length(l: usize) -> String {
    match l {
        2..=14 => "2-14".into(),
        19..=30 => "19-30".into(),
        _ if l < 19 => l.to_string(),
        _ if l.is_multiple_of(32) => "32k".into(),
        _ if l % 32 == 1 || l % 32 == 31 => "32k±1".into(),
        _ => "other 33+".into(),
    }
}

/// The [`SEGMENT_IDS`] values a case's ids reach.
fn segment_values(s: &Segmented) -> Vec<&'static str> {
    let ids = &s.ids;
    let rows = |v: &[i32], seq: usize| -> Vec<Vec<i32>> {
        v.chunks(seq.max(1)).map(<[i32]>::to_vec).collect()
    };
    let (rq, rk) = (rows(&ids.ids_q, ids.seq_q), rows(&ids.ids_kv, ids.seq_kv));
    let count = |row: &Vec<i32>| row.iter().copied().max().unwrap_or(0).max(0) as usize;
    let both = || rq.iter().chain(rk.iter());
    let used: usize = rq.iter().map(count).sum();
    let mut out = Vec::new();
    let mut tag = |name: &'static str, hit: bool| {
        if hit {
            out.push(name);
        }
    };
    tag("full_row", rq.iter().any(|r| count(r) == s.max_segments));
    tag("empty_row", rq.iter().any(|r| count(r) == 0));
    tag(
        "pad_between",
        both().any(|r| {
            let first = r.iter().position(|&x| x != 0);
            let last = r.iter().rposition(|&x| x != 0);
            matches!((first, last), (Some(a), Some(b)) if r[a..b].contains(&0))
        }),
    );
    tag(
        "adjacent",
        both().any(|r| r.windows(2).any(|w| w[0] != 0 && w[1] != 0 && w[0] != w[1])),
    );
    tag("unused_slots", used < ids.batch * s.max_segments);
    tag("seq_q_ne_kv", ids.seq_q != ids.seq_kv);
    out
}

fn window(w: Window) -> &'static str {
    match (w == Window::NONE, w.left >= 0, w.right >= 0) {
        (true, ..) => "none",
        (false, true, true) => "both",
        (false, true, false) => "left",
        _ => "right",
    }
}

impl Coverage {
    /// Every dimension with its admitted values at zero, for a campaign under `profile` (every
    /// backend admits the same general surface; the profile sets the small-seq gate's).
    pub fn new(profile: Profile) -> Self {
        let (ss_heads, ss_dims): (&[&str], &[&str]) = match profile {
            Profile::Native => (&HEAD_BUCKETS, &["64", "128", "256"]),
            Profile::Te625 => (&["9-16", "17-32"], &["128", "256"]),
        };
        let mask_names: Vec<&str> = Mask::ALL.iter().map(|m| m.name()).collect();
        let dims: [(&'static str, &[&str]); 24] = [
            ("dtype", &["bf16", "f16", "f32"]),
            ("heads", &HEAD_BUCKETS),
            ("kv_heads", &HEAD_BUCKETS),
            ("group", &GROUP_BUCKETS),
            ("head_dim", &DIMS),
            ("head_dim_v", &DIMS),
            ("mask", &mask_names),
            ("window", &WINDOWS),
            ("layout", &LAYOUTS),
            ("slots", &SLOTS),
            ("len_q", &LENGTHS),
            ("len_kv", &LENGTHS),
            ("dist", &DISTS),
            ("data_class", &DATA),
            ("backward", &["yes", "no"]),
            ("dropout", &DROPOUTS),
            ("bias", &BIASES),
            ("bias_entries", &BIAS_ENTRIES),
            ("path", &PATHS),
            ("small_seq_heads", ss_heads),
            ("small_seq_head_dim", ss_dims),
            ("small_seq_kernels", &SMALL_SEQ_KERNELS),
            ("numeric_regime", &REGIMES),
            ("segment_ids", &SEGMENT_IDS),
        ];
        Coverage(
            dims.into_iter()
                .map(|(name, values)| {
                    let d = Dimension {
                        hit: values.iter().map(|v| (v.to_string(), 0)).collect(),
                        not_drawn: values.iter().map(|v| v.to_string()).collect(),
                    };
                    (name.to_string(), d)
                })
                .collect(),
        )
    }

    fn count(&mut self, dimension: &str, value: &str) {
        let d = match self.0.get_mut(dimension) {
            Some(d) => d,
            None => self.0.entry(dimension.to_string()).or_default(),
        };
        *d.hit.entry(value.to_string()).or_default() += 1;
        d.not_drawn.retain(|v| v != value);
    }

    /// Counts one case: its geometry, its coverage `classes` (for segment layouts) and the
    /// forward's path (None: not run).
    pub fn add(&mut self, case: &Case, classes: &[&str], path: Option<Path>) {
        let p = &case.config.params;
        let l = &case.layout;
        let dtype = match case.config.dtype {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        };
        self.count("dtype", dtype);
        self.count("heads", &heads(p.num_heads));
        self.count("kv_heads", &heads(p.num_kv_heads));
        self.count("group", &heads(p.num_heads / p.num_kv_heads.max(1)));
        self.count("head_dim", &dim(p.head_dim_qk));
        self.count("head_dim_v", &dim(p.head_dim_v));
        self.count("mask", p.mask.name());
        self.count("window", window(p.window));
        let layout = if case.config.layout == crate::config::LayoutKind::Bshd {
            "bshd"
        } else if classes.contains(&"segment_split") {
            "thd_segments"
        } else if l.q.padded.is_some() || l.kv.padded.is_some() {
            "thd_padded"
        } else {
            "thd_packed"
        };
        self.count("layout", layout);
        let b = l.slots();
        self.count(
            "slots",
            &bucket(b, &[(2, 4, "2-4"), (5, 16, "5-16")]).unwrap_or_else(|| {
                if b > 16 {
                    "17+".into()
                } else {
                    b.to_string()
                }
            }),
        );
        for (name, side) in [("len_q", &l.q), ("len_kv", &l.kv)] {
            let mut seen: Vec<String> = (0..b).map(|i| length(side.len(i))).collect();
            seen.sort();
            seen.dedup();
            seen.iter().for_each(|v| self.count(name, v));
        }
        let meta = |k: &str, default: &str| case.meta.get(k).cloned().unwrap_or(default.into());
        self.count("dist", &meta("smallseq.dist", "randn"));
        self.count("data_class", &meta("smallseq.data_class", "plain"));
        self.count("backward", if case.d_o.is_some() { "yes" } else { "no" });
        self.count("dropout", &dropout(&p.dropout));
        self.count("bias", &bias(&case.config.bias));
        bias_entries(case)
            .into_iter()
            .for_each(|v| self.count("bias_entries", v));
        self.count("path", path.map_or("none", |p| p.name()));
        if path == Some(Path::SmallSeq) {
            self.count("small_seq_heads", &heads(p.num_heads));
            self.count("small_seq_head_dim", &dim(p.head_dim_qk));
            let one = dims_of(&case.config, l, false).one_query();
            self.count("small_seq_kernels", SMALL_SEQ_KERNELS[usize::from(one)]);
        }
        let ids = case.meta.get(segments::META_KEY);
        if let Some(s) = ids.and_then(|t| Segmented::from_meta(t).ok()) {
            segment_values(&s)
                .into_iter()
                .for_each(|v| self.count("segment_ids", v));
        }
    }

    /// Counts the numeric regimes a judged case reached (none for a case that was not judged:
    /// a fault, a skip).
    pub fn add_regimes(&mut self, regimes: &[&str]) {
        regimes.iter().for_each(|r| self.count("numeric_regime", r));
    }

    /// Every admitted value never drawn, as `(dimension, value)`.
    pub fn gaps(&self) -> Vec<(&str, &str)> {
        self.0
            .iter()
            .flat_map(|(d, v)| v.not_drawn.iter().map(move |x| (d.as_str(), x.as_str())))
            .collect()
    }

    /// Adds `other`'s counts (another shard of the same campaign): a value admitted by either
    /// stays a gap only where neither drew it.
    pub fn merge(&mut self, other: &Coverage) {
        for (name, o) in &other.0 {
            let d = self.0.entry(name.clone()).or_default();
            for (v, n) in &o.hit {
                *d.hit.entry(v.clone()).or_default() += n;
            }
            for v in &o.not_drawn {
                if !d.not_drawn.contains(v) {
                    d.not_drawn.push(v.clone());
                }
            }
            let hit = &d.hit;
            d.not_drawn
                .retain(|v| hit.get(v).copied().unwrap_or(0) == 0);
        }
    }

    /// Markdown for `summary.md`: the gaps first, then each dimension's counts.
    pub fn markdown(&self) -> String {
        let gaps = self.gaps();
        let mut m = if gaps.is_empty() {
            "Every admitted value of every dimension was drawn.\n\n".to_string()
        } else {
            let mut by_dim: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (d, v) in gaps {
                by_dim.entry(d).or_default().push(v);
            }
            let mut m = String::from("**Not tried** (admitted, never drawn):\n\n");
            for (d, vs) in by_dim {
                m.push_str(&format!("- {d}: {}\n", vs.join(", ")));
            }
            m.push('\n');
            m
        };
        m.push_str("| dimension | values drawn (cases) |\n|---|---|\n");
        for (d, v) in &self.0 {
            let drawn: Vec<String> = v
                .hit
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(|(x, n)| format!("{x} {n}"))
                .collect();
            m.push_str(&format!("| {d} | {} |\n", drawn.join(", ")));
        }
        m.push('\n');
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::gen::{build, draw_geometry_for};
    use crate::harness::rng::Rng;

    fn campaign(profile: Profile, n: u64) -> Coverage {
        let mut c = Coverage::new(profile);
        for i in 0..n {
            let g = draw_geometry_for(&mut Rng::new(i), profile);
            let case = build(&g, i).unwrap();
            let classes = crate::harness::classes::classify(&case, g.segments.is_some(), g.poison);
            c.add(&case, &classes, None);
        }
        c
    }

    #[test]
    fn an_admitted_value_never_drawn_is_flagged_and_shown_first() {
        let mut c = campaign(Profile::Native, 300);
        // No case was run, so no path and no small-seq head count was drawn.
        let gaps = c.gaps();
        assert!(gaps.contains(&("path", "small_seq")));
        assert!(gaps.contains(&("small_seq_head_dim", "256")));
        assert!(!gaps.iter().any(|(d, _)| *d == "dtype"));
        // Every dropout probability the generator draws, both extremes included.
        assert!(!gaps.iter().any(|(d, _)| *d == "dropout"), "{gaps:?}");
        let md = c.markdown();
        assert!(md.starts_with("**Not tried**"));
        assert!(md.contains("- path: small_seq, fallback\n"));
        let case = build(&draw_geometry_for(&mut Rng::new(3), Profile::Native), 3).unwrap();
        c.add(&case, &[], Some(Path::Fallback));
        assert!(!c.gaps().contains(&("path", "fallback")));
        assert_eq!(c.0["path"].hit["fallback"], 1);
    }

    #[test]
    fn merged_shards_sum_counts_and_keep_only_common_gaps() {
        let mut a = Coverage::new(Profile::Native);
        let mut b = Coverage::new(Profile::Native);
        let case = build(&draw_geometry_for(&mut Rng::new(3), Profile::Native), 3).unwrap();
        a.add(&case, &[], Some(Path::Fallback));
        a.add(&case, &[], Some(Path::Fallback));
        b.add(&case, &[], Some(Path::SmallSeq));
        let dtype = a.0["dtype"]
            .hit
            .iter()
            .find(|(_, n)| **n > 0)
            .map(|(v, _)| v.clone())
            .unwrap();
        let mut m = a.clone();
        m.merge(&b);
        assert_eq!(m.0["path"].hit["fallback"], 2);
        assert_eq!(m.0["path"].hit["small_seq"], 1);
        assert_eq!(m.0["dtype"].hit[&dtype], 3);
        assert!(!m.gaps().contains(&("path", "small_seq")));
        assert!(!m.gaps().contains(&("path", "fallback")));
        // Drawn by neither shard: still a gap, listed once.
        let never: Vec<_> = a.0["dtype"].not_drawn.clone();
        assert_eq!(m.0["dtype"].not_drawn, never);
        // A report read back keeps the same coverage.
        let back: Coverage = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        // Merging into an empty one (a report written before issue 18) is the other's copy.
        let mut e = Coverage::default();
        e.merge(&m);
        assert_eq!(e, m);
    }

    /// A small-seq case counts the kernels its launch takes: the `_q1` ones where every slot
    /// holds at most one query, the general ones once a slot holds two.
    #[test]
    fn small_seq_cases_count_their_kernels() {
        let mut c = Coverage::new(Profile::Native);
        let mut case = build(&draw_geometry_for(&mut Rng::new(3), Profile::Native), 3).unwrap();
        case.layout = smallseq_reference::Layout::packed(&[(1, 5), (0, 2), (1, 17)]);
        c.add(&case, &[], Some(Path::SmallSeq));
        c.add(&case, &[], Some(Path::Fallback));
        case.layout = smallseq_reference::Layout::packed(&[(1, 5), (2, 2)]);
        c.add(&case, &[], Some(Path::SmallSeq));
        let k = &c.0["small_seq_kernels"];
        assert_eq!((k.hit["one_query"], k.hit["general"]), (1, 1));
        assert!(k.not_drawn.is_empty());
    }

    #[test]
    fn numeric_regimes_are_counted_per_judged_case() {
        let mut c = Coverage::new(Profile::Native);
        assert_eq!(c.0["numeric_regime"].not_drawn, REGIMES);
        // A judged case of ordinary data is in range; the oracle says which regimes a case
        // reaches.
        let case = build(&draw_geometry_for(&mut Rng::new(3), Profile::Native), 3).unwrap();
        let y = crate::harness::props::oracle(&case).unwrap();
        c.add_regimes(&y.regimes);
        c.add_regimes(&["output_past_limit", "ds_past_range"]);
        c.add_regimes(&[]);
        let d = &c.0["numeric_regime"];
        assert_eq!(d.hit.values().sum::<u64>(), y.regimes.len() as u64 + 2);
        assert_eq!(d.hit["ds_past_range"], 1);
        assert!(!c.gaps().contains(&("numeric_regime", "ds_past_range")));
    }

    #[test]
    fn the_profile_sets_the_small_seq_surface() {
        let c = Coverage::new(Profile::Te625);
        assert_eq!(c.0["small_seq_head_dim"].not_drawn, ["128", "256"]);
        assert_eq!(heads(48), "33-64");
        assert_eq!(heads(3), "3");
        assert_eq!(heads(200), "65+");
        assert_eq!(length(17), "17");
        assert_eq!(length(30), "19-30");
        assert_eq!(length(31), "32k±1");
        assert_eq!(length(64), "32k");
        assert_eq!(length(129), "32k±1");
        assert_eq!(length(40), "other 33+");
        assert_eq!(dim(96), "other");
    }
}
