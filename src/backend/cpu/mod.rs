//! The CPU backend, the embedded default: the small-seq path as a per-slot, per-tile
//! computation with the kernels' roundings ([`small_seq`]), and the fallback path as a
//! flash-style online softmax over key blocks of 64 in f32 ([`fallback`]). Two different
//! algorithms, so fallback equivalence is a real comparison without a GPU.
//!
//! The same type, configured with TE #625's defects, is the `te625-model` backend.

mod fallback;
mod rows;
mod small_seq;
mod sums;

use super::{BackendInfo, BwdArgs, BwdBufs, Compute, FwdArgs, FwdBufs, MutationHooks};
use crate::design::Design;
use crate::dispatch::gate::GateDefects;
use crate::dispatch::Arch;
use crate::error::Result;
use crate::mutants::{Defects, Mutant};
use half::bf16;
use ndarray::ArrayView3;
use smallseq_reference::{visible, AttnBias, AttnParams, CausalAlign, Dtype, Layout, Mask, Window};
use std::collections::BTreeMap;

/// The CPU backend, optionally with planted defects.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    pub defects: Defects,
    /// Reported name (`cpu`, or `te625-model`).
    pub label: Option<&'static str>,
    /// Reported arch (the TE model poses as gfx942).
    pub arch_override: Option<&'static str>,
    /// Confine the defects to the small-seq path: TE's fallback is the regular CK path,
    /// which does not share the small-seq kernel's bugs.
    pub small_seq_only: bool,
    /// The fallback backward takes D = rowsum(dO∘O) from the O passed in instead of Σ P·dP
    /// (docs/semantics.md §1.7; the design [`crate::design::Design::ProjectDFromO`]).
    pub d_from_o: bool,
}

/// TE #625's defects as modelled here (te-smallseq-path.md §3.2 and §6). Its padded-span
/// gate is part of the `te625` dispatch surface, not a kernel defect.
pub const TE625_DEFECTS: [Mutant; 5] = [
    Mutant::LsePermuted,
    Mutant::CausalIgnored,
    Mutant::WindowIgnored,
    Mutant::NanOnEmptyKv,
    Mutant::WorkspaceEnvMismatch,
];

impl CpuBackend {
    /// A CPU backend with planted bugs.
    pub fn mutant(defects: Defects) -> Self {
        CpuBackend {
            defects,
            ..Default::default()
        }
    }

    /// The CPU model of TE #625's small-seq path, with its defects, posing as gfx942.
    pub fn te625_model() -> Self {
        Self::te625_model_with(&TE625_DEFECTS)
    }

    /// The TE model with only `defects` (for attributing a failure to one defect).
    pub fn te625_model_with(defects: &[Mutant]) -> Self {
        CpuBackend {
            defects: Defects::of(defects),
            label: Some("te625-model"),
            arch_override: Some("gfx942"),
            small_seq_only: true,
            d_from_o: false,
        }
    }

    /// This backend with the fallback backward's D taken from the stored O (`d_from_o`), as
    /// the GPU kernels built with `FTB_D_FROM_O=1`.
    pub fn with_d_from_o(self) -> Self {
        CpuBackend {
            d_from_o: true,
            ..self
        }
    }

