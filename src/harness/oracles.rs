//! The checks shared by the proptest suites and the cargo-fuzz targets: one oracle per area, so
//! a bug found by either tool is judged by the same code (and a fuzz crash replays as a
//! proptest and the other way round).
//! The oracle over the whole property suite, which needs the properties and the capsules
//! above these, is [`super::backend_oracle`].
//!
//! Each check returns `Ok(Verdict)` when the input was checked or is outside the area's domain
//! (with a reason the caller counts), and `Err(violation)` when the code under test broke a
//! rule. Checks never panic on their own; a panic inside one is a bug in the code under test.

use crate::case::Case;
use crate::case_file::{case_bytes, parse_case, OutputPrecision};
use crate::config::AttnConfig;
use crate::dispatch::gate::Dispatcher;
use crate::dispatch::{surface, Path, RuntimeFacts, StaticFacts};
use crate::segments::SegmentIds;
use crate::workspace::{self, Direction, Shape, ALIGN};
use smallseq_reference::{Layout, Side};

/// What happened to one input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Checked; every rule held.
    Checked,
    /// Outside the check's domain, for this reason (counted by the callers).
    Rejected(&'static str),
}

/// A broken rule, described for the failure report.
pub type Violation = String;

/// `Layout::new` accepts exactly the layouts `docs/semantics.md` §1.1 allows, its errors name a field,
/// and an accepted layout's derived views are consistent.
pub fn layout_validation(q: &Side, kv: &Side) -> Result<Verdict, Violation> {
    let got = Layout::new(q.clone(), kv.clone());
    let want = spec_layout_ok(q, kv);
    match (&got, want) {
        (Ok(_), Err(why)) => Err(format!("accepted a layout the spec rejects: {why}")),
        (Err(e), Ok(())) => Err(format!("rejected a valid layout: {e}")),
        (Err(e), Err(_)) => {
            let msg = e.to_string();
            let names = ["cu_seqlens_q", "cu_seqlens_kv"];
            if names.iter().any(|n| msg.contains(n)) {
                Ok(Verdict::Checked)
            } else {
                Err(format!("error names no field: {msg}"))
            }
        }
        (Ok(l), Ok(())) => accepted_layout_consistent(l),
    }
}

/// The `docs/semantics.md` §1.1 rules, restated without sharing code with the validator.
fn spec_layout_ok(q: &Side, kv: &Side) -> Result<(), String> {
    let n = q.cu.len();
    if n == 0 {
        return Err("cu_seqlens_q is empty".into());
    }
    for (name, s) in [("q", q), ("kv", kv)] {
        let mut arrays = vec![(&s.cu, true)];
        if let Some(p) = &s.padded {
            arrays.push((p, false));
        }
        for (a, must_start_at_zero) in arrays {
            if a.len() != n {
                return Err(format!(
                    "{name}: an offsets array has length {} != {n}",
                    a.len()
                ));
            }
            if a[0] < 0 || (must_start_at_zero && a[0] != 0) {
                return Err(format!("{name}: bad first element {}", a[0]));
            }
            if a.windows(2).any(|w| w[1] < w[0]) {
                return Err(format!("{name}: decreasing offsets"));
            }
        }
        let off = s.padded.as_ref().unwrap_or(&s.cu);
        for i in 0..n - 1 {
            let len = i64::from(s.cu[i + 1]) - i64::from(s.cu[i]);
            let span = i64::from(off[i + 1]) - i64::from(off[i]);
            if len > span {
                return Err(format!("{name}: slot {i} length {len} > span {span}"));
            }
        }
        if i64::from(off[n - 1]) > s.tokens as i64 {
            return Err(format!("{name}: last offset past the buffer"));
        }
    }
    Ok(())
}

fn accepted_layout_consistent(l: &Layout) -> Result<Verdict, Violation> {
    for (name, s) in [("q", &l.q), ("kv", &l.kv)] {
        let valid = s.valid_tokens();
        let total: usize = (0..s.slots()).map(|i| s.len(i)).sum();
        let marked = valid.iter().filter(|v| **v).count();
        if marked != total {
            return Err(format!(
                "{name}: {marked} tokens marked valid, lengths sum to {total} (slots overlap)"
            ));
        }
        if s.max_len() > s.max_span() {
            return Err(format!(
                "{name}: max length {} > max span {}",
                s.max_len(),
                s.max_span()
            ));
        }
    }
    Ok(Verdict::Checked)
}

