//! The cargo-fuzz targets' bodies: each turns the fuzzer's bytes into a structured input
//! through the harness's [`Draw`] trait and hands it to one check of [`super::oracles`].
//! They live in the library so the committed seed corpora replay in the ordinary test run
//! (`tests/fuzz_corpus.rs`) with exactly the code the fuzzer runs.

use super::gen::{build, draw_geometry};
use super::oracles::{self, Verdict, Violation};
use super::props::Checker;
use super::rng::Draw;
use crate::backend::cpu::CpuBackend;
use crate::config::{AttnConfig, Bias, LayoutKind};
use crate::dispatch::gate::Dispatcher;
use crate::dispatch::{Arch, EnvView, Profile};
use crate::segments::SegmentIds;
use crate::workspace::Shape;
use arbitrary::Unstructured;
use smallseq_reference::{AttnParams, Dropout, Dtype, Layout, Mask, Side, Window};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

/// The fuzz targets (one binary each under `fuzz/fuzz_targets/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Config JSON and THD layout validation, and the segment-id conversion.
    ConfigLayout,
    /// Case-file parsing from arbitrary bytes.
    CaseFile,
    /// The dispatcher against the surface's rule table.
    Dispatch,
    /// The workspace planner's invariants.
    Workspace,
    /// The CPU backend against the reference on tiny cases.
    CpuBackend,
}

impl Target {
    pub const ALL: [Target; 5] = [
        Target::ConfigLayout,
        Target::CaseFile,
        Target::Dispatch,
        Target::Workspace,
        Target::CpuBackend,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::ConfigLayout => "config_layout",
            Target::CaseFile => "case_file",
            Target::Dispatch => "dispatch",
            Target::Workspace => "workspace",
            Target::CpuBackend => "cpu_backend",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Target::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown fuzz target '{s}'"))
    }
}

/// [`Draw`] over the fuzzer's bytes: exhausted input draws 0, the simplest choice.
pub struct ByteDraw<'a>(pub Unstructured<'a>);

impl Draw for ByteDraw<'_> {
    fn below(&mut self, n: u64) -> u64 {
        self.0.int_in_range(0..=n.max(1) - 1).unwrap_or(0)
    }
}

