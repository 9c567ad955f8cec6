//! The dispatch surfaces of `docs/semantics.md` §3 as data: one table of rules per profile.
//!
//! This is the oracle. It is deliberately written as a flat list, one rule per reason code,
//! without sharing code with [`super::gate`].

use super::facts::{RuntimeFacts, StaticFacts};
use super::{Code, Profile, Reason};
use crate::config::Bias;
use smallseq_reference::{Dtype, Mask};

/// When a rule can be decided.
#[derive(Clone, Copy)]
pub enum Check {
    /// From the config, environment and device (plan time).
    Static(fn(&StaticFacts) -> Option<String>),
    /// From the layout (launch time).
    Runtime(fn(&RuntimeFacts) -> Option<String>),
}

/// One rule: passes when its check returns `None`, otherwise the detail says why not.
#[derive(Clone, Copy)]
pub struct Rule {
    pub code: Code,
    /// The rule in words, as `docs/semantics.md` §3 states it.
    pub text: &'static str,
    pub check: Check,
}

/// Architectures this project ships a small-seq kernel for.
pub const NATIVE_ARCHES: [&str; 9] = [
    "cpu", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "gfx90a", "gfx942", "gfx950",
];

fn fail(ok: bool, detail: impl FnOnce() -> String) -> Option<String> {
    (!ok).then(detail)
}

/// Rule `Dropout`, identical in both profiles.
const DROPOUT: Rule = Rule {
    code: Code::Dropout,
    text: "dropout 0",
    check: Check::Static(|f| {
        fail(f.config.dropout_p() == 0.0, || {
            format!("dropout = {}", f.config.dropout_p())
        })
    }),
};

/// Rule `Bias`, identical in both profiles.
const BIAS: Rule = Rule {
    code: Code::Bias,
    text: "bias none",
    check: Check::Static(|f| {
        fail(f.config.bias == Bias::None, || {
            format!("bias = {}", f.config.bias)
        })
    }),
};

/// Rule `Gqa`, identical in both profiles.
const GQA: Rule = Rule {
    code: Code::Gqa,
    text: "num_heads == num_gqa_groups",
    check: Check::Static(|f| {
        let p = &f.config.params;
        fail(p.num_heads == p.num_kv_heads, || {
            format!(
                "num_heads = {} != num_gqa_groups = {}",
                p.num_heads, p.num_kv_heads
            )
        })
    }),
};

/// Rule `Layout`, identical in both profiles.
const LAYOUT: Rule = Rule {
    code: Code::Layout,
    text: "THD, or BSHD with s_q == s_kv",
    check: Check::Runtime(|r| match r.bshd {
        Some((sq, skv)) => fail(sq == skv, || format!("bshd s_q = {sq} != s_kv = {skv}")),
        None => None,
    }),
};

/// Profile `native`.
pub static NATIVE: [Rule; 14] = [
    Rule {
        code: Code::Env,
        text: "SMALLSEQ_FORCE_FALLBACK unset or \"0\"",
        check: Check::Static(|f| {
            let v = f.env.get("SMALLSEQ_FORCE_FALLBACK");
            fail(v.is_none() || v == Some("0"), || {
                format!("SMALLSEQ_FORCE_FALLBACK = '{}'", v.unwrap_or_default())
            })
        }),
    },
    Rule {
        code: Code::Arch,
        text: "the backend has a small-seq kernel for the device",
        check: Check::Static(|f| {
            fail(
                f.backend_has_kernel && NATIVE_ARCHES.contains(&f.arch.name()),
                || format!("no small-seq kernel for arch {}", f.arch),
            )
        }),
    },
    Rule {
        code: Code::Dtype,
        text: "dtype bf16 or f16",
        check: Check::Static(|f| {
            fail(matches!(f.config.dtype, Dtype::Bf16 | Dtype::F16), || {
                format!("dtype {} (small-seq takes bf16, f16)", f.config.dtype)
            })
        }),
    },
    DROPOUT,
    BIAS,
    Rule {
        code: Code::HeadDim,
        text: "head_dim_qk == head_dim_v in {64, 128, 256}",
        check: Check::Static(|f| {
            let p = &f.config.params;
            fail(
                p.head_dim_qk == p.head_dim_v && [64, 128, 256].contains(&p.head_dim_qk),
                || {
                    format!(
                        "head dims qk = {}, v = {} (need equal, in 64/128/256)",
                        p.head_dim_qk, p.head_dim_v
                    )
                },
            )
        }),
    },
    GQA,
    Rule {
        code: Code::NumHeads,
        text: "num_heads >= 1",
        check: Check::Static(|f| fail(f.config.params.num_heads >= 1, || "num_heads = 0".into())),
    },
    Rule {
        code: Code::Mask,
        text: "any mask of docs/semantics.md §1.5",
        check: Check::Static(|f| {
            fail(Mask::ALL.contains(&f.config.params.mask), || {
                format!("mask {}", f.config.params.mask)
            })
        }),
    },
    Rule {
        code: Code::Window,
        text: "window (-1, -1)",
        check: Check::Static(|f| {
            let w = f.config.params.window;
            fail(w.left == -1 && w.right == -1, || {
                format!("window ({}, {})", w.left, w.right)
            })
        }),
    },
    LAYOUT,
    Rule {
        code: Code::SeqlenQ,
        text: "max actual q length in [1, 17] (BSHD: s_q in [1, 17])",
        check: Check::Runtime(|r| {
            let m = match r.bshd {
                Some((sq, _)) => sq,
                None => r.max_len_q,
            };
            fail((1..=17).contains(&m), || {
                format!("max q length {m} not in [1, 17]")
            })
        }),
    },
    Rule {
        code: Code::SeqlenKv,
        text: "max actual kv length in [1, 17] (BSHD: s_kv in [1, 17])",
        check: Check::Runtime(|r| {
            let m = match r.bshd {
                Some((_, skv)) => skv,
                None => r.max_len_kv,
            };
            fail((1..=17).contains(&m), || {
                format!("max kv length {m} not in [1, 17]")
            })
        }),
    },
    Rule {
        code: Code::EmptyBatch,
        text: "b > 0 and some slot has Lq > 0",
        check: Check::Runtime(|r| {
            fail(r.slots > 0 && !r.all_q_empty, || {
                format!("b = {}, no query rows: no kernel runs", r.slots)
            })
        }),
    },
];

