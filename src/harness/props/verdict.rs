//! What a property says about a case, and everything one case's check learns. These are the
//! types the campaign counts, capsules record and the report names, so they sit at the bottom
//! of the properties: every property module returns them, none of them needs a property.

use crate::case::Outputs;
use crate::dispatch::Path;
use crate::harness::tolerance::{Judgement, Worst};
use crate::runner::Fault;
use serde::Serialize;
use std::fmt;

/// The named properties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prop {
    Eligibility,
    FallbackEquivalence,
    NumericAgreement,
    DontCare,
    Workspace,
    Determinism,
    Metamorphic,
    EmulationConformance,
    /// Issue 18: deviations from the emulation symmetric in sign (`super::bias`).
    RoundingBias,
    /// The worker process exited, was killed, broke the protocol or lost its device.
    Crash,
    /// The worker process did not answer within the case timeout.
    Hang,
}

impl Prop {
    pub const ALL: [Prop; 11] = [
        Prop::Eligibility,
        Prop::FallbackEquivalence,
        Prop::NumericAgreement,
        Prop::DontCare,
        Prop::Workspace,
        Prop::Determinism,
        Prop::Metamorphic,
        Prop::EmulationConformance,
        Prop::RoundingBias,
        Prop::Crash,
        Prop::Hang,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Prop::Eligibility => "eligibility",
            Prop::FallbackEquivalence => "fallback_equivalence",
            Prop::NumericAgreement => "numeric_agreement",
            Prop::DontCare => "dont_care",
            Prop::Workspace => "workspace",
            Prop::Determinism => "determinism",
            Prop::Metamorphic => "metamorphic",
            Prop::EmulationConformance => "emulation_conformance",
            Prop::RoundingBias => "rounding_bias",
            Prop::Crash => "crash",
            Prop::Hang => "hang",
        }
    }
}

impl fmt::Display for Prop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed property.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    pub prop: Prop,
    pub detail: String,
    pub worst: Option<Worst>,
    /// err / threshold for numeric failures; infinite for exact properties.
    pub margin: f64,
    /// Where the failure is wholly a range limit of a 16-bit design (`range_limit.rs`): what
    /// overflows, and from what inputs. Counted apart from defects.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub range_limit: Option<String>,
}

impl Failure {
    /// Whether this failure is a defect (not a characterised range limit).
    pub fn is_defect(&self) -> bool {
        self.range_limit.is_none()
    }
}

/// The outcome of one property on one case.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail(Failure),
    Skip { reason: String },
}

/// A failure of an exact property: no worst element, and a margin no tolerance can cover.
pub(crate) fn fail(prop: Prop, detail: impl Into<String>) -> Outcome {
    Outcome::Fail(Failure {
        prop,
        detail: detail.into(),
        worst: None,
        margin: f64::INFINITY,
        range_limit: None,
    })
}

pub(crate) fn skip(reason: impl Into<String>) -> Outcome {
    Outcome::Skip {
        reason: reason.into(),
    }
}

/// Everything learnt from one case.
#[derive(Clone, Debug)]
pub struct CaseRun {
    pub outcomes: Vec<(Prop, Outcome)>,
    pub judgements: Vec<Judgement>,
    /// The backend's outputs from the main run.
    pub outputs: Outputs,
    pub path_fwd: Option<Path>,
    pub path_bwd: Option<Path>,
    /// The worker fault that ended the case, with the worker's stderr tail.
    pub fault: Option<Fault>,
    /// The numeric regimes the case reaches (empty where it was not judged).
    pub regimes: Vec<&'static str>,
}

impl CaseRun {
    /// A case that ended before any output was judged: only `outcomes` to tell.
    pub(crate) fn unjudged(outcomes: Vec<(Prop, Outcome)>, fault: Option<Fault>) -> Self {
        CaseRun {
            outcomes,
            judgements: Vec::new(),
            outputs: Outputs::default(),
            path_fwd: None,
            path_bwd: None,
            fault,
            regimes: Vec::new(),
        }
    }

    pub fn failures(&self) -> Vec<&Failure> {
        self.outcomes
            .iter()
            .filter_map(|(_, o)| match o {
                Outcome::Fail(f) => Some(f),
                _ => None,
            })
            .collect()
    }
}