    /// The backend the fallback path runs on.
    fn for_fallback(&self) -> std::borrow::Cow<'_, Self> {
        if self.small_seq_only {
            std::borrow::Cow::Owned(CpuBackend {
                defects: Defects::none(),
                ..self.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(self)
        }
    }

    fn has(&self, m: Mutant) -> bool {
        self.defects.has(m)
    }

    /// Each element of `xs` rounded to `dt` for an output store, in place (NaN in place of an
    /// overflow under [`Mutant::NanOnOverflow`]): a row at a time, which rounds eight values a
    /// step ([`Dtype::round_in_place`]).
    fn store_all(&self, dt: Dtype, xs: &mut [f32]) {
        dt.round_in_place(xs);
        if self.has(Mutant::NanOnOverflow) {
            xs.iter_mut()
                .filter(|y| y.is_infinite())
                .for_each(|y| *y = f32::NAN);
        }
    }

    /// The mask predicate, as a (possibly mutated) kernel evaluates it.
    fn visible(&self, p: &AttnParams, r: usize, c: usize, lq: usize, lk: usize) -> bool {
        let mut mask = p.mask;
        if self.has(Mutant::CausalIgnored) {
            mask = Mask::NoMask;
        } else if self.has(Mutant::CausalTopLeft) && mask.causal() == Some(CausalAlign::BottomRight)
        {
            mask = Mask::Causal;
        }
        let window = if self.has(Mutant::WindowIgnored) {
            Window::NONE
        } else {
            p.window
        };
        visible(mask, window, r, c, lq, lk)
    }

    /// The kernel's view of slot `i`: `(lq, lk, off_q, off_kv)`.
    fn slot(&self, layout: &Layout, i: usize) -> SlotGeom {
        let b = layout.slots();
        let mut lq = layout.q.len(i);
        let mut lk = layout.kv.len(i);
        if self.has(Mutant::SpanAsLength) {
            lq = layout.q.span(i);
            lk = layout.kv.span(i);
        }
        if self.has(Mutant::CuSeqlensOffByOne) && i + 1 == b {
            lq = lq.saturating_sub(1);
        }
        SlotGeom {
            lq,
            lk,
            oq: layout.q.offset(i),
            ok: layout.kv.offset(i),
            next_ok: layout.kv.offsets()[i + 1] as usize,
        }
    }

    /// The kv head query head `h` reads.
    fn kv_head(&self, p: &AttnParams, h: usize) -> usize {
        if self.has(Mutant::KvHeadModulo) {
            h % p.num_kv_heads
        } else if self.has(Mutant::HeadIndexAbove16) && h >= 16 {
            (h & 15) / p.group_size()
        } else {
            h / p.group_size()
        }
    }

    /// Loads row `t`, head `h` of a tensor as the kernel's loader does.
    fn load(&self, dtype: Dtype, t: &ArrayView3<f32>, row: usize, h: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(t.shape()[2]);
        self.load_into(dtype, t, row, h, &mut out);
        out
    }

    /// [`Self::load`], appended to `out`.
    fn load_into(
        &self,
        dtype: Dtype,
        t: &ArrayView3<f32>,
        row: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) {
        let lane = t.slice(ndarray::s![row, h, ..]);
        if dtype == Dtype::F16 && self.has(Mutant::F16ReadAsBf16) {
            out.extend(
                lane.iter()
                    .map(|&x| bf16::from_bits(half::f16::from_f32(x).to_bits()).to_f32()),
            );
        } else if let Some(s) = lane.as_slice() {
            out.extend_from_slice(s);
        } else {
            out.extend(lane.iter().copied());
        }
    }

    /// A small-seq output before [`Self::store`]: unchanged, or under
    /// [`Mutant::RoundTowardZero`] already rounded to the dtype toward zero (exactly
    /// representable, so the store's rounding keeps it).
    fn toward_zero(&self, dtype: Dtype, x: f32) -> f32 {
        if !self.has(Mutant::RoundTowardZero) || dtype == Dtype::F32 {
            return x;
        }
        let r = dtype.round(x);
        if r.abs() <= x.abs() {
            return r;
        }
        // One step of the dtype toward zero: both 16-bit types are sign-magnitude, so the
        // magnitude's bit pattern less one is the next value down (inf becomes the largest).
        match dtype {
            Dtype::Bf16 => bf16::from_bits(bf16::from_f32(r).to_bits() - 1).to_f32(),
            _ => half::f16::from_bits(half::f16::from_f32(r).to_bits() - 1).to_f32(),
        }
    }

    fn scale(&self, p: &AttnParams) -> f32 {
        let s = p.scale as f32;
        if self.has(Mutant::ScaleMissing) {
            1.0
        } else if self.has(Mutant::ScaleTwice) {
            s * s
        } else {
            s
        }
    }

    fn lse_of(&self, m: f32, l: f32) -> f32 {
        if l > 0.0 {
            let lse = m + l.ln();
            if self.has(Mutant::LseLog2) {
                lse * std::f32::consts::LOG2_E
            } else {
                lse
            }
        } else {
            f32::NEG_INFINITY
        }
    }

    /// Index of `lse[t, h]` as the backward reads it (`Tq` rows, `H` heads).
    /// Dropout's f32 factor of element `(r, c)` of head `h` in slot `slot` (1 without
    /// dropout): the Philox index as the fallback kernel forms it.
    fn dropout_factor(&self, p: &AttnParams, slot: usize, h: usize, r: usize, c: usize) -> f32 {
        let d = &p.dropout;
        if !d.is_active() {
            return 1.0;
        }
        let (r, c) = if self.has(Mutant::PhiloxIndexSwapped) {
            (c, r)
        } else {
            (r, c)
        };
        if d.keep(slot, p.num_heads, h, r, c) {
            d.rescale() as f32
        } else {
            0.0
        }
    }

    /// The bias's f32 value at `(r, c)` of head `h` in slot `slot` (`docs/semantics.md` §1.9),
    /// 0 without one.
    fn bias(&self, p: &AttnParams, slot: usize, h: usize, r: usize, c: usize, g: &SlotGeom) -> f32 {
        match &p.bias {
            AttnBias::PostScale(t) if self.has(Mutant::BiasBroadcastWrongAxis) => {
                let (bb, hb, _, _) = t.dim();
                t[[h.min(bb - 1), slot.min(hb - 1), r, c]]
            }
            b => b.at32(slot, h, r, c, g.lq, g.lk),
        }
    }

    fn lse_index(&self, t: usize, h: usize, tq: usize, heads: usize) -> usize {
        if self.has(Mutant::LsePermuted) {
            // TE's pad_remap_lse: aux[t·H + h] = W[h·Tq + t], a head-major read of the
            // token-major buffer.
            h * tq + t
        } else {
            t * heads + h
        }
    }
}

/// One slot as a kernel sees it.
#[derive(Clone, Copy, Debug)]
struct SlotGeom {
    lq: usize,
    lk: usize,
    oq: usize,
    ok: usize,
    /// `off_kv[i+1]`: where the neighbouring slot's keys start.
    next_ok: usize,
}

/// One slot's forward results, rows in slot order: `o [lq, H, Dv]`, `lse [lq, H]`.
struct SlotFwd {
    o: Vec<f32>,
    lse: Vec<f32>,
}

impl SlotFwd {
    fn new(g: &SlotGeom, heads: usize, dv: usize) -> Self {
        SlotFwd {
            o: vec![0f32; g.lq * heads * dv],
            lse: vec![f32::NEG_INFINITY; g.lq * heads],
        }
    }

