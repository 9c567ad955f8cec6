//! Proptest strategies for every input the suites need.

use ndarray::Array3;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use smallseq::config::{AttnConfig, Bias, LayoutKind};
use smallseq::dispatch::{Arch, EnvView, Profile};
use smallseq::segments::SegmentIds;
use smallseq::workspace::Shape;
use smallseq::Case;
use smallseq_reference::{AttnParams, Dropout, Dtype, Layout, Mask, Side, Window};

/// One side's arrays for `b` slots: per-slot (length, gap), then tail slack.
fn side_from(lens_gaps: &[(usize, usize)], padded: bool, slack: usize) -> Side {
    let (mut cu, mut off) = (vec![0i32], vec![0i32]);
    for &(len, gap) in lens_gaps {
        cu.push(cu[cu.len() - 1] + len as i32);
        off.push(off[off.len() - 1] + (len + gap) as i32);
    }
    let tokens = off[off.len() - 1] as usize + slack;
    Side {
        cu,
        padded: padded.then_some(off),
        tokens,
    }
}

/// Valid THD layouts: up to `max_b` slots, lengths up to `max_len`, optional padding gaps
/// between slots and slack after the last.
pub fn valid_layout(max_b: usize, max_len: usize) -> impl Strategy<Value = Layout> {
    (0..=max_b, any::<bool>())
        .prop_flat_map(move |(b, padded)| {
            let slot = (0..=max_len, 0..=3usize);
            (
                vec(slot.clone(), b),
                vec(slot, b),
                Just(padded),
                0..=3usize,
                0..=3usize,
            )
        })
        .prop_map(|(q, kv, padded, sq, sk)| Layout {
            q: side_from(&q, padded, sq),
            kv: side_from(&kv, padded, sk),
        })
}

/// Offsets arrays that are sometimes valid and sometimes not: prefix sums of small steps,
/// occasionally with an arbitrary element.
fn offsets(n: usize) -> impl Strategy<Value = Vec<i32>> {
    (
        vec(0i32..6, n),
        option::weighted(0.3, (0..n.max(1), -20i32..60)),
        prop_oneof![9 => Just(0i32), 1 => -2i32..3],
    )
        .prop_map(move |(steps, bad, start)| {
            let mut v: Vec<i32> = steps
                .iter()
                .scan(start, |acc, s| {
                    let x = *acc;
                    *acc += s;
                    Some(x)
                })
                .collect();
            if let Some((i, x)) = bad {
                if let Some(e) = v.get_mut(i) {
                    *e = x;
                }
            }
            v
        })
}

/// Arbitrary (often invalid) sides for the validation suite: array lengths, starts, order,
/// spans and buffer sizes all vary.
pub fn raw_sides() -> impl Strategy<Value = (Side, Side)> {
    (
        0..6usize,
        prop_oneof![9 => Just(None), 1 => (0..6usize).prop_map(Some)],
    )
        .prop_flat_map(|(n, kv_n)| {
            let kv_n = kv_n.unwrap_or(n);
            let side = |n: usize| {
                (offsets(n), option::of(offsets(n)), 0usize..40)
                    .prop_map(|(cu, padded, tokens)| Side { cu, padded, tokens })
            };
            (side(n), side(kv_n))
        })
}

/// Canonical segment ids (contiguous runs numbered in order, every segment on both sides, at
/// most `max_segments` per row) and `max_segments`.
pub fn canonical_segment_ids() -> impl Strategy<Value = (SegmentIds, usize)> {
    (0..4usize, 1..12usize, 1..12usize, 1..4usize).prop_flat_map(|(batch, sq, skv, max_seg)| {
        let row = move |seq: usize| vec((0..=max_seg as i32, 1..4usize), 1..=seq);
        (
            vec((row(sq), row(skv), 0..=max_seg), batch),
            Just((batch, sq, skv, max_seg)),
        )
            .prop_map(|(rows, (batch, sq, skv, max_seg))| {
                let (mut ids_q, mut ids_kv) = (Vec::new(), Vec::new());
                for (rq, rk, segs) in rows {
                    // A segment needs a token on both sides.
                    let segs = segs.min(sq).min(skv);
                    ids_q.extend(canonical_row(&rq, sq, segs));
                    ids_kv.extend(canonical_row(&rk, skv, segs));
                }
                let ids = SegmentIds {
                    batch,
                    seq_q: sq,
                    seq_kv: skv,
                    pos_q: vec![0; ids_q.len()],
                    pos_kv: vec![0; ids_kv.len()],
                    ids_q,
                    ids_kv,
                };
                (ids, max_seg)
            })
    })
}

