//! The dispatcher the wrappers call: a static decision when the plan is made, a runtime one
//! when the layout is known at launch.

use super::facts::{Arch, EnvView, RuntimeFacts};
use super::{Code, Decision, Profile, Reason};
use crate::config::{AttnConfig, Bias};
use smallseq_reference::{Dtype, Mask, Window};

/// Small-seq capacity per side (tokens); 17 is TE's `kSmallSeqMaxSeqlen`.
pub const MAX_SMALL_SEQ: usize = 17;

/// The dispatcher for one profile, device and environment snapshot.
#[derive(Clone, Debug)]
pub struct Dispatcher {
    pub profile: Profile,
    pub arch: Arch,
    pub env: EnvView,
    /// Whether the backend has a small-seq kernel for `arch`.
    pub backend_has_kernel: bool,
    /// Planted gate defects (mutation testing); empty in production.
    pub defects: GateDefects,
}

/// Gate mutants: each flag plants one known-wrong rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateDefects {
    /// Use this length limit instead of 17.
    pub max_len: Option<usize>,
    /// Accept GQA/MQA.
    pub accept_gqa: bool,
    /// Gate on the padded span instead of the actual length (native profile).
    pub span_as_length: bool,
    /// Launch a kernel even when the batch is empty.
    pub launch_on_empty: bool,
    /// Carve the launch-time plan out of a workspace sized with the trace-time environment,
    /// instead of refusing when they differ.
    pub carve_unsized: bool,
}

/// The plan-time half of a decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticDecision {
    pub reasons: Vec<Reason>,
}

fn reason(code: Code, detail: String) -> Reason {
    Reason { code, detail }
}

impl Dispatcher {
    /// Decides everything the config, environment and device determine.
    pub fn plan(&self, c: &AttnConfig) -> StaticDecision {
        let p = &c.params;
        let mut out = Vec::new();
        let te = self.profile == Profile::Te625;
        if te {
            match self.env.get("NVTE_FUSED_ATTN_CK_SMALLSEQ") {
                Some("1") => {}
                Some(v) => out.push(reason(
                    Code::Env,
                    format!("NVTE_FUSED_ATTN_CK_SMALLSEQ = '{v}'"),
                )),
                None => out.push(reason(
                    Code::Env,
                    "NVTE_FUSED_ATTN_CK_SMALLSEQ unset".into(),
                )),
            }
            if self.arch.name() != "gfx942" {
                out.push(reason(
                    Code::Arch,
                    format!("TE #625 runs small-seq on gfx942 only, not {}", self.arch),
                ));
            }
        } else {
            match self.env.get("SMALLSEQ_FORCE_FALLBACK") {
                None | Some("0") => {}
                Some(v) => out.push(reason(
                    Code::Env,
                    format!("SMALLSEQ_FORCE_FALLBACK = '{v}' forces the fallback"),
                )),
            }
            if !self.backend_has_kernel {
                out.push(reason(
                    Code::Arch,
                    format!("backend has no small-seq kernel for {}", self.arch),
                ));
            }
        }
        let dtype_ok = match c.dtype {
            Dtype::Bf16 => true,
            Dtype::F16 => !te,
            Dtype::F32 => false,
        };
        if !dtype_ok {
            out.push(reason(
                Code::Dtype,
                format!("dtype {} has no small-seq kernel", c.dtype),
            ));
        }
        if c.dropout_p() != 0.0 {
            out.push(reason(
                Code::Dropout,
                format!("dropout {} > 0", c.dropout_p()),
            ));
        }
        if c.bias != Bias::None {
            out.push(reason(Code::Bias, format!("bias {}", c.bias)));
        }
        let dims: &[usize] = if te { &[128, 256] } else { &[64, 128, 256] };
        if p.head_dim_qk != p.head_dim_v || !dims.contains(&p.head_dim_qk) {
            out.push(reason(
                Code::HeadDim,
                format!(
                    "head_dim_qk {} / head_dim_v {} not a supported equal pair ({})",
                    p.head_dim_qk,
                    p.head_dim_v,
                    dims.iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if p.num_heads != p.num_kv_heads && !self.defects.accept_gqa {
            out.push(reason(
                Code::Gqa,
                format!(
                    "GQA/MQA ({} heads, {} kv heads)",
                    p.num_heads, p.num_kv_heads
                ),
            ));
        }
        if te && p.num_heads != 16 && p.num_heads != 32 {
            out.push(reason(
                Code::NumHeads,
                format!("{} heads (TE takes 16 or 32)", p.num_heads),
            ));
        }
        if te && !(p.mask == Mask::NoMask || p.mask.is_padding_class()) {
            out.push(reason(
                Code::Mask,
                format!("mask {} is not no_mask or padding-class", p.mask),
            ));
        }
        if !te && p.window != Window::NONE {
            out.push(reason(
                Code::Window,
                format!("window ({}, {})", p.window.left, p.window.right),
            ));
        }
        StaticDecision { reasons: out }
    }

    /// Completes a decision once the layout is known.
    pub fn decide(&self, plan: &StaticDecision, r: &RuntimeFacts) -> Decision {
        let mut out = plan.reasons.clone();
        let te = self.profile == Profile::Te625;
        let limit = self.defects.max_len.unwrap_or(MAX_SMALL_SEQ);
        let (lo, q, kv) = match r.bshd {
            Some((sq, skv)) => {
                if sq != skv {
                    out.push(reason(
                        Code::Layout,
                        format!("bshd with s_q {sq} != s_kv {skv}"),
                    ));
                }
                (if te { 2 } else { 1 }, sq, skv)
            }
            None if te || self.defects.span_as_length => (1, r.max_span_q, r.max_span_kv),
            None => (1, r.max_len_q, r.max_len_kv),
        };
        if q < lo || q > limit {
            out.push(reason(
                Code::SeqlenQ,
                format!("q extent {q} outside [{lo}, {limit}]"),
            ));
        }
        if kv < lo || kv > limit {
            out.push(reason(
                Code::SeqlenKv,
                format!("kv extent {kv} outside [{lo}, {limit}]"),
            ));
        }
        let empty = r.slots == 0 || (!te && r.all_q_empty);
        if empty {
            out.push(reason(
                Code::EmptyBatch,
                format!("{} slots, no query rows", r.slots),
            ));
        }
        Decision::from_reasons(self.profile, out)
    }
}
