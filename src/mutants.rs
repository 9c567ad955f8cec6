//! The planted-bug catalogue: named mutants of the CPU backend and its gate. The harness's
//! power is measured by how many of them its standard campaign kills.

use std::fmt;
use std::str::FromStr;

/// One planted bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mutant {
    /// The last query row of the last slot is skipped (off-by-one at a `cu_seqlens` boundary).
    CuSeqlensOffByOne,
    /// Query head `h` reads kv head `h % Hkv` instead of `h / g`.
    KvHeadModulo,
    /// dK/dV keep only the group's last query head instead of summing over the group.
    GqaNoSum,
    /// Bottom-right causal computed as top-left.
    CausalTopLeft,
    /// The scale is applied twice.
    ScaleTwice,
    /// The scale is not applied.
    ScaleMissing,
    /// LSE written in log2 instead of the natural log.
    LseLog2,
    /// Softmax without max-subtraction.
    NoMaxSubtraction,
    /// Keys past the first 16-column tile are dropped.
    LastTileDropped,
    /// The wrapper does not zero don't-care outputs.
    DontCareNotZeroed,
    /// The padded span is read as the slot length.
    SpanAsLength,
    /// The gate admits lengths up to 16 only.
    GateLimit16,
    /// The gate admits lengths up to 18.
    GateLimit18,
    /// The gate does not reject GQA.
    GateAcceptsGqa,
    /// f16 inputs are read as bf16 bits.
    F16ReadAsBf16,
    /// P is not rounded to the input dtype before P·V.
    PNotRounded,
    /// LSE written token-major and read head-major (TE's permuted aux).
    LsePermuted,
    /// The causal mask is ignored.
    CausalIgnored,
    /// The sliding window is ignored.
    WindowIgnored,
    /// The last key's value is read from the neighbouring slot's first token.
    NeighbourSlotRead,
    /// An empty kv slot with queries gives NaN output (`P = 0·∞`).
    NanOnEmptyKv,
    /// With `b = 0` a kernel runs anyway and reads uninitialised workspace into the outputs.
    UninitWorkspaceOnEmpty,
    /// Kernels skip slots with `Lq = 0`, leaving their kv rows' dK/dV unwritten.
    EmptyQSlotSkipsDkDv,
    /// dQ is not multiplied by the scale.
    DqScaleMissing,
    /// Backward ignores the mask when recomputing P.
    BwdMaskIgnored,
    /// The LSE of the second row tile (rows 16..) is not written.
    LseSecondTileLost,
    /// The workspace is sized with the environment seen at trace time but carved with the one
    /// seen at launch (TE's planner evaluates the env var twice).
    WorkspaceEnvMismatch,
    // Issue 21 (judgement without blind spots): one mutant per blind spot it closed.
    /// An output that overflows is stored as NaN instead of ±inf (both paths).
    NanOnOverflow,
    /// The small-seq backward accumulates dQ in the input dtype instead of f32.
    DqHalfAccumulation,
    /// The small-seq backward's dQ is biased by 1.5 ulps of its dtype.
    DqUlpBias,
    /// The small-seq backward leaves one (key, head) row of dK zero: the last key of each slot
    /// with two keys or more, in the last head.
    ZeroedSmallRow,
    /// The fallback forward's O is twice the right value on slots of at most 17 keys.
    FallbackSmallShapes2x,
    // Issue 18: bugs of the classes the harness used to miss (production head counts,
    // extremes at tile boundaries, backward range, rounding mode).
    /// Query heads above 16 read kv head `(h & 15) / g`: a 4-bit head field.
    HeadIndexAbove16,
    /// The row maximum is taken over the first 16-key tile only (no rescale for the second):
    /// harmless until a later key's logit exceeds it by enough to overflow `exp`.
    SoftmaxFirstTileMax,
    /// f16 backward: dS is rounded without being kept in range first (overflows to ±inf).
    F16DsUnclamped,
    /// Small-seq outputs are rounded toward zero instead of to nearest-even.
    RoundTowardZero,
    // Issue 35: the path JAX users take.
    /// The segment ids → `cu_seqlens` conversion on the way to the kernels counts ids up to
    /// `max_segments - 1` (`bincount(ids)[1:max_segments]`): a row's last admitted segment
    /// keeps its start and loses its length.
    SegmentConversionSlip,
    // Issue 35.
    /// The fallback's dropout forms the Philox counter with the query row and key column
    /// swapped: a mask of the right density on the wrong elements.
    PhiloxIndexSwapped,
    /// The CPU fallback reads a broadcast post-scale bias on the wrong axis: the slot picks
    /// the head plane and the head the batch plane (`[1, H, …]` read as `[H, 1, …]`).
    BiasBroadcastWrongAxis,
    // Issue 35, item 3: a one-ulp loss in each reduction of both paths (a partial sum rounded
    // to the input dtype at every step, `src/backend/cpu/sums.rs`), which only the paths'
    // emulations (not the f64 reference's error bounds) can be counted on to see.
    /// The CPU fallback's forward rounds its P·V accumulator to the input dtype at every key.
    FallbackPvHalfAccumulation,
    /// The CPU fallback's forward rounds its softmax row sum to the input dtype at every key.
    FallbackRowsumHalfAccumulation,
    /// The CPU fallback's backward rounds its dQ accumulator to the input dtype at every key.
    FallbackDqHalfAccumulation,
    /// The CPU fallback's backward rounds its dK accumulators to the input dtype at every row.
    FallbackDkHalfAccumulation,
    /// The CPU fallback's backward rounds its dV accumulators to the input dtype at every row.
    FallbackDvHalfAccumulation,
    /// The CPU fallback's backward rounds D = Σ P·dP to the input dtype at every key.
    FallbackDeltaHalfAccumulation,
    /// The small-seq forward rounds its P·V accumulator to the input dtype at every key.
    PvHalfAccumulation,
    /// The small-seq forward rounds its softmax row sum to the input dtype at every key.
    RowsumHalfAccumulation,
    /// The small-seq backward rounds its dK accumulators to the input dtype at every row.
    DkHalfAccumulation,
    /// The small-seq backward rounds its dV accumulators to the input dtype at every row.
    DvHalfAccumulation,
    /// The small-seq backward rounds D = Σ P·dP to the input dtype at every key.
    DeltaHalfAccumulation,
}