/// Segment ids → layout → ids: the conversion never panics, its layouts validate, and
/// canonical ids (every segment paired, at most `max_segments` per row, contiguous runs
/// numbered in order) survive a round trip unchanged. Other ids may be cleaned by the first
/// round (TE drops unpaired and surplus segments, and compaction can move slots between
/// rows); whenever the cleaned ids are canonical, they too must survive.
pub fn segment_round_trip(ids: &SegmentIds, max_segments: usize) -> Result<Verdict, Violation> {
    if max_segments == 0 || max_segments > 64 {
        return Ok(Verdict::Rejected("max_segments outside 1..=64"));
    }
    let Some(back) = round_trip(ids, max_segments)? else {
        return Ok(Verdict::Checked);
    };
    if is_canonical(ids, max_segments) && (back.ids_q != ids.ids_q || back.ids_kv != ids.ids_kv) {
        return Err(format!(
            "canonical ids changed by a round trip: q {:?} -> {:?}, kv {:?} -> {:?}",
            ids.ids_q, back.ids_q, ids.ids_kv, back.ids_kv
        ));
    }
    if is_canonical(&back, max_segments) {
        match round_trip(&back, max_segments)? {
            Some(again) if again == back => {}
            Some(again) => {
                return Err(format!(
                    "cleaned canonical ids changed again: q {:?} -> {:?}",
                    back.ids_q, again.ids_q
                ))
            }
            None => return Err("cleaned canonical ids no longer convert".into()),
        }
    }
    Ok(Verdict::Checked)
}

/// `to_layout` then `from_layout`; `None` when either declines the input with an error.
fn round_trip(ids: &SegmentIds, max_segments: usize) -> Result<Option<SegmentIds>, Violation> {
    let Ok(layout) = ids.to_layout(max_segments) else {
        return Ok(None);
    };
    Layout::new(layout.q.clone(), layout.kv.clone())
        .map_err(|e| format!("to_layout returned an invalid layout: {e}"))?;
    Ok(SegmentIds::from_layout(&layout, ids.batch, ids.seq_q, ids.seq_kv).ok())
}

/// Contiguous runs numbered 1, 2, … per row, at most `max_segments`, each id on both sides.
pub fn is_canonical(ids: &SegmentIds, max_segments: usize) -> bool {
    let rows = |v: &[i32], seq: usize| -> Option<Vec<Vec<i32>>> {
        (0..ids.batch)
            .map(|r| {
                let row = &v[r * seq..(r + 1) * seq];
                let mut seen = Vec::new();
                for (s, &id) in row.iter().enumerate() {
                    let starts = id != 0 && (s == 0 || row[s - 1] != id);
                    if starts {
                        if seen.contains(&id) || id != seen.len() as i32 + 1 {
                            return None;
                        }
                        seen.push(id);
                    }
                }
                Some(seen)
            })
            .collect()
    };
    match (rows(&ids.ids_q, ids.seq_q), rows(&ids.ids_kv, ids.seq_kv)) {
        (Some(q), Some(kv)) => q
            .iter()
            .zip(&kv)
            .all(|(a, b)| a == b && a.len() <= max_segments),
        _ => false,
    }
}

/// The dispatcher's decision equals the surface's rule table, path and reason codes. The
/// gate decides from the production extraction of lengths and spans ([`RuntimeFacts::new`]);
/// the rule table is evaluated on [`facts_by_hand`], extracted again from the raw
/// `cu_seqlens` arrays, so a wrong extraction disagrees with the table instead of feeding
/// both sides the same wrong facts.
pub fn dispatch_agrees(
    d: &Dispatcher,
    config: &AttnConfig,
    layout: &Layout,
) -> Result<Verdict, Violation> {
    gate_agrees_with_table(d, config, layout, &RuntimeFacts::new(config.layout, layout))
}

/// [`dispatch_agrees`] with the gate given `gate_facts`.
fn gate_agrees_with_table(
    d: &Dispatcher,
    config: &AttnConfig,
    layout: &Layout,
    gate_facts: &RuntimeFacts,
) -> Result<Verdict, Violation> {
    let plan = d.plan(config);
    let got = d.decide(&plan, gate_facts);
    let facts = StaticFacts {
        config,
        env: &d.env,
        arch: &d.arch,
        backend_has_kernel: d.backend_has_kernel,
    };
    let want = surface::evaluate(
        d.profile,
        &facts,
        Some(&facts_by_hand(config.layout, layout)),
    );
    let mut want_codes: Vec<_> = want.iter().map(|r| r.code.name()).collect();
    want_codes.sort_unstable();
    let mut got_codes: Vec<_> = got.codes().iter().map(|c| c.name()).collect();
    got_codes.sort_unstable();
    let want_path = if want.is_empty() {
        Path::SmallSeq
    } else {
        Path::Fallback
    };
    if got.path != want_path || got_codes != want_codes {
        return Err(format!(
            "dispatcher chose {} [{}], the {} surface says {} [{}]",
            got.path,
            got_codes.join(", "),
            d.profile,
            want_path,
            want_codes.join(", ")
        ));
    }
    Ok(Verdict::Checked)
}