    /// Writes the slot's rows into the output buffers; `keep_lse(row)` says which LSE rows
    /// the kernel stores.
    fn store(
        &self,
        out: &mut FwdBufs,
        g: &SlotGeom,
        heads: usize,
        dv: usize,
        keep_lse: impl Fn(usize) -> bool,
    ) {
        let row = heads * dv;
        for t in 0..g.lq {
            for (j, x) in self.o[t * row..(t + 1) * row].iter().enumerate() {
                out.o.put((g.oq + t) * row + j, *x);
            }
            if keep_lse(t) {
                for h in 0..heads {
                    out.lse.put((g.oq + t) * heads + h, self.lse[t * heads + h]);
                }
            }
        }
    }
}

/// One slot's backward results: `dq [lq, H, Dqk]`, `delta [lq, H]`, and dK/dV per query
/// head (`[lk, H, D]`).
struct SlotBwd {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    delta: Vec<f32>,
    /// dS `[H, lq, lk]` where a post-scale bias takes its gradient (the fallback's dBias).
    ds: Option<Vec<f32>>,
}

impl SlotBwd {
    fn new(g: &SlotGeom, heads: usize, d: usize, dvd: usize) -> Self {
        SlotBwd {
            dq: vec![0f32; g.lq * heads * d],
            dk: vec![0f32; g.lk * heads * d],
            dv: vec![0f32; g.lk * heads * dvd],
            delta: vec![0f32; g.lq * heads],
            ds: None,
        }
    }