impl Mutant {
    /// The whole catalogue.
    pub const ALL: [Mutant; 50] = [
        Mutant::CuSeqlensOffByOne,
        Mutant::KvHeadModulo,
        Mutant::GqaNoSum,
        Mutant::CausalTopLeft,
        Mutant::ScaleTwice,
        Mutant::ScaleMissing,
        Mutant::LseLog2,
        Mutant::NoMaxSubtraction,
        Mutant::LastTileDropped,
        Mutant::DontCareNotZeroed,
        Mutant::SpanAsLength,
        Mutant::GateLimit16,
        Mutant::GateLimit18,
        Mutant::GateAcceptsGqa,
        Mutant::F16ReadAsBf16,
        Mutant::PNotRounded,
        Mutant::LsePermuted,
        Mutant::CausalIgnored,
        Mutant::WindowIgnored,
        Mutant::NeighbourSlotRead,
        Mutant::NanOnEmptyKv,
        Mutant::UninitWorkspaceOnEmpty,
        Mutant::EmptyQSlotSkipsDkDv,
        Mutant::DqScaleMissing,
        Mutant::BwdMaskIgnored,
        Mutant::LseSecondTileLost,
        Mutant::WorkspaceEnvMismatch,
        // Issue 21.
        Mutant::NanOnOverflow,
        Mutant::DqHalfAccumulation,
        Mutant::DqUlpBias,
        Mutant::ZeroedSmallRow,
        Mutant::FallbackSmallShapes2x,
        // Issue 18.
        Mutant::HeadIndexAbove16,
        Mutant::SoftmaxFirstTileMax,
        Mutant::F16DsUnclamped,
        Mutant::RoundTowardZero,
        // Issue 35.
        Mutant::SegmentConversionSlip,
        Mutant::PhiloxIndexSwapped,
        Mutant::BiasBroadcastWrongAxis,
        Mutant::FallbackPvHalfAccumulation,
        Mutant::FallbackRowsumHalfAccumulation,
        Mutant::FallbackDqHalfAccumulation,
        Mutant::FallbackDkHalfAccumulation,
        Mutant::FallbackDvHalfAccumulation,
        Mutant::FallbackDeltaHalfAccumulation,
        Mutant::PvHalfAccumulation,
        Mutant::RowsumHalfAccumulation,
        Mutant::DkHalfAccumulation,
        Mutant::DvHalfAccumulation,
        Mutant::DeltaHalfAccumulation,
    ];