/// The launch facts of `layout`, read straight off the `cu_seqlens` and padded-offset arrays
/// with plain loops (semantics.md: `L_i = cu[i+1] - cu[i]`, `span_i = off[i+1] - off[i]`),
/// sharing no code with [`RuntimeFacts::new`].
pub fn facts_by_hand(kind: crate::config::LayoutKind, layout: &Layout) -> RuntimeFacts {
    let diffs = |a: &[i32]| -> Vec<usize> {
        let mut out = Vec::new();
        for w in a.windows(2) {
            out.push(usize::try_from(w[1] - w[0]).unwrap_or(0));
        }
        out
    };
    let lens_q = diffs(&layout.q.cu);
    let lens_kv = diffs(&layout.kv.cu);
    let spans_q = diffs(layout.q.padded.as_deref().unwrap_or(&layout.q.cu));
    let spans_kv = diffs(layout.kv.padded.as_deref().unwrap_or(&layout.kv.cu));
    let max = |v: &[usize]| v.iter().copied().fold(0, usize::max);
    let bshd = (kind == crate::config::LayoutKind::Bshd).then(|| {
        // Every slot s tokens long, s apart, on both sides; otherwise not BSHD: (0, 0).
        let uniform = |lens: &[usize], spans: &[usize], offs: &[i32]| {
            let s = lens.first().copied().unwrap_or(0);
            let ok = lens.iter().zip(spans).enumerate().all(|(i, (&l, &sp))| {
                l == s && sp == s && usize::try_from(offs[i]).ok() == Some(i * s)
            });
            ok.then_some(s)
        };
        let oq = layout.q.padded.as_deref().unwrap_or(&layout.q.cu);
        let ok = layout.kv.padded.as_deref().unwrap_or(&layout.kv.cu);
        match (
            uniform(&lens_q, &spans_q, oq),
            uniform(&lens_kv, &spans_kv, ok),
        ) {
            (Some(a), Some(b)) => (a, b),
            _ => (0, 0),
        }
    });
    RuntimeFacts {
        layout: kind,
        slots: lens_q.len(),
        all_q_empty: lens_q.iter().all(|&l| l == 0),
        max_len_q: max(&lens_q),
        max_len_kv: max(&lens_kv),
        max_span_q: max(&spans_q),
        max_span_kv: max(&spans_kv),
        bshd,
    }
}

/// Largest buffer (elements) the planner check accepts, so sizes cannot overflow `usize`.
const MAX_PLAN_ELEMENTS: u128 = 1 << 40;

/// Plans are aligned, disjoint, inside their total, sized as the spec says, and never above
/// the trace-time bound.
pub fn workspace_plan(s: &Shape) -> Result<Verdict, Violation> {
    if s.tq_addressed > s.tq {
        return Ok(Verdict::Rejected("addressed tokens past the q buffer"));
    }
    let widest = [s.tq, s.tk].into_iter().max().unwrap_or(0) as u128
        * s.heads.max(s.kv_heads) as u128
        * (s.head_dim_qk.max(s.head_dim_v) as u128 + 1);
    if widest > MAX_PLAN_ELEMENTS {
        return Ok(Verdict::Rejected("shape too large to plan"));
    }
    for dir in [Direction::Fwd, Direction::Bwd] {
        let bound = workspace::trace_time_bound(dir, s);
        for path in [None, Some(Path::SmallSeq), Some(Path::Fallback)] {
            let p = workspace::plan(dir, path, s);
            let ctx = format!("{dir:?} {path:?}");
            let mut end = 0;
            for r in &p.regions {
                if r.offset % ALIGN != 0 {
                    return Err(format!(
                        "{ctx}: region {} at unaligned {}",
                        r.name, r.offset
                    ));
                }
                if r.offset < end {
                    return Err(format!("{ctx}: region {} overlaps its predecessor", r.name));
                }
                end = r.offset + r.len;
            }
            if end != p.total {
                return Err(format!("{ctx}: regions end at {end}, total is {}", p.total));
            }
            if p.total > bound {
                return Err(format!(
                    "{ctx}: total {} > trace-time bound {bound}",
                    p.total
                ));
            }
            expected_regions(dir, path, s, &p).map_err(|e| format!("{ctx}: {e}"))?;
        }
    }
    Ok(Verdict::Checked)
}

