//! The launch policy of the GPU backends, in pure Rust (compiled and tested without the GPU
//! features): which kernels a call launches, under which names, with how many blocks and how
//! much shared memory; and from the same rule, every kernel a backend can launch (the list
//! `ci/hip-compile-check.sh` compares with the code objects).

use crate::backend::kernel_args::{args_of, Arg, Kernel};
use crate::backend::launch::{
    BiasArgs, BiasKind, Family, Gpu, LaunchDims, Ptrs, SMALL_SEQ_HEAD_DIMS, SMALL_SEQ_MAX_ROWS,
    TILED_ROWS, WARPS_PER_BLOCK,
};
use crate::design::Design;
use smallseq_reference::Dtype;

/// The kernels' form of D when none of `defines` sets `FTB_D_FROM_O` (kernels/fallback.cu;
/// `fallback_d_form_default_is_the_kernels` holds the two together).
pub const D_FORM_DEFAULT: DForm = DForm::Exact;

/// Where the fallback backward's D = Σ P·dP comes from (`FTB_D_FROM_O`, kernels/fallback.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DForm {
    /// 0: a first pass over the keys forms it from P and dP.
    Exact,
    /// 1: rowsum(dO ∘ O) from the stored O (the design [`Design::ProjectDFromO`]: D carries
    /// O's rounding).
    StoredO,
    /// 2: the tiled query side (D ≤ 128) starts from rowsum(dO ∘ O) and corrects dQ by the
    /// exact D it forms in the same pass, so the design stays [`Design::Project`].
    CorrectedO,
}

impl DForm {
    /// The form of the kernels' `FTB_D_FROM_O` value (a value the kernels do not know is
    /// none of these).
    pub fn of_value(v: u8) -> Option<DForm> {
        [DForm::Exact, DForm::StoredO, DForm::CorrectedO]
            .into_iter()
            .find(|f| f.value() == v)
    }

    /// Its `FTB_D_FROM_O` value.
    pub fn value(self) -> u8 {
        match self {
            DForm::Exact => 0,
            DForm::StoredO => 1,
            DForm::CorrectedO => 2,
        }
    }

    /// Whether the backward takes the stored O (and launches the D kernel before it).
    pub fn takes_o(self) -> bool {
        self != DForm::Exact
    }

    /// The design the outputs of kernels of this form follow.
    pub fn design(self) -> Design {
        match self {
            DForm::StoredO => Design::ProjectDFromO,
            DForm::Exact | DForm::CorrectedO => Design::Project,
        }
    }
}

/// The form of D of kernels built with `defines` (`NAME` or `NAME=VALUE`, as
/// `SMALLSEQ_KERNEL_DEFINES` and the CUDA backend take them; the last one of a name wins, as on
/// a compiler's command line): `FTB_D_FROM_O` without a value is 1 to the preprocessor. A value
/// other than 0, 1 and 2 is refused, naming it.
pub fn d_form_in<S: AsRef<str>>(defines: &[S]) -> Result<DForm, String> {
    let value = defines
        .iter()
        .filter_map(|d| match d.as_ref().split_once('=') {
            None => (d.as_ref() == "FTB_D_FROM_O").then(|| "1".to_string()),
            Some((name, value)) => (name == "FTB_D_FROM_O").then(|| value.trim().to_string()),
        })
        .last();
    match value {
        None => Ok(D_FORM_DEFAULT),
        Some(v) => v.parse::<u8>().ok().and_then(DForm::of_value).ok_or_else(|| {
            format!("FTB_D_FROM_O={v}: the kernels know 0 (exact D), 1 (D from the stored O) and 2 (D from O, corrected)")
        }),
    }
}

/// Which direction of attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Fwd,
    Bwd,
}

impl Dir {
    /// The direction in kernel names: `fwd`, `bwd`.
    pub fn name(self) -> &'static str {
        match self {
            Dir::Fwd => "fwd",
            Dir::Bwd => "bwd",
        }
    }
}

/// One kernel launch of a call: a 1-D grid of `blocks` blocks of [`WARPS_PER_BLOCK`] work
/// items each (a work item is a warp on CUDA, a wavefront on HIP).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub family: Family,
    pub kernel: Kernel,
    pub name: String,
    pub blocks: u32,
    /// Dynamic shared memory, in bytes.
    pub smem: u32,
}