/// A row of `seq` ids with exactly `segs` segments numbered 1..=segs in order, made from
/// (is-segment hint, run length) pairs; segments that do not fit are squeezed in at the end.
fn canonical_row(runs: &[(i32, usize)], seq: usize, segs: usize) -> Vec<i32> {
    let segs = segs.min(seq);
    let mut row = Vec::with_capacity(seq);
    let mut next = 1usize;
    for &(hint, run) in runs {
        let room = seq - row.len();
        // Leave one token for each segment still to place.
        let needed = segs + 1 - next;
        if room == 0 {
            break;
        }
        let pad = hint == 0 || next > segs;
        let spare = room.saturating_sub(needed);
        if pad {
            row.extend(std::iter::repeat_n(0, run.min(spare)));
        } else {
            row.extend(std::iter::repeat_n(
                next as i32,
                run.min(room - (needed - 1)),
            ));
            next += 1;
        }
    }
    while next <= segs && row.len() < seq {
        row.push(next as i32);
        next += 1;
    }
    row.resize(seq, 0);
    row
}

/// Configs over the whole static input space of both surfaces.
pub fn config() -> impl Strategy<Value = AttnConfig> {
    (
        select(Dtype::ALL.to_vec()),
        1..5usize,
        select(vec![1usize, 1, 2, 4]),
        select(vec![16usize, 32, 64, 96, 128, 192, 256, 512]),
        option::weighted(0.15, select(vec![32usize, 64, 128])),
        select(Mask::ALL.to_vec()),
        option::weighted(0.3, (-1i64..20, -1i64..20)),
        prop_oneof![9 => Just(Bias::None), 1 => Just(Bias::Other("pre_scale_bias".into()))],
        prop_oneof![9 => Just(0.0), 1 => Just(0.1)],
        prop_oneof![6 => Just(LayoutKind::Thd), 1 => Just(LayoutKind::Bshd)],
    )
        .prop_map(
            |(dtype, kv, group, d, dv, mask, window, bias, dropout, layout)| AttnConfig {
                dtype,
                params: AttnParams {
                    num_heads: kv * group,
                    num_kv_heads: kv,
                    head_dim_qk: d,
                    head_dim_v: dv.unwrap_or(d),
                    mask,
                    window: window.map_or(Window::NONE, |(left, right)| Window { left, right }),
                    scale: 1.0 / (d as f64).sqrt(),
                    dropout: Dropout {
                        p: dropout,
                        seed: 11,
                        offset: 3,
                    },
                    bias: smallseq_reference::AttnBias::None,
                },
                bias,
                layout,
            },
        )
}

/// A layout that matches the config's layout kind (uniform lengths for BSHD).
pub fn layout_for(kind: LayoutKind) -> BoxedStrategy<Layout> {
    match kind {
        LayoutKind::Thd => valid_layout(5, 20).boxed(),
        LayoutKind::Bshd => (
            0..4usize,
            select(vec![1usize, 16, 17, 18]),
            select(vec![1usize, 17, 18]),
        )
            .prop_map(|(b, s, skv)| smallseq::case::bshd_layout(b, s, skv))
            .boxed(),
    }
}

/// The dispatcher's inputs: environment values of every key it reads, an arch, a profile.
pub fn dispatch_env() -> impl Strategy<Value = (EnvView, Arch, Profile, bool)> {
    let value = select(vec![None, Some("1"), Some("0"), Some("true"), Some("")]);
    (
        vec(value, smallseq::dispatch::facts::ENV_KEYS.len()),
        select(vec!["gfx942", "gfx950", "gfx90a", "sm_90", "sm_80", "cpu"]),
        select(vec![Profile::Native, Profile::Te625]),
        proptest::bool::weighted(0.8),
    )
        .prop_map(|(values, arch, profile, has_kernel)| {
            let mut env = EnvView::default();
            for (key, v) in smallseq::dispatch::facts::ENV_KEYS.iter().zip(values) {
                env.set(key, v);
            }
            (env, arch.parse().expect("listed arch"), profile, has_kernel)
        })
}