/// Profile `te625` (ROCm TransformerEngine PR #625, gfx942 only).
pub static TE625: [Rule; 14] = [
    Rule {
        code: Code::Env,
        text: "NVTE_FUSED_ATTN_CK_SMALLSEQ equals exactly \"1\"",
        check: Check::Static(|f| {
            let v = f.env.get("NVTE_FUSED_ATTN_CK_SMALLSEQ");
            fail(v == Some("1"), || match v {
                Some(v) => format!("NVTE_FUSED_ATTN_CK_SMALLSEQ = '{v}'"),
                None => "NVTE_FUSED_ATTN_CK_SMALLSEQ unset".into(),
            })
        }),
    },
    Rule {
        code: Code::Arch,
        text: "arch is gfx942",
        check: Check::Static(|f| fail(f.arch.name() == "gfx942", || format!("arch {}", f.arch))),
    },
    Rule {
        code: Code::Dtype,
        text: "dtype bf16",
        check: Check::Static(|f| {
            fail(f.config.dtype == Dtype::Bf16, || {
                format!("dtype {}", f.config.dtype)
            })
        }),
    },
    DROPOUT,
    BIAS,
    Rule {
        code: Code::HeadDim,
        text: "head_dim_qk == head_dim_v in {128, 256}",
        check: Check::Static(|f| {
            let p = &f.config.params;
            fail(
                p.head_dim_qk == p.head_dim_v && [128, 256].contains(&p.head_dim_qk),
                || format!("head dims qk = {}, v = {}", p.head_dim_qk, p.head_dim_v),
            )
        }),
    },
    GQA,
    Rule {
        code: Code::NumHeads,
        text: "num_heads in {16, 32}",
        check: Check::Static(|f| {
            let h = f.config.params.num_heads;
            fail(h == 16 || h == 32, || format!("num_heads = {h}"))
        }),
    },
    Rule {
        code: Code::Mask,
        text: "mask in {no_mask, padding, padding_causal, padding_causal_bottom_right}",
        check: Check::Static(|f| {
            let m = f.config.params.mask;
            fail(m == Mask::NoMask || m.is_padding_class(), || {
                format!("mask {m}")
            })
        }),
    },
    Rule {
        code: Code::Window,
        text: "any window (accepted and ignored)",
        check: Check::Static(|_| None),
    },
    LAYOUT,
    Rule {
        code: Code::SeqlenQ,
        text: "THD: max padded q span in [1, 17]; BSHD: s_q in [2, 17]",
        check: Check::Runtime(|r| match r.bshd {
            Some((sq, _)) => fail((2..=17).contains(&sq), || {
                format!("bshd s_q = {sq} not in [2, 17]")
            }),
            None => fail((1..=17).contains(&r.max_span_q), || {
                format!("max padded q span {} not in [1, 17]", r.max_span_q)
            }),
        }),
    },
    Rule {
        code: Code::SeqlenKv,
        text: "THD: max padded kv span in [1, 17]; BSHD: s_kv in [2, 17]",
        check: Check::Runtime(|r| match r.bshd {
            Some((_, skv)) => fail((2..=17).contains(&skv), || {
                format!("bshd s_kv = {skv} not in [2, 17]")
            }),
            None => fail((1..=17).contains(&r.max_span_kv), || {
                format!("max padded kv span {} not in [1, 17]", r.max_span_kv)
            }),
        }),
    },
    Rule {
        code: Code::EmptyBatch,
        text: "b > 0 (TE's probe returns 0 for b = 0)",
        check: Check::Runtime(|r| fail(r.slots > 0, || "b = 0: the probe returns 0".into())),
    },
];

/// The rules of a profile.
pub fn rules(profile: Profile) -> &'static [Rule] {
    match profile {
        Profile::Native => &NATIVE,
        Profile::Te625 => &TE625,
    }
}

/// Every failed rule of `profile`; runtime rules only when `runtime` is given.
pub fn evaluate(profile: Profile, f: &StaticFacts, runtime: Option<&RuntimeFacts>) -> Vec<Reason> {
    rules(profile)
        .iter()
        .filter_map(|rule| {
            let detail = match (rule.check, runtime) {
                (Check::Static(c), _) => c(f),
                (Check::Runtime(c), Some(r)) => c(r),
                (Check::Runtime(_), None) => None,
            };
            detail.map(|detail| Reason {
                code: rule.code,
                detail,
            })
        })
        .collect()
}