/// Why a call cannot be launched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The kernels do not take the shape or dtype (the backend's `Error::Unsupported`).
    Unsupported(String),
    /// More blocks than a 1-D grid holds (the backend's `Error::Backend`).
    Grid { items: i64 },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Unsupported(m) => f.write_str(m),
            Refusal::Grid { items } => write!(f, "{items} work items exceed the 1-D grid"),
        }
    }
}

/// Blocks of [`WARPS_PER_BLOCK`] for `items` work items.
///
/// # Errors
/// [`Refusal::Grid`] past what a 1-D grid holds.
pub fn blocks(items: i64) -> Result<u32, Refusal> {
    let blocks = (items.max(0) as u64).div_ceil(WARPS_PER_BLOCK as u64);
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b < i32::MAX as u32)
        .ok_or(Refusal::Grid { items })
}

fn suffix(d: &LaunchDims, allow_f32: bool) -> Result<&'static str, Refusal> {
    d.dtype_suffix(allow_f32).map_err(Refusal::Unsupported)
}

/// Name of the small-seq kernel of `dir` (`small_seq_fwd_bf16_d128_o32`, …); launches whose
/// slots all hold at most one query take the `_q1` kernel, which holds the one-query code alone
/// (`kernels/small_seq.cu`, `SS_ONE_QUERY`), so `max_lq` must bound every slot's query side.
///
/// # Errors
/// [`Refusal::Unsupported`] for a launch the small-seq kernels do not take.
pub fn small_seq_name(dir: Dir, d: &LaunchDims) -> Result<String, Refusal> {
    if let Some(m) = d.small_seq_unsupported() {
        return Err(Refusal::Unsupported(m));
    }
    let base = match d.dtype {
        Dtype::Bf16 => "bf16",
        Dtype::F16 => "f16",
        Dtype::F32 => suffix(d, false)?,
    };
    let o32 = if d.out_f32 { "_o32" } else { "" };
    let q1 = if d.one_query() { "_q1" } else { "" };
    Ok(format!(
        "small_seq_{}_{base}_d{}{o32}{q1}",
        dir.name(),
        d.dqk
    ))
}

/// Names of the scalar fallback kernels (`fallback_fwd_bf16`, `fallback_bwd_q_…`,
/// `fallback_bwd_kv_…`) for these dims.
///
/// # Errors
/// None today (the fallback kernels take every dtype); kept for the dtype rule's sake.
pub fn fallback_names(d: &LaunchDims) -> Result<[String; 3], Refusal> {
    let suf = suffix(d, true)?;
    Ok([
        format!("fallback_fwd_{suf}"),
        format!("fallback_bwd_q_{suf}"),
        format!("fallback_bwd_kv_{suf}"),
    ])
}

fn check_fallback(d: &LaunchDims) -> Result<(), Refusal> {
    d.fallback_unsupported()
        .map_or(Ok(()), |m| Err(Refusal::Unsupported(m)))
}