static REJECTS: Mutex<BTreeMap<(Target, &'static str), u64>> = Mutex::new(BTreeMap::new());

/// Rejections so far in this process, per target and reason.
pub fn reject_counts() -> BTreeMap<(Target, &'static str), u64> {
    REJECTS.lock().map(|m| m.clone()).unwrap_or_default()
}

fn count(target: Target, reason: &'static str) {
    if let Ok(mut m) = REJECTS.lock() {
        let n = m.entry((target, reason)).or_insert(0);
        *n += 1;
        // The fuzzer's own log shows the domain's edges as they are hit, at powers of two.
        if n.is_power_of_two() && std::env::var_os("SMALLSEQ_FUZZ_QUIET").is_none() {
            eprintln!("smallseq fuzz {target}: rejected {n} inputs: {reason}");
        }
    }
}

/// Runs one target on one input; rejections are counted.
pub fn run(target: Target, data: &[u8]) -> Result<Verdict, Violation> {
    let verdict = match target {
        Target::ConfigLayout => config_layout(data),
        Target::CaseFile => oracles::case_file_round_trip(data),
        Target::Dispatch => dispatch(&mut ByteDraw(Unstructured::new(data))),
        Target::Workspace => {
            oracles::workspace_plan(&draw_shape(&mut ByteDraw(Unstructured::new(data))))
        }
        Target::CpuBackend => cpu_backend(&mut ByteDraw(Unstructured::new(data))),
    }?;
    if let Verdict::Rejected(why) = verdict {
        count(target, why);
    }
    Ok(verdict)
}

/// The first byte picks the sub-area, so one corpus covers config text, raw layouts and
/// segment ids.
fn config_layout(data: &[u8]) -> Result<Verdict, Violation> {
    let Some((&sel, rest)) = data.split_first() else {
        return Ok(Verdict::Rejected("empty input"));
    };
    match sel % 3 {
        0 => match std::str::from_utf8(rest) {
            Ok(text) => oracles::config_round_trip(text),
            Err(_) => Ok(Verdict::Rejected("config text is not UTF-8")),
        },
        1 => {
            let d = &mut ByteDraw(Unstructured::new(rest));
            let n = d.range(0, 7);
            let q = draw_raw_side(d, n);
            let kv_n = if d.percent(90) { n } else { d.range(0, 7) };
            let kv = draw_raw_side(d, kv_n);
            oracles::layout_validation(&q, &kv)
        }
        _ => {
            let d = &mut ByteDraw(Unstructured::new(rest));
            let (ids, max_segments) = draw_segment_ids(d);
            oracles::segment_round_trip(&ids, max_segments)
        }
    }
}

/// A side whose arrays are mostly near-valid (non-decreasing small steps) with occasional
/// arbitrary values, so both acceptance and every rejection reason are reached.
pub fn draw_raw_side<D: Draw>(d: &mut D, n: usize) -> Side {
    let array = |d: &mut D| -> Vec<i32> {
        let mut v = Vec::with_capacity(n);
        let mut x = if d.percent(90) {
            0
        } else {
            d.range(0, 6) as i32 - 2
        };
        for _ in 0..n {
            v.push(x);
            x += if d.percent(92) {
                d.range(0, 6) as i32
            } else {
                d.range(0, 60) as i32 - 40
            };
        }
        v
    };
    let cu = array(d);
    let padded = d.percent(50).then(|| {
        // Offsets that start where cu does and add gaps, sometimes too few.
        let mut off = Vec::with_capacity(n);
        let mut x = if d.percent(85) {
            0
        } else {
            d.range(0, 4) as i32 - 1
        };
        for i in 0..n {
            off.push(x);
            let len = cu.get(i + 1).map_or(0, |c| c - cu[i]);
            x += len + d.range(0, 3) as i32 - i32::from(d.percent(8));
        }
        off
    });
    let last = padded
        .as_ref()
        .unwrap_or(&cu)
        .last()
        .copied()
        .unwrap_or(0)
        .max(0) as usize;
    let tokens = (last + d.range(0, 3)).saturating_sub(usize::from(d.percent(8)));
    Side { cu, padded, tokens }
}

/// Segment ids of mostly canonical rows (runs numbered in order, paired across sides), with
/// occasional arbitrary ids, and a `max_segments`.
pub fn draw_segment_ids<D: Draw>(d: &mut D) -> (SegmentIds, usize) {
    let batch = d.range(0, 4);
    let seq_q = d.range(1, 12);
    let seq_kv = if d.percent(70) { seq_q } else { d.range(1, 12) };
    let max_segments = d.range(1, 4);
    let row = |d: &mut D, seq: usize, segs: usize| -> Vec<i32> {
        let mut ids = Vec::with_capacity(seq);
        let mut id = 0;
        while ids.len() < seq {
            let run = d.range(1, 4).min(seq - ids.len());
            let value: i32 = if id < segs && d.percent(70) {
                id += 1;
                id as i32
            } else if d.percent(90) {
                0
            } else {
                d.range(0, 6) as i32 - 1
            };
            ids.extend(std::iter::repeat_n(value, run));
        }
        ids
    };
    let (mut ids_q, mut ids_kv) = (Vec::new(), Vec::new());
    for _ in 0..batch {
        let segs = d.range(0, max_segments + 1);
        ids_q.extend(row(d, seq_q, segs));
        ids_kv.extend(row(d, seq_kv, segs));
    }
    let ids = SegmentIds {
        batch,
        seq_q,
        seq_kv,
        pos_q: vec![0; ids_q.len()],
        pos_kv: vec![0; ids_kv.len()],
        ids_q,
        ids_kv,
    };
    (ids, max_segments)
}

/// A config over the whole static input space of both surfaces.
pub fn draw_config<D: Draw>(d: &mut D) -> AttnConfig {
    let kv_heads = d.range(1, 5);
    let heads = kv_heads * d.pick(&[1, 1, 1, 2, 3]);
    let head_dim = d.pick(&[0, 16, 32, 63, 64, 96, 128, 192, 256, 257, 512]);
    let head_dim_v = if d.percent(85) {
        head_dim
    } else {
        d.pick(&[32, 64, 128])
    };
    let window = if d.percent(70) {
        Window::NONE
    } else {
        Window {
            left: d.range(0, 20) as i64 - 1,
            right: d.range(0, 20) as i64 - 1,
        }
    };
    AttnConfig {
        dtype: d.pick(&Dtype::ALL),
        params: AttnParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim_qk: head_dim,
            head_dim_v,
            mask: d.pick(&Mask::ALL),
            window,
            scale: d.pick(&[1.0, 0.125, 3.0]),
            dropout: if d.percent(90) {
                Dropout::NONE
            } else {
                Dropout {
                    p: d.pick(&[0.1, 0.5, 1.0]),
                    seed: d.below(1 << 20),
                    offset: d.below(1 << 20),
                }
            },
            bias: smallseq_reference::AttnBias::None,
        },
        bias: if d.percent(90) {
            Bias::None
        } else {
            // A config alone carries no bias values: the type §1.9 does not define.
            Bias::Other("pre_scale_bias".into())
        },
        layout: if d.percent(85) {
            LayoutKind::Thd
        } else {
            LayoutKind::Bshd
        },
    }
}

