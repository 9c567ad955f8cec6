//! Both dispatch surfaces: the dispatcher against the rule tables, and the workspace planner.

use proptest::prelude::*;
use smallseq::dispatch::gate::Dispatcher;
use smallseq::harness::oracles;
use smallseq_proptests::strategies::{config, dispatch_env, layout_for, shape};

proptest! {
    #![proptest_config(smallseq_proptests::config(file!()))]

    /// Path and reason codes equal the surface's rule table, for both profiles.
    #[test]
    fn dispatcher_matches_the_surface(
        (c, layout) in config().prop_flat_map(|c| { let k = c.layout; (Just(c), layout_for(k)) }),
        (env, arch, profile, has_kernel) in dispatch_env(),
    ) {
        let d = Dispatcher { profile, arch, env, backend_has_kernel: has_kernel, defects: Default::default() };
        oracles::dispatch_agrees(&d, &c, &layout).map_err(TestCaseError::fail)?;
    }

    /// Plans are aligned, disjoint, sized as the spec says and within the trace-time bound.
    #[test]
    fn workspace_plans_hold(s in shape()) {
        oracles::workspace_plan(&s).map_err(TestCaseError::fail)?;
    }
}