    /// The define that plants this bug in the GPU kernels (`kernels/small_seq.cu`,
    /// `kernels/fallback.cu`, `kernels/portable.h`: shared by CUDA and HIP), where the kernels
    /// carry it.
    pub fn kernel_define(self) -> Option<&'static str> {
        match self {
            Mutant::ScaleTwice => Some("SMALLSEQ_MUTANT_SCALE_TWICE"),
            Mutant::LseLog2 => Some("SMALLSEQ_MUTANT_LSE_LOG2"),
            Mutant::CausalIgnored => Some("SMALLSEQ_MUTANT_CAUSAL_IGNORED"),
            // Issue 21.
            Mutant::NanOnOverflow => Some("SMALLSEQ_MUTANT_NAN_ON_OVERFLOW"),
            // DqHalfAccumulation stays on the CPU: the matrix cores accumulate in f32 in
            // hardware, so the kernels cannot round their sum without splitting the MMA.
            Mutant::DqUlpBias => Some("SMALLSEQ_MUTANT_DQ_ULP_BIAS"),
            Mutant::ZeroedSmallRow => Some("SMALLSEQ_MUTANT_ZEROED_SMALL_ROW"),
            Mutant::FallbackSmallShapes2x => Some("SMALLSEQ_MUTANT_FALLBACK_SMALL_SHAPES_2X"),
            // Issue 18.
            Mutant::HeadIndexAbove16 => Some("SMALLSEQ_MUTANT_HEAD_INDEX_ABOVE_16"),
            Mutant::SoftmaxFirstTileMax => Some("SMALLSEQ_MUTANT_SOFTMAX_FIRST_TILE_MAX"),
            Mutant::F16DsUnclamped => Some("SMALLSEQ_MUTANT_F16_DS_UNCLAMPED"),
            Mutant::RoundTowardZero => Some("SMALLSEQ_MUTANT_ROUND_TOWARD_ZERO"),
            _ => None,
        }
    }

    /// Stable kebab-case name.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::CuSeqlensOffByOne => "cu-seqlens-off-by-one",
            Mutant::KvHeadModulo => "kv-head-modulo",
            Mutant::GqaNoSum => "gqa-no-sum",
            Mutant::CausalTopLeft => "causal-top-left",
            Mutant::ScaleTwice => "scale-twice",
            Mutant::ScaleMissing => "scale-missing",
            Mutant::LseLog2 => "lse-log2",
            Mutant::NoMaxSubtraction => "no-max-subtraction",
            Mutant::LastTileDropped => "last-tile-dropped",
            Mutant::DontCareNotZeroed => "dont-care-not-zeroed",
            Mutant::SpanAsLength => "span-as-length",
            Mutant::GateLimit16 => "gate-limit-16",
            Mutant::GateLimit18 => "gate-limit-18",
            Mutant::GateAcceptsGqa => "gate-accepts-gqa",
            Mutant::F16ReadAsBf16 => "f16-read-as-bf16",
            Mutant::PNotRounded => "p-not-rounded",
            Mutant::LsePermuted => "lse-permuted",
            Mutant::CausalIgnored => "causal-ignored",
            Mutant::WindowIgnored => "window-ignored",
            Mutant::NeighbourSlotRead => "neighbour-slot-read",
            Mutant::NanOnEmptyKv => "nan-on-empty-kv",
            Mutant::UninitWorkspaceOnEmpty => "uninit-workspace-on-empty",
            Mutant::EmptyQSlotSkipsDkDv => "empty-q-slot-skips-dkdv",
            Mutant::DqScaleMissing => "dq-scale-missing",
            Mutant::BwdMaskIgnored => "bwd-mask-ignored",
            Mutant::LseSecondTileLost => "lse-second-tile-lost",
            Mutant::WorkspaceEnvMismatch => "workspace-env-mismatch",
            // Issue 21.
            Mutant::NanOnOverflow => "nan-on-overflow",
            Mutant::DqHalfAccumulation => "dq-half-accumulation",
            Mutant::DqUlpBias => "dq-ulp-bias",
            Mutant::ZeroedSmallRow => "zeroed-small-row",
            Mutant::FallbackSmallShapes2x => "fallback-small-shapes-2x",
            // Issue 18.
            Mutant::HeadIndexAbove16 => "head-index-above-16",
            Mutant::SoftmaxFirstTileMax => "softmax-first-tile-max",
            Mutant::F16DsUnclamped => "f16-ds-unclamped",
            Mutant::RoundTowardZero => "round-toward-zero",
            // Issue 35.
            Mutant::SegmentConversionSlip => "segment-conversion-slip",
            Mutant::PhiloxIndexSwapped => "philox-index-swapped",
            Mutant::BiasBroadcastWrongAxis => "bias-broadcast-wrong-axis",
            Mutant::FallbackPvHalfAccumulation => "fallback-pv-half-accumulation",
            Mutant::FallbackRowsumHalfAccumulation => "fallback-rowsum-half-accumulation",
            Mutant::FallbackDqHalfAccumulation => "fallback-dq-half-accumulation",
            Mutant::FallbackDkHalfAccumulation => "fallback-dk-half-accumulation",
            Mutant::FallbackDvHalfAccumulation => "fallback-dv-half-accumulation",
            Mutant::FallbackDeltaHalfAccumulation => "fallback-delta-half-accumulation",
            Mutant::PvHalfAccumulation => "pv-half-accumulation",
            Mutant::RowsumHalfAccumulation => "rowsum-half-accumulation",
            Mutant::DkHalfAccumulation => "dk-half-accumulation",
            Mutant::DvHalfAccumulation => "dv-half-accumulation",
            Mutant::DeltaHalfAccumulation => "delta-half-accumulation",
        }
    }
}

