//! Segment ids inside the campaign (issue 35, item 4): the generator draws JAX-style segment
//! ids for a share of its THD cases, the case carries them, the launch takes the offsets
//! converted from them, and the judges keep the case's own layout. So the conversion is on
//! trial in every campaign, and a slip in it fails `numeric_agreement`.

use smallseq::backend::cpu::CpuBackend;
use smallseq::case_file::{input_bytes, parse_case};
use smallseq::dispatch::Profile;
use smallseq::harness::campaign::{case_seed, Budget, Campaign, Report};
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::Checker;
use smallseq::harness::rng::Rng;
use smallseq::mutants::{Defects, Mutant};
use smallseq::segments::{Segmented, META_KEY};
use smallseq::wrapper::launched;
use std::borrow::Cow;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// The first `n` cases of a campaign of `seed` that carry segment ids, as the campaign draws
/// them.
fn segment_cases(seed: u64, n: usize) -> Vec<smallseq::case::Case> {
    (0..20_000)
        .filter_map(|i| {
            let cs = case_seed(seed, i);
            let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
            g.segments
                .is_some()
                .then(|| build(&g, cs ^ 0xda7a).unwrap())
        })
        .take(n)
        .collect()
}

#[test]
fn the_launch_takes_the_offsets_converted_from_the_ids_and_they_round_trip() {
    let cases = segment_cases(1, 200);
    assert_eq!(cases.len(), 200);
    let clean = CpuBackend::default();
    let slipped = CpuBackend::mutant(Defects::of(&[Mutant::SegmentConversionSlip]));
    let mut differs = 0;
    for case in &cases {
        let ids = Segmented::from_meta(&case.meta[META_KEY]).unwrap();
        assert!(ids.describes(&case.layout), "{case:?}");
        // The conversion on the way to the kernels gives back the case's own layout...
        match launched(&clean, case).unwrap() {
            Cow::Owned(l) => assert_eq!(l.layout, case.layout, "{case:?}"),
            Cow::Borrowed(_) => panic!("segment ids not converted: {case:?}"),
        }
        // ...and a worker request carries the ids, so a worker's launch converts them too.
        let sent = parse_case(&input_bytes(case).unwrap(), "request").unwrap();
        assert_eq!(sent.meta.get(META_KEY), case.meta.get(META_KEY));
        // The planted slip moves the offsets of every case with a full row (or fails).
        if launched(&slipped, case).map_or(true, |l| l.layout != case.layout) {
            differs += 1;
        }
    }
    assert!(
        differs > 50,
        "the slip changed only {differs} of 200 launches"
    );
}

#[test]
fn stale_or_missing_ids_leave_the_layout_alone_and_malformed_ones_are_errors() {
    let be = CpuBackend::default();
    let mut case = segment_cases(2, 1).remove(0);
    // A layout changed after drawing (a shrink step, a relation): its ids no longer describe
    // it, so the launch takes the case's layout as it is.
    let mut changed = case.clone();
    changed.layout = smallseq::reference::Layout::packed(&[(2, 3)]);
    assert!(matches!(launched(&be, &changed).unwrap(), Cow::Borrowed(_)));
    case.meta
        .insert(META_KEY.into(), "{\"max_segments\": 2}".into());
    let e = launched(&be, &case).unwrap_err().to_string();
    assert!(e.contains(META_KEY), "{e}");
    case.meta.remove(META_KEY);
    assert!(matches!(launched(&be, &case).unwrap(), Cow::Borrowed(_)));
}

fn campaign(be: &CpuBackend, cases: u64, stop_on_failure: bool, tag: &str) -> Report {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-segments-{tag}-{}", std::process::id()));
    let rep = Campaign {
        checker: Checker::isolated(be),
        seed: 1,
        budget: Budget::Cases(cases),
        out: out.clone(),
        shrink_budget: Duration::ZERO,
        stop_on_failure,
        jobs: 2,
        shard: Default::default(),
    }
    .run(&AtomicBool::new(false), &mut |_| {})
    .expect("campaign runs");
    let _ = std::fs::remove_dir_all(&out);
    rep
}

#[test]
fn a_segment_conversion_slip_fails_numeric_agreement_in_a_small_campaign() {
    let be = CpuBackend::mutant(Defects::of(&[Mutant::SegmentConversionSlip]));
    let rep = campaign(&be, 150, true, "slip");
    let f = rep.failures.first().expect("the slip survived 150 cases");
    assert_eq!(f.property, "numeric_agreement", "{}", f.detail);
    // The case that failed is one of those drawn as segment ids.
    let cs = case_seed(1, f.case);
    let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
    assert!(g.segments.is_some(), "case {} has no segment ids", f.case);
}

#[test]
fn a_clean_campaign_draws_segment_ids_and_passes() {
    let rep = campaign(&CpuBackend::default(), 120, false, "clean");
    assert!(rep.failures.is_empty(), "{:?}", rep.failures);
    assert!(rep.coverage["segment_split"] > 0, "{:?}", rep.coverage);
    let dim = &rep.dimensions.0["segment_ids"];
    assert!(dim.hit["full_row"] > 0, "{dim:?}");
    assert_eq!(
        rep.dimensions.0["layout"].hit["thd_segments"],
        rep.coverage["segment_split"]
    );
}