/// The launches, in order, of one call of `family` in direction `dir` on `gpu` (none where
/// the grid would be empty).
///
/// - small-seq: one kernel, one work item per (slot, head);
/// - fallback forward: the tiled kernel where [`LaunchDims::tiled_fwd`] applies (one block per
///   head, slot and query tile), else the scalar one (one work item per query token and head);
/// - fallback backward: with D from the stored O ([`LaunchDims::d_from_o`]) the D kernel
///   first, one work item per query token and head; the query side (with `delta`), then the
///   key side: tiled where
///   [`LaunchDims::tiled_bwd`] applies, else scalar; then, for a post-scale bias (never tiled),
///   dBias, one work item per row of the bias tensor.
///
/// # Errors
/// [`Refusal::Unsupported`] for shapes the family does not take, [`Refusal::Grid`] for a grid
/// too large; either before any launch.
pub fn launches(
    gpu: Gpu,
    family: Family,
    dir: Dir,
    d: &LaunchDims,
) -> Result<Vec<Launch>, Refusal> {
    let one = |kernel, name, blocks, smem| Launch {
        family,
        kernel,
        name,
        blocks,
        smem,
    };
    let wpb = WARPS_PER_BLOCK as i64;
    match (family, dir) {
        (Family::SmallSeq, _) => {
            let name = small_seq_name(dir, d)?;
            let kernel = match dir {
                Dir::Fwd => Kernel::SmallSeqFwd,
                Dir::Bwd => Kernel::SmallSeqBwd,
            };
            let blocks = blocks(d.b as i64 * d.heads as i64)?;
            Ok(match blocks {
                0 => vec![],
                _ => vec![one(kernel, name, blocks, 0)],
            })
        }
        (Family::Fallback, Dir::Fwd) => {
            check_fallback(d)?;
            if let Some((name, tiles)) = d.tiled_fwd(gpu) {
                // One block per (head, slot, query tile): `blocks` counts work items.
                let items = d.heads as i64 * d.b as i64 * tiles as i64;
                let blocks = blocks(items * wpb)?;
                return Ok(match blocks {
                    0 => vec![],
                    _ => vec![one(Kernel::TiledFwd, name, blocks, d.tiled_fwd_smem())],
                });
            }
            let [name, _, _] = fallback_names(d)?;
            let blocks = blocks(d.tq * d.heads as i64)?;
            if blocks == 0 || d.b == 0 {
                return Ok(vec![]);
            }
            // One f32 row of Dqk per work item.
            let smem = WARPS_PER_BLOCK * 4 * d.dqk as u32;
            Ok(vec![one(Kernel::FallbackFwd, name, blocks, smem)])
        }
        (Family::Fallback, Dir::Bwd) => {
            check_fallback(d)?;
            let [_, name_q, name_kv] = fallback_names(d)?;
            if d.b == 0 {
                return Ok(vec![]);
            }
            let mut v = Vec::new();
            // D = rowsum(dO∘O) before either query side reads it: one work item per query
            // token and head.
            let delta = blocks(d.tq * d.heads as i64)?;
            if d.d_from_o && delta > 0 {
                let name = format!("fallback_bwd_delta_{}", suffix(d, true)?);
                v.push(one(Kernel::FallbackDelta, name, delta, 0));
            }
            if let Some(([name_q, name_kv], key_tiles)) = d.tiled_bwd(gpu) {
                // One block per (head, slot, query tile), then per (kv head, slot, key tile,
                // part).
                let smem = d.tiled_bwd_smem();
                let items = d.heads as i64 * d.b as i64 * d.tiled_tiles() as i64;
                let q = blocks(items * wpb)?;
                let items =
                    d.kv_heads as i64 * d.b as i64 * key_tiles as i64 * d.tiled_bwd_kv_parts();
                let kv = blocks(items * wpb)?;
                for (kernel, name, blocks) in [
                    (Kernel::TiledBwdQ, name_q, q),
                    (Kernel::TiledBwdKv, name_kv, kv),
                ] {
                    if blocks > 0 {
                        v.push(one(kernel, name, blocks, smem));
                    }
                }
                return Ok(v);
            }
            let smem = WARPS_PER_BLOCK * 4 * (d.dqk + d.dv) as u32;
            let q = blocks(d.tq * d.heads as i64)?;
            let kv = blocks(d.tk * d.kv_heads as i64)?;
            // dBias after the query side, whose D and Z it reads: one work item per row.
            let db = blocks(d.bias.grad_rows())?;
            let name_db = format!("fallback_dbias_{}", suffix(d, true)?);
            for (kernel, name, blocks) in [
                (Kernel::FallbackBwdQ, name_q, q),
                (Kernel::FallbackBwdKv, name_kv, kv),
                (Kernel::FallbackDbias, name_db, db),
            ] {
                if blocks > 0 {
                    v.push(one(kernel, name, blocks, smem));
                }
            }
            Ok(v)
        }
    }
}

/// A kernel a backend can launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// The kernel file whose module (code object) holds it.
    pub stem: &'static str,
    pub name: String,
    /// Its arguments as the launch passes them: `P` a pointer, `4`/`8` a value of that size.
    pub args: String,
}