/// A valid layout with lengths and spans around the 17-token limit; BSHD-shaped when the
/// config says BSHD.
pub fn draw_layout<D: Draw>(d: &mut D, kind: LayoutKind) -> Layout {
    let b = d.range(0, 5);
    if kind == LayoutKind::Bshd {
        let s = d.pick(&[1, 16, 17, 18]);
        let s_kv = if d.percent(80) {
            s
        } else {
            d.pick(&[1, 17, 18])
        };
        return crate::case::bshd_layout(b, s, s_kv);
    }
    let padded = d.percent(50);
    let side = |d: &mut D| {
        let (mut cu, mut off) = (vec![0i32], vec![0i32]);
        for _ in 0..b {
            let len = d.pick(&[0, 1, 2, 16, 17, 18, 20]);
            let gap = if padded { d.pick(&[0, 0, 1, 3]) } else { 0 };
            cu.push(cu[cu.len() - 1] + len);
            off.push(off[off.len() - 1] + len + gap);
        }
        let tokens = off[b] as usize + d.range(0, 2);
        Side {
            cu,
            padded: padded.then_some(off),
            tokens,
        }
    };
    let q = side(d);
    let kv = side(d);
    Layout { q, kv }
}

fn dispatch<D: Draw>(d: &mut D) -> Result<Verdict, Violation> {
    let config = draw_config(d);
    let layout = draw_layout(d, config.layout);
    let mut env = EnvView::default();
    for key in crate::dispatch::facts::ENV_KEYS {
        env.set(
            key,
            d.pick(&[None, Some("1"), Some("0"), Some("yes"), Some("")]),
        );
    }
    let arch = d.pick(&["gfx942", "gfx950", "gfx90a", "sm_90", "sm_80", "cpu"]);
    let dispatcher = Dispatcher {
        profile: d.pick(&[Profile::Native, Profile::Te625]),
        arch: Arch::from_str(arch).map_err(|e| format!("built-in arch list: {e}"))?,
        env,
        backend_has_kernel: d.percent(80),
        defects: Default::default(),
    };
    oracles::dispatch_agrees(&dispatcher, &config, &layout)
}

/// A planner input; sizes reach far past what a case allocates, since planning is arithmetic
/// (and now and then past what the check accepts, to keep that edge counted).
pub fn draw_shape<D: Draw>(d: &mut D) -> Shape {
    let size = |d: &mut D| match d.below(8) {
        0..=2 => d.range(0, 4),
        3..=5 => d.range(0, 70_000),
        6 => 1 << d.range(0, 24),
        _ => d.range(0, usize::MAX >> 8),
    };
    let tq = size(d);
    let tk = size(d);
    let kv_heads = d.range(1, 16);
    Shape {
        tq,
        tk,
        tq_addressed: if d.percent(90) {
            d.range(0, tq.min(1 << 20))
        } else {
            size(d)
        },
        heads: kv_heads * d.range(1, 8),
        kv_heads,
        head_dim_qk: d.pick(&[16, 64, 128, 256, 512]),
        head_dim_v: d.pick(&[16, 64, 128, 256, 512]),
        thd: d.percent(80),
    }
}

/// Token budget of a CPU-backend fuzz case: tiny keeps the fuzzer at hundreds of executions
/// a second while still reaching the 17/18 boundary.
const TINY_TOKENS: usize = 96;

fn cpu_backend<D: Draw>(d: &mut D) -> Result<Verdict, Violation> {
    let mut g = draw_geometry(d);
    if g.layout.q.tokens > TINY_TOKENS || g.layout.kv.tokens > TINY_TOKENS {
        return Ok(Verdict::Rejected("more tokens than a tiny case"));
    }
    // Small heads keep each case cheap; the head count and dims the gate tests stay legal.
    let p = &mut g.config.params;
    let group = p.group_size();
    p.num_kv_heads = p.num_kv_heads.min(2);
    p.num_heads = p.num_kv_heads * group;
    if p.head_dim_qk > 64 && !(g.config.layout == LayoutKind::Thd && d.percent(20)) {
        p.head_dim_v = p.head_dim_v.min(64);
        p.head_dim_qk = 64;
    }
    let seed = d.below(u64::MAX);
    let case = build(&g, seed).map_err(|e| format!("generator built an invalid case: {e}"))?;
    let backend = CpuBackend::default();
    let checker = Checker::isolated(&backend);
    // A failure leaves a capsule beside the fuzzer's own crash file, for `smallseq repro`.
    let dir = std::path::Path::new("target/fuzz-capsules");
    let path = dir.join(format!("cpu_backend-{seed:016x}.safetensors"));
    let capsule = std::fs::create_dir_all(dir)
        .ok()
        .map(|()| (path.as_path(), "cpu"));
    super::backend_oracle::backend_properties(&checker, &case, seed, capsule)
}