/// Planner inputs, from empty to far larger than any case the harness allocates.
pub fn shape() -> impl Strategy<Value = Shape> {
    let size = prop_oneof![
        0usize..4,
        0usize..70_000,
        (0u32..30).prop_map(|e| 1usize << e)
    ];
    (
        size.clone(),
        size,
        1..16usize,
        1..8usize,
        select(vec![16usize, 64, 128, 256, 512]),
        select(vec![16usize, 64, 128, 256]),
        any::<bool>(),
    )
        .prop_flat_map(|(tq, tk, kv, group, dqk, dv, thd)| {
            (0..=tq).prop_map(move |tq_addressed| Shape {
                tq,
                tk,
                tq_addressed,
                heads: kv * group,
                kv_heads: kv,
                head_dim_qk: dqk,
                head_dim_v: dv,
                thd,
            })
        })
}

/// Input values: small multiples of powers of two (exact in every dtype), with now and then a
/// large or tiny one.
fn value(dtype: Dtype) -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => (-64i32..=64).prop_map(|x| x as f32 / 32.0),
        1 => (-8i32..=8).prop_map(|x| x as f32 * 16.0),
        1 => any::<f32>().prop_map(move |x| if x.is_finite() { dtype.round(x.clamp(-4.0, 4.0)) } else { 0.0 }),
    ]
}

fn tensor(dtype: Dtype, shape: [usize; 3]) -> impl Strategy<Value = Array3<f32>> {
    vec(value(dtype), shape.iter().product::<usize>())
        .prop_map(move |v| Array3::from_shape_vec(shape, v).expect("sized from shape"))
}

/// Poison for don't-care rows: what a framework may leave in padding.
fn poison_value(dtype: Dtype) -> impl Strategy<Value = f32> {
    let max = dtype.max_finite();
    select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, max, -max])
}

/// Small cases of one dtype: geometry first (heads, dims, mask, window, layout around the
/// 17-token limit), then every tensor sized from it; don't-care rows sometimes poisoned.
pub fn tiny_case(dtype: Dtype) -> impl Strategy<Value = Case> {
    tiny_case_grouped(dtype, vec![1, 1, 2])
}

/// As [`tiny_case`], with the GQA group size drawn from `groups` (e.g. `[2, 3]` for GQA
/// only, so a GQA relation needs no filtering).
pub fn tiny_case_grouped(dtype: Dtype, groups: Vec<usize>) -> impl Strategy<Value = Case> {
    let dims = if dtype == Dtype::F32 {
        vec![8usize, 16, 64]
    } else {
        vec![64usize, 64, 128]
    };
    (
        1..3usize,
        select(groups),
        select(dims),
        select(Mask::ALL.to_vec()),
        option::weighted(0.2, (-1i64..5, -1i64..5)),
        valid_layout(4, 18),
        proptest::bool::weighted(0.85),
        select(vec![1.0, 0.125, 3.0]),
    )
        .prop_flat_map(
            move |(kv, group, d, mask, window, layout, backward, scale)| {
                let config = AttnConfig {
                    dtype,
                    params: AttnParams {
                        num_heads: kv * group,
                        num_kv_heads: kv,
                        head_dim_qk: d,
                        head_dim_v: d,
                        mask,
                        window: window.map_or(Window::NONE, |(left, right)| Window { left, right }),
                        scale,
                        dropout: Dropout::NONE,
                        bias: smallseq_reference::AttnBias::None,
                    },
                    bias: Bias::None,
                    layout: LayoutKind::Thd,
                };
                let (tq, tk, h) = (layout.q.tokens, layout.kv.tokens, kv * group);
                let d_o = if backward {
                    tensor(dtype, [tq, h, d]).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                };
                (
                    Just((config, layout)),
                    tensor(dtype, [tq, h, d]),
                    tensor(dtype, [tk, kv, d]),
                    tensor(dtype, [tk, kv, d]),
                    d_o,
                    option::weighted(0.5, poison_value(dtype)),
                )
            },
        )
        .prop_map(|((config, layout), q, k, v, d_o, poison)| {
            let mut case =
                Case::new(config, layout, q, k, v, d_o).expect("strategy builds valid cases");
            if let Some(x) = poison {
                poison_dont_care(&mut case, x);
            }
            case
        })
}

fn poison_dont_care(case: &mut Case, x: f32) {
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let fill = |t: &mut Array3<f32>, valid: &[bool]| {
        for (r, _) in valid.iter().enumerate().filter(|(_, v)| !**v) {
            t.slice_mut(ndarray::s![r, .., ..]).fill(x);
        }
    };
    fill(&mut case.q, &vq);
    fill(&mut case.k, &vk);
    fill(&mut case.v, &vk);
}