/// Every kernel the `gpu` backend can launch, from [`launches`] over each dtype, output kind
/// and head dim: per dtype the scalar fallback kernels, the tiled ones per head dim, then the
/// small-seq ones (`ci/hip-compile-check.sh` checks each against the code objects' metadata).
pub fn kernels(gpu: Gpu) -> Vec<KernelInfo> {
    let mut v: Vec<KernelInfo> = Vec::new();
    let mut add = |d: LaunchDims, family: Family| {
        for dir in [Dir::Fwd, Dir::Bwd] {
            for l in launches(gpu, family, dir, &d).unwrap_or_default() {
                if v.iter().all(|k| k.name != l.name) {
                    let args = args_of(l.kernel, &d, &Ptrs::default());
                    v.push(KernelInfo {
                        stem: l.family.stem(),
                        name: l.name,
                        args: args.iter().map(Arg::code).collect(),
                    });
                }
            }
        }
    };
    for (dtype, out_f32) in [
        (Dtype::Bf16, false),
        (Dtype::Bf16, true),
        (Dtype::F16, false),
        (Dtype::F16, true),
        (Dtype::F32, false),
    ] {
        let one = LaunchDims {
            dtype,
            out_f32,
            ..LaunchDims::single_token()
        };
        add(one, Family::Fallback);
        // The D kernel, launched only with D from the stored O.
        add(
            LaunchDims {
                d_from_o: true,
                ..one
            },
            Family::Fallback,
        );
        // The dBias kernel, launched only for a post-scale bias.
        let biased = LaunchDims {
            bias: BiasArgs {
                kind: BiasKind::PostScale,
                dims: [1, 1, 1, 1],
            },
            ..one
        };
        add(biased, Family::Fallback);
        let sized = |dim: usize, max_lq| LaunchDims {
            dqk: dim as i32,
            dv: dim as i32,
            max_lq,
            ..one
        };
        for &dim in gpu.tiled_fwd_dims() {
            add(sized(dim, TILED_ROWS), Family::Fallback);
        }
        for dim in SMALL_SEQ_HEAD_DIMS {
            // Any launch, then one of one query per slot (the `_q1` kernels).
            for max_lq in [SMALL_SEQ_MAX_ROWS, 1] {
                add(sized(dim, max_lq), Family::SmallSeq);
            }
        }
    }
    v
}

