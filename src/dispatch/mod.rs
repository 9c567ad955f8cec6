//! When the small-seq path is taken (`docs/semantics.md` §3).
//!
//! Two independent encodings of the same rules live here on purpose: [`surface`] holds each
//! profile as a table of rules (the oracle the harness trusts), and [`gate`] is the dispatcher
//! the wrappers call, written as production code is. The `eligibility` property checks that
//! they agree.

pub mod facts;
pub mod gate;
pub mod surface;

pub use facts::{Arch, EnvView, RuntimeFacts, StaticFacts};
pub use gate::Dispatcher;

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A dispatch profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Profile {
    /// This project's own dispatcher and kernels.
    Native,
    /// What ROCm TransformerEngine PR #625 does (for testing TE).
    Te625,
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Native => "native",
            Profile::Te625 => "te625",
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(Profile::Native),
            "te625" => Ok(Profile::Te625),
            _ => Err(format!("unknown profile '{s}' (expected native or te625)")),
        }
    }
}

/// The variable that switches TE's small-seq path on.
pub const TE_SWITCH: &str = "NVTE_FUSED_ATTN_CK_SMALLSEQ";

/// Fills in what `profile` needs and `env` leaves unset: under `te625`, TE's small-seq path is
/// off unless [`TE_SWITCH`] is "1", and a campaign against it without the variable would only
/// ever test the fallback, so it defaults to "1". Returns the `NAME=VALUE` pairs it set.
pub fn apply_profile_defaults(profile: Profile, env: &mut EnvView) -> Vec<String> {
    if profile == Profile::Te625 && env.get(TE_SWITCH).is_none() {
        env.set(TE_SWITCH, Some("1"));
        return vec![format!("{TE_SWITCH}=1")];
    }
    Vec::new()
}

/// Which kernel family runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    SmallSeq,
    Fallback,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::SmallSeq => "small_seq",
            Path::Fallback => "fallback",
        }
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Stable reason codes, one per rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Env,
    Arch,
    Dtype,
    Dropout,
    Bias,
    HeadDim,
    Gqa,
    NumHeads,
    Mask,
    Window,
    Layout,
    SeqlenQ,
    SeqlenKv,
    EmptyBatch,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Env => "env",
            Code::Arch => "arch",
            Code::Dtype => "dtype",
            Code::Dropout => "dropout",
            Code::Bias => "bias",
            Code::HeadDim => "head_dim",
            Code::Gqa => "gqa",
            Code::NumHeads => "num_heads",
            Code::Mask => "mask",
            Code::Window => "window",
            Code::Layout => "layout",
            Code::SeqlenQ => "seqlen_q",
            Code::SeqlenKv => "seqlen_kv",
            Code::EmptyBatch => "empty_batch",
        }
    }
}

/// One failed rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reason {
    pub code: Code,
    pub detail: String,
}

/// The outcome of dispatch: which path, and every rule that failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub path: Path,
    pub profile: &'static str,
    pub reasons: Vec<Reason>,
}

impl Decision {
    /// A decision from failed rules: small-seq iff none failed.
    pub fn from_reasons(profile: Profile, mut reasons: Vec<Reason>) -> Self {
        reasons.sort_by_key(|r| r.code);
        Decision {
            path: if reasons.is_empty() {
                Path::SmallSeq
            } else {
                Path::Fallback
            },
            profile: profile.name(),
            reasons,
        }
    }

    /// The sorted reason codes.
    pub fn codes(&self) -> Vec<Code> {
        self.reasons.iter().map(|r| r.code).collect()
    }

    /// Whether no kernel needs to run (`b = 0` or every slot has `Lq = 0`).
    pub fn is_empty_batch(&self) -> bool {
        self.codes().contains(&Code::EmptyBatch)
    }

    /// The `--json` form: exactly one object.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("decision serialises")
    }
}