    /// Writes dQ rows and, when planned, D into the workspace's delta region.
    fn store_q_side(
        &self,
        out: &mut BwdBufs,
        g: &SlotGeom,
        heads: usize,
        d: usize,
        delta_at: Option<usize>,
    ) {
        for t in 0..g.lq {
            for (j, x) in self.dq[t * heads * d..(t + 1) * heads * d]
                .iter()
                .enumerate()
            {
                out.dq.put((g.oq + t) * heads * d + j, *x);
            }
            if let Some(base) = delta_at {
                for h in 0..heads {
                    out.workspace
                        .put(base + (g.oq + t) * heads + h, self.delta[t * heads + h]);
                }
            }
        }
    }
}

impl BackendInfo for CpuBackend {
    fn name(&self) -> &str {
        self.label.unwrap_or("cpu")
    }

    fn concurrent_cases(&self) -> bool {
        true
    }

    fn provenance(&self) -> BTreeMap<String, String> {
        let mut p = BTreeMap::from([
            (
                "build".to_string(),
                format!("smallseq {}", env!("CARGO_PKG_VERSION")),
            ),
            (
                "target".to_string(),
                format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
            ),
        ]);
        let defects = self.defects.list();
        if !defects.is_empty() {
            let names: Vec<&str> = defects.iter().map(|m| m.name()).collect();
            p.insert("defects".into(), names.join(","));
        }
        p
    }

    fn arch(&self) -> Arch {
        self.arch_override
            .map(|a| a.parse().expect("static arch name"))
            .unwrap_or_else(Arch::cpu)
    }

    fn has_small_seq(&self) -> bool {
        true
    }

    fn computes_bias(&self) -> bool {
        true
    }

    fn computes_dropout(&self) -> bool {
        true
    }

    fn rounding_budget(&self, tensor: &str) -> Option<f64> {
        super::rounding_budget_of(self.name(), tensor)
    }

    fn design(&self) -> Design {
        if self.d_from_o {
            Design::ProjectDFromO
        } else {
            Design::Project
        }
    }
}

impl MutationHooks for CpuBackend {
    fn gate_defects(&self) -> GateDefects {
        GateDefects {
            max_len: if self.has(Mutant::GateLimit16) {
                Some(16)
            } else if self.has(Mutant::GateLimit18) {
                Some(18)
            } else {
                None
            },
            accept_gqa: self.has(Mutant::GateAcceptsGqa),
            span_as_length: false,
            launch_on_empty: self.has(Mutant::UninitWorkspaceOnEmpty),
            carve_unsized: self.has(Mutant::WorkspaceEnvMismatch),
        }
    }

    fn zeroes_dont_care(&self) -> bool {
        !self.has(Mutant::DontCareNotZeroed)
    }

    fn segment_defects(&self) -> Defects {
        Defects::of(
            &[Mutant::SegmentConversionSlip]
                .into_iter()
                .filter(|m| self.has(*m))
                .collect::<Vec<_>>(),
        )
    }
}

impl Compute for CpuBackend {
    fn small_seq_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        small_seq::forward(self, args, out)
    }

    fn fallback_fwd(&self, args: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
        fallback::forward(&self.for_fallback(), args, out)
    }

    fn small_seq_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        small_seq::backward(self, args, out)
    }

    fn fallback_bwd(&self, args: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
        fallback::backward(&self.for_fallback(), args, out)
    }
}
