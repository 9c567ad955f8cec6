//! THD layout validation and the segment-id conversion.

use proptest::prelude::*;
use smallseq::harness::oracles::{self, Verdict};
use smallseq_proptests::strategies::{canonical_segment_ids, raw_sides, valid_layout};

proptest! {
    #![proptest_config(smallseq_proptests::config(file!()))]

    /// The validator accepts exactly what the spec allows and names a field when it does not.
    #[test]
    fn validation_matches_the_spec((q, kv) in raw_sides()) {
        oracles::layout_validation(&q, &kv).map_err(TestCaseError::fail)?;
    }

    /// Layouts built valid are accepted.
    #[test]
    fn valid_layouts_are_accepted(l in valid_layout(8, 20)) {
        prop_assert!(smallseq_reference::Layout::new(l.q.clone(), l.kv.clone()).is_ok());
        oracles::layout_validation(&l.q, &l.kv).map_err(TestCaseError::fail)?;
    }

    /// Canonical segment ids survive ids → layout → ids unchanged.
    #[test]
    fn segment_ids_round_trip((ids, max_segments) in canonical_segment_ids()) {
        prop_assert!(oracles::is_canonical(&ids, max_segments), "strategy built non-canonical ids {:?}", ids);
        let v = oracles::segment_round_trip(&ids, max_segments).map_err(TestCaseError::fail)?;
        prop_assert_eq!(v, Verdict::Checked);
    }
}
