//! Coverage classes: the places bugs live, tagged per case and counted in reports.

use super::data_class::DataClass;
use super::gen::has_dont_care;
use crate::case::Case;
use smallseq_reference::{Dtype, Window};

/// Every class name, in report order: the geometry's, then the data classes
/// ([`DataClass::SHAPED`]) and production head counts (issue 18).
pub const ALL: [&str; 24] = [
    "batch0",
    "empty_slot",
    "trailing_unused",
    "segment_split",
    "pad_between",
    "len16",
    "len17",
    "len18",
    "len_fallback_tile_edge",
    "span18_len_le17",
    "cross_q1",
    "q_gt_kv",
    "gqa_mismatch",
    "unsupported_dim",
    "unsupported_dtype",
    "causal",
    "window",
    "poison",
    "max_on_tile_edge",
    "exp_overflow_row",
    "near_tie_on_edge",
    "dov_max_on_edge",
    "bwd_range_stress",
    "heads_gt16",
];

/// The classes a case hits. `segment_split` and `poison` come from how it was generated.
pub fn classify(case: &Case, segment_split: bool, poisoned: bool) -> Vec<&'static str> {
    let l = &case.layout;
    let p = &case.config.params;
    let b = l.slots();
    let lens: Vec<(usize, usize)> = (0..b).map(|i| (l.q.len(i), l.kv.len(i))).collect();
    let trailing = b > 0 && lens.last() == Some(&(0, 0));
    let mut c = Vec::new();
    let mut tag = |name: &'static str, hit: bool| {
        if hit {
            c.push(name);
        }
    };
    tag("batch0", b == 0);
    let body = if trailing {
        &lens[..lens.iter().rposition(|x| *x != (0, 0)).map_or(0, |i| i + 1)]
    } else {
        &lens[..]
    };
    tag("empty_slot", body.iter().any(|&(q, k)| q == 0 || k == 0));
    tag("trailing_unused", trailing);
    tag("segment_split", segment_split);
    tag(
        "pad_between",
        (0..b).any(|i| l.q.span(i) > l.q.len(i) || l.kv.span(i) > l.kv.len(i)),
    );
    for (name, n) in [("len16", 16), ("len17", 17), ("len18", 18)] {
        tag(name, lens.iter().any(|&(q, k)| q == n || k == n));
    }
    let on_tile_edge = |n: usize| super::gen::FALLBACK_TILE_EDGES.contains(&n);
    tag(
        "len_fallback_tile_edge",
        lens.iter()
            .any(|&(q, k)| on_tile_edge(q) || on_tile_edge(k)),
    );
    tag(
        "span18_len_le17",
        (l.q.max_span() >= 18 && l.q.max_len() <= 17)
            || (l.kv.max_span() >= 18 && l.kv.max_len() <= 17),
    );
    tag("cross_q1", lens.iter().any(|&(q, k)| q == 1 && k > 1));
    tag("q_gt_kv", lens.iter().any(|&(q, k)| k > 0 && q > k));
    tag("gqa_mismatch", p.num_heads != p.num_kv_heads);
    tag(
        "unsupported_dim",
        p.head_dim_qk != p.head_dim_v || ![64, 128, 256].contains(&p.head_dim_qk),
    );
    tag("unsupported_dtype", case.config.dtype == Dtype::F32);
    tag("causal", p.mask.causal().is_some());
    tag("window", p.window != Window::NONE);
    tag("poison", poisoned && has_dont_care(case));
    let data = case.meta.get("smallseq.data_class");
    for class in DataClass::SHAPED {
        tag(class.name(), data.is_some_and(|d| d == class.name()));
    }
    tag("heads_gt16", p.num_heads > 16);
    c
}