/// [`kernels`]' names, each with the stem of the file whose module holds it.
pub fn kernel_names(gpu: Gpu) -> Vec<(&'static str, String)> {
    kernels(gpu).into_iter().map(|k| (k.stem, k.name)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::launch::DropArgs;

    fn dims(dtype: Dtype, out_f32: bool, d: i32) -> LaunchDims {
        LaunchDims {
            dtype,
            out_f32,
            heads: 2,
            kv_heads: 2,
            dqk: d,
            dv: d,
            ..LaunchDims::single_token()
        }
    }

    /// The list each backend's launches build, against names spelled out here from the
    /// kernels' macros (`SS_ALL`, `FB_KERNELS`, `FT_KERNELS`, `FTB_KERNELS`), in list order.
    #[test]
    fn every_launchable_kernel_is_listed_in_order() {
        for gpu in [Gpu::Hip, Gpu::Cuda] {
            let mut want: Vec<(&str, String)> = Vec::new();
            for (suf, base, o32) in [
                ("bf16", "bf16", ""),
                ("bf16_o32", "bf16", "_o32"),
                ("f16", "f16", ""),
                ("f16_o32", "f16", "_o32"),
                ("f32", "", ""),
            ] {
                for k in ["fwd", "bwd_q", "bwd_kv", "bwd_delta", "dbias"] {
                    want.push(("fallback", format!("fallback_{k}_{suf}")));
                }
                if suf == "f32" {
                    continue;
                }
                for &d in gpu.tiled_fwd_dims() {
                    want.push(("fallback", format!("fallback_fwd_tc_{suf}_d{d}")));
                    if gpu.tiled_bwd_dims().contains(&d) {
                        want.push(("fallback", format!("fallback_bwd_q_tc_{suf}_d{d}")));
                        want.push(("fallback", format!("fallback_bwd_kv_tc_{suf}_d{d}")));
                    }
                }
                for d in SMALL_SEQ_HEAD_DIMS {
                    for q1 in ["", "_q1"] {
                        for dir in ["fwd", "bwd"] {
                            let n = format!("small_seq_{dir}_{base}_d{d}{o32}{q1}");
                            want.push(("small_seq", n));
                        }
                    }
                }
            }
            assert_eq!(kernel_names(gpu), want, "{gpu:?}");
        }
        // 2 dtypes x 2 output kinds x 3 dims x fwd/bwd; 5 fallback suffixes x 5 kernels, and
        // the tiled forward for 4 suffixes x 2 dims (HIP builds no tiled backward and no
        // tiled forward at D = 256: kernels/fallback.cu says why).
        let names = kernel_names(Gpu::Hip);
        assert_eq!(names.iter().filter(|(s, _)| *s == "small_seq").count(), 48);
        assert_eq!(
            names.iter().filter(|(s, _)| *s == "fallback").count(),
            25 + 4 * 2
        );
    }

    #[test]
    fn kernel_names_exist_in_the_sources() {
        let small = include_str!("../../../kernels/small_seq.cu");
        for d in SMALL_SEQ_HEAD_DIMS {
            assert!(small.contains(&format!("SS_ALL({d})")));
            for dt in [Dtype::Bf16, Dtype::F16] {
                for o32 in [false, true] {
                    for max_lq in [1, 2, 17] {
                        let d = LaunchDims {
                            max_lq,
                            ..dims(dt, o32, d as i32)
                        };
                        let n = small_seq_name(Dir::Fwd, &d).unwrap();
                        let stem = n.strip_suffix("_q1").unwrap_or(&n);
                        assert!(
                            n.starts_with("small_seq_fwd_") && n.contains(&format!("_d{}", d.dqk))
                        );
                        assert_eq!(stem.ends_with("_o32"), o32, "{n}");
                        assert_eq!(n.ends_with("_q1"), max_lq == 1, "{n}");
                    }
                }
            }
        }
        let many = |dt, o32, d| LaunchDims {
            max_lq: 17,
            ..dims(dt, o32, d)
        };
        assert_eq!(
            small_seq_name(Dir::Fwd, &many(Dtype::Bf16, true, 128)).unwrap(),
            "small_seq_fwd_bf16_d128_o32"
        );
        assert_eq!(
            small_seq_name(Dir::Bwd, &many(Dtype::F16, false, 64)).unwrap(),
            "small_seq_bwd_f16_d64"
        );
        assert_eq!(
            small_seq_name(Dir::Bwd, &dims(Dtype::F16, false, 64)).unwrap(),
            "small_seq_bwd_f16_d64_q1"
        );
        assert!(small.contains("SS_PAIR(bf16_d##D, BF16, BF16, D)"));
        assert!(small_seq_name(Dir::Fwd, &dims(Dtype::F32, false, 64)).is_err());
        assert!(small_seq_name(Dir::Fwd, &dims(Dtype::Bf16, false, 96)).is_err());
        let fb = include_str!("../../../kernels/fallback.cu");
        for suf in ["bf16", "f16", "f32", "bf16_o32", "f16_o32"] {
            assert!(fb.contains(&format!("FB_KERNELS({suf},")), "{suf}");
        }
        for &d in Gpu::Hip.tiled_fwd_dims() {
            assert!(fb.contains(&format!("\nFT_KERNELS({d})")), "{d}");
        }
    }

    #[test]
    fn launches_follow_the_family_rules() {
        // Small-seq: one block per 4 (slot, head) items, no shared memory.
        let d = LaunchDims {
            b: 5,
            max_lq: 17,
            max_lk: 17,
            ..dims(Dtype::Bf16, false, 128)
        };
        let l = launches(Gpu::Cuda, Family::SmallSeq, Dir::Fwd, &d).unwrap();
        assert_eq!(
            l,
            [Launch {
                family: Family::SmallSeq,
                kernel: Kernel::SmallSeqFwd,
                name: "small_seq_fwd_bf16_d128".into(),
                blocks: 3,
                smem: 0,
            }]
        );
        // One query per slot (or none): the same grid on the `_q1` kernel, both directions and
        // both GPUs.
        for max_lq in [0, 1] {
            let one = LaunchDims { max_lq, ..d };
            for (gpu, dir, name) in [
                (Gpu::Cuda, Dir::Fwd, "small_seq_fwd_bf16_d128_q1"),
                (Gpu::Hip, Dir::Bwd, "small_seq_bwd_bf16_d128_q1"),
            ] {
                let l = launches(gpu, Family::SmallSeq, dir, &one).unwrap();
                assert_eq!((l.len(), l[0].name.as_str(), l[0].blocks), (1, name, 3));
            }
        }
        // An empty batch launches nothing; a shape the kernels refuse is refused first.
        let empty = LaunchDims { b: 0, ..d };
        for fam in Family::ALL {
            for dir in [Dir::Fwd, Dir::Bwd] {
                assert_eq!(launches(Gpu::Hip, fam, dir, &empty), Ok(vec![]));
            }
        }
        let long = LaunchDims { max_lk: 18, ..d };
        assert!(matches!(
            launches(Gpu::Hip, Family::SmallSeq, Dir::Bwd, &long),
            Err(Refusal::Unsupported(m)) if m.contains("kv 18")
        ));
        // Fallback backward: the query side, then the key side; tiled on CUDA only.
        let fb = LaunchDims {
            tq: 40,
            tk: 24,
            max_lq: 9,
            max_lk: 9,
            ..d
        };
        let kinds = |gpu| {
            launches(gpu, Family::Fallback, Dir::Bwd, &fb)
                .unwrap()
                .into_iter()
                .map(|l| (l.kernel, l.blocks))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            kinds(Gpu::Hip),
            [(Kernel::FallbackBwdQ, 20), (Kernel::FallbackBwdKv, 12)]
        );
        assert_eq!(
            kinds(Gpu::Cuda),
            [(Kernel::TiledBwdQ, 10), (Kernel::TiledBwdKv, 10)]
        );
        let gqa = LaunchDims {
            heads: 3,
            kv_heads: 2,
            ..fb
        };
        assert!(matches!(
            launches(Gpu::Cuda, Family::Fallback, Dir::Fwd, &gqa),
            Err(Refusal::Unsupported(_))
        ));
    }

    /// Dropout and bias go to the scalar kernels, where the tiled ones would take the call;
    /// a post-scale bias adds the dBias launch, ALiBi (no gradient) does not.
    #[test]
    fn dropout_and_bias_take_the_scalar_kernels() {
        let tiled = LaunchDims {
            tq: 40,
            tk: 24,
            max_lq: 9,
            max_lk: 9,
            ..dims(Dtype::Bf16, false, 128)
        };
        let post = BiasArgs {
            kind: BiasKind::PostScale,
            dims: [1, 2, 9, 9],
        };
        let alibi = BiasArgs {
            kind: BiasKind::Alibi,
            dims: [1, 1, 1, 2],
        };
        let drop = DropArgs {
            keep_at: 1 << 31,
            rescale: 2.0,
            ..DropArgs::NONE
        };
        let kinds = |d: &LaunchDims, dir| {
            launches(Gpu::Cuda, Family::Fallback, dir, d)
                .unwrap()
                .into_iter()
                .map(|l| (l.kernel, l.blocks))
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(&tiled, Dir::Fwd), [(Kernel::TiledFwd, 2)]);
        let scalar_bwd = [(Kernel::FallbackBwdQ, 20), (Kernel::FallbackBwdKv, 12)];
        for d in [
            LaunchDims { drop, ..tiled },
            LaunchDims {
                bias: alibi,
                ..tiled
            },
        ] {
            assert_eq!(kinds(&d, Dir::Fwd), [(Kernel::FallbackFwd, 20)]);
            assert_eq!(kinds(&d, Dir::Bwd), scalar_bwd);
            assert!(launches(Gpu::Hip, Family::SmallSeq, Dir::Fwd, &d).is_err());
        }
        let biased = LaunchDims {
            bias: post,
            ..tiled
        };
        // 1 x 2 x 9 rows of dBias, 4 per block.
        let want = [scalar_bwd[0], scalar_bwd[1], (Kernel::FallbackDbias, 5)];
        assert_eq!(kinds(&biased, Dir::Bwd), want);
        let l = launches(Gpu::Hip, Family::Fallback, Dir::Bwd, &biased).unwrap();
        assert_eq!(l[2].name, "fallback_dbias_bf16");
    }

    #[test]
    fn fallback_d_form_default_is_the_kernels() {
        let src = include_str!("../../../kernels/fallback.cu");
        let want = format!("#define FTB_D_FROM_O {}", D_FORM_DEFAULT.value());
        assert!(src.contains(&want), "kernels/fallback.cu lacks {want:?}");
        assert_eq!(d_form_in::<&str>(&[]), Ok(DForm::Exact));
        assert_eq!(d_form_in(&["FTB_D_FROM_O"]), Ok(DForm::StoredO));
        assert_eq!(
            d_form_in(&["SS_ITEM32=1", "FTB_D_FROM_O=1"]),
            Ok(DForm::StoredO)
        );
        assert_eq!(
            d_form_in(&["FTB_D_FROM_O=1", "FTB_D_FROM_O=0"]),
            Ok(DForm::Exact)
        );
        assert_eq!(
            d_form_in(&["FTB_D_FROM_OX=1", "XFTB_D_FROM_O"]),
            Ok(DForm::Exact)
        );
        assert_eq!(d_form_in(&["FTB_D_FROM_O= 2"]), Ok(DForm::CorrectedO));
        let e = d_form_in(&["FTB_D_FROM_O=3"]).unwrap_err();
        assert!(e.starts_with("FTB_D_FROM_O=3: "), "{e}");
        assert_eq!(DForm::CorrectedO.design(), Design::Project);
        assert_eq!(DForm::StoredO.design(), Design::ProjectDFromO);
        assert!(DForm::CorrectedO.takes_o() && !DForm::Exact.takes_o());
        for f in [DForm::Exact, DForm::StoredO, DForm::CorrectedO] {
            assert_eq!(DForm::of_value(f.value()), Some(f));
        }
        assert_eq!(DForm::of_value(3), None);
    }

    #[test]
    fn d_from_o_launches_the_d_kernel_before_either_query_side() {
        for max_lq in [2, 65] {
            let d = LaunchDims {
                tq: 70,
                tk: 70,
                max_lq,
                max_lk: 70,
                d_from_o: true,
                ..dims(Dtype::Bf16, true, 64)
            };
            let ls = launches(Gpu::Cuda, Family::Fallback, Dir::Bwd, &d).unwrap();
            assert_eq!(ls[0].kernel, Kernel::FallbackDelta, "{ls:?}");
            assert_eq!(ls[0].name, "fallback_bwd_delta_bf16_o32");
            assert_eq!(ls[0].blocks, blocks(70 * 2).unwrap());
            assert_eq!(ls.len(), 3, "{ls:?}");
            let off = LaunchDims {
                d_from_o: false,
                ..d
            };
            let plain = launches(Gpu::Cuda, Family::Fallback, Dir::Bwd, &off).unwrap();
            assert_eq!(plain[..], ls[1..]);
            // The forward is the same launch either way.
            assert_eq!(
                launches(Gpu::Cuda, Family::Fallback, Dir::Fwd, &d),
                launches(Gpu::Cuda, Family::Fallback, Dir::Fwd, &off)
            );
        }
        let args = args_of(
            Kernel::FallbackDelta,
            &dims(Dtype::F16, false, 64),
            &Ptrs::default(),
        );
        let codes: String = args.iter().map(Arg::code).collect();
        assert_eq!(codes, "PPPPPPP4448");
    }

    #[test]
    fn grids_past_a_1d_grid_are_refused() {
        assert_eq!(blocks(0), Ok(0));
        assert_eq!(blocks(-3), Ok(0));
        assert_eq!(blocks(9), Ok(3));
        let items = 4 * i32::MAX as i64;
        assert_eq!(blocks(items), Err(Refusal::Grid { items }));
        assert_eq!(
            Refusal::Grid { items: 7 }.to_string(),
            "7 work items exceed the 1-D grid"
        );
    }
}