impl fmt::Display for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mutant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Mutant::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Mutant::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mutant '{s}' (valid: {})", names.join(", "))
            })
    }
}

/// A set of planted bugs (empty in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Defects(Vec<Mutant>);

impl Defects {
    pub fn none() -> Self {
        Defects(Vec::new())
    }

    pub fn of(mutants: &[Mutant]) -> Self {
        Defects(mutants.to_vec())
    }

    #[inline]
    pub fn has(&self, m: Mutant) -> bool {
        self.0.contains(&m)
    }

    pub fn list(&self) -> &[Mutant] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel sources, as the CUDA backend and the HIP build compile them.
    const KERNELS: [(&str, &str); 3] = [
        ("small_seq.cu", include_str!("../kernels/small_seq.cu")),
        ("fallback.cu", include_str!("../kernels/fallback.cu")),
        ("portable.h", include_str!("../kernels/portable.h")),
    ];

    /// Whether the kernels compile something different under `define`: a preprocessor test
    /// of exactly that name (a define nothing tests would plant nothing, and its mutant would
    /// survive every device campaign for a reason that has nothing to do with the harness).
    fn tested_by_kernels(define: &str) -> Vec<&'static str> {
        KERNELS
            .iter()
            .filter(|(_, src)| {
                src.lines().any(|l| {
                    let l = l.trim_start();
                    (l.starts_with("#if") || l.starts_with("#elif"))
                        && l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .any(|w| w == define)
                })
            })
            .map(|(name, _)| *name)
            .collect()
    }

    #[test]
    fn every_kernel_define_is_planted_in_the_kernels() {
        for m in Mutant::ALL {
            if let Some(d) = m.kernel_define() {
                assert!(
                    !tested_by_kernels(d).is_empty(),
                    "{m}: no kernel source tests {d}"
                );
            }
        }
    }

    /// Issue 18's four reach mutants are kernel bugs as well as CPU ones, planted where each
    /// bug lives: the head index in both kernel files, the rest in the small-seq kernels.
    #[test]
    fn reach_mutants_are_planted_where_their_bug_lives() {
        let want: [(Mutant, &[&str]); 4] = [
            (Mutant::HeadIndexAbove16, &["small_seq.cu", "fallback.cu"]),
            (Mutant::SoftmaxFirstTileMax, &["small_seq.cu"]),
            (Mutant::F16DsUnclamped, &["small_seq.cu"]),
            (Mutant::RoundTowardZero, &["small_seq.cu"]),
        ];
        for (m, files) in want {
            let d = m
                .kernel_define()
                .unwrap_or_else(|| panic!("{m} has no kernel define"));
            assert_eq!(tested_by_kernels(d), files, "{m} ({d})");
        }
    }

    /// The defines are the mutants' names, upper-cased, so a GPU capsule's define names its
    /// CPU twin; and no two mutants share one.
    #[test]
    fn kernel_defines_follow_the_names() {
        let mut seen = std::collections::BTreeSet::new();
        for m in Mutant::ALL {
            if let Some(d) = m.kernel_define() {
                let want = format!(
                    "SMALLSEQ_MUTANT_{}",
                    m.name().to_ascii_uppercase().replace('-', "_")
                );
                assert_eq!(d, want, "{m}");
                assert!(seen.insert(d), "{d} used twice");
            }
        }
    }
}
