//! `eligibility`, the path property: the dispatcher's choice of path (small-seq or fallback)
//! and its reason codes equal the surface's rule table for the case. Judged from the
//! decision alone, before anything runs, by the oracle the proptests and fuzz targets share.

use super::checker::Checker;
use super::verdict::{fail, skip, Outcome, Prop};
use crate::case::Case;
use crate::harness::oracles;

impl Checker<'_> {
    pub(super) fn eligibility(&self, case: &Case) -> Outcome {
        let Some(d) = self.runner.dispatcher(&self.opts) else {
            return skip("the implementation's dispatch cannot be predicted (no path reported)");
        };
        match oracles::dispatch_agrees(&d, &case.config, &case.layout) {
            Ok(_) => Outcome::Pass,
            Err(why) => fail(Prop::Eligibility, why),
        }
    }
}