fn expected_regions(
    dir: Direction,
    path: Option<Path>,
    s: &Shape,
    p: &workspace::Plan,
) -> Result<(), String> {
    use workspace::names::{DELTA, DK_ACC, DV_ACC, PROBE};
    let has = |n: &str| p.region(n).map(|r| r.len);
    let want_probe = (path == Some(Path::SmallSeq) && s.thd).then_some(2);
    let want_delta = (path.is_some() && dir == Direction::Bwd).then_some(s.tq_addressed * s.heads);
    let gqa_acc = path == Some(Path::Fallback) && dir == Direction::Bwd && s.heads != s.kv_heads;
    let checks = [
        (PROBE, want_probe),
        (DELTA, want_delta),
        (DK_ACC, gqa_acc.then_some(s.tk * s.heads * s.head_dim_qk)),
        (DV_ACC, gqa_acc.then_some(s.tk * s.heads * s.head_dim_v)),
    ];
    for (name, want) in checks {
        if has(name) != want {
            return Err(format!(
                "region {name}: planned {:?}, expected {want:?}",
                has(name)
            ));
        }
    }
    Ok(())
}

/// Parsing arbitrary bytes as a case file never panics; a file that parses writes back and
/// re-parses to the same case, bit for bit.
pub fn case_file_round_trip(bytes: &[u8]) -> Result<Verdict, Violation> {
    let Ok(case) = parse_case(bytes, "fuzz input") else {
        return Ok(Verdict::Checked);
    };
    let written = case_bytes(&case, OutputPrecision::Reference)
        .map_err(|e| format!("a parsed case does not write back: {e}"))?;
    let again = parse_case(&written, "rewritten")
        .map_err(|e| format!("rewritten case does not parse: {e}"))?;
    if again.config != case.config || again.layout != case.layout {
        return Err("config or layout changed by a write/parse round trip".into());
    }
    let bits = |c: &Case| -> Vec<u32> {
        c.inputs()
            .iter()
            .flat_map(|(_, t)| t.iter().map(|x| x.to_bits()))
            .collect()
    };
    if bits(&again) != bits(&case) {
        return Err("an input tensor changed by a write/parse round trip".into());
    }
    Ok(Verdict::Checked)
}

/// A config parses or fails with a typed error; one that parses prints back to JSON that
/// parses to the same config.
pub fn config_round_trip(text: &str) -> Result<Verdict, Violation> {
    let Ok(c) = AttnConfig::from_json(text) else {
        return Ok(Verdict::Checked);
    };
    let printed = c.to_json();
    match AttnConfig::from_json(&printed) {
        Ok(again) if again == c => Ok(Verdict::Checked),
        Ok(again) => Err(format!("{printed} parses to {again:?}, not {c:?}")),
        Err(e) => Err(format!("printed config {printed} does not parse: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::wrapper::{dispatcher, RunOptions};
    use smallseq_reference::{Dtype, Mask};

    /// Two slots of 17 queries and keys, the second padded to a span of 20.
    fn padded_layout() -> Layout {
        let side = || Side {
            cu: vec![0, 17, 34],
            padded: Some(vec![0, 17, 37]),
            tokens: 37,
        };
        Layout::new(side(), side()).unwrap()
    }

    #[test]
    fn the_hand_extraction_equals_the_production_one() {
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 64, Mask::Padding);
        for layout in [
            padded_layout(),
            Layout::packed(&[(3, 5), (0, 2), (17, 17)]),
            Layout::packed(&[]),
        ] {
            assert_eq!(
                facts_by_hand(cfg.layout, &layout),
                RuntimeFacts::new(cfg.layout, &layout)
            );
        }
    }

    #[test]
    fn a_wrong_extraction_for_the_gate_disagrees_with_the_table() {
        let be = CpuBackend::default();
        let opts = RunOptions {
            env: crate::dispatch::EnvView::default(),
            ..RunOptions::default()
        };
        let d = dispatcher(&be, &opts);
        let cfg = AttnConfig::new(Dtype::Bf16, 1, 64, Mask::Padding);
        let layout = padded_layout();
        let right = RuntimeFacts::new(cfg.layout, &layout);
        assert_eq!(dispatch_agrees(&d, &cfg, &layout), Ok(Verdict::Checked));
        // Spans read as lengths (20 > 17): the gate falls back, the table says small-seq.
        let spans_as_lengths = RuntimeFacts {
            max_len_q: right.max_span_q,
            max_len_kv: right.max_span_kv,
            ..right
        };
        let err = gate_agrees_with_table(&d, &cfg, &layout, &spans_as_lengths).unwrap_err();
        assert!(err.contains("dispatcher chose fallback"), "{err}");
    }
}
