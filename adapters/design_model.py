#!/usr/bin/env python3
"""design_model: a correct attention that rounds where a shipped kernel design rounds, in
numpy, so that the judge can be tried against legitimate designs without their GPU.

Every design computes semantics.md §1 exactly; they differ only in where 16-bit and f32
roundings fall, which is all a correct kernel may differ in. A campaign through one of them
that fails is a harness error (the judge refuses a correct design), not a finding:

  smallseq fuzz --backend exec --worker 'python3 adapters/design_model.py --design fa2'

Designs (`--design`):
  fa2        FlashAttention-2 (PyTorch's flash SDPA and varlen): scores in f32, exp2 with
             log2(e) folded into the scale, online softmax over key blocks of `--block`
             (128) with the running maximum and sum rescaled, the unnormalised P rounded to
             the dtype for P·V and O divided by the sum at the end; the backward recomputes P
             from the stored LSE, rounds it for dV, forms D = rowsum(dO∘O) from the stored
             16-bit O, rounds dS for dQ and dK; with GQA, dK and dV are rounded per query
             head and the group summed once (flash_attn's `dk_expanded` summed by torch).
  normalised the same, but P normalised before it is rounded (one block, no rescaling) and
             D = Σ_j P·dP in f32 (smallseq's own kernels' choice for D).
  tf32       fa2's rounding points, with every product of an f32 case taken in TF32 (10-bit
             mantissa operands), as cuDNN and CUTLASS kernels may on f32 data.

Flush-to-zero (`--ftz`, any design): every f32 value the model forms (matmul operands and
results, exp2's, the running sums, D, dP − D, dS, the gradients) below 2^-126 is flushed to
zero, as a kernel built with fast math (-ftz=true) does; numpy's matmul keeps its own partial
sums, so the products inside one matmul are not flushed. Such a model declares no design:
the envelope's flush-to-zero allowance must pass it.

Capabilities: bf16 and f16 (and f32 for tf32), every mask and window, GQA, head_dim_v !=
head_dim_qk, backward and LSE. No bias, no dropout. Rows without keys: O = 0, LSE = -inf,
no gradient.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402

DESIGNS = ("fa2", "normalised", "tf32")
LOG2E = math.log2(math.e)
F32_MIN_NORMAL = np.float32(2.0**-126)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


class Design:
    def __init__(self, name: str, block: int, ftz: bool = False):
        self.name, self.block, self.ftz = name, block, ftz

    def flush(self, x) -> np.ndarray:
        """An f32 value as a flush-to-zero build holds it: subnormals are zero."""
        x = f32(x)
        if not self.ftz:
            return x
        return np.where(np.abs(x) < F32_MIN_NORMAL, np.float32(0), x).astype(np.float32)

    def operand(self, x: np.ndarray, dtype: str) -> np.ndarray:
        """An mma operand: the dtype's value (exact in f32), or TF32 for f32 in `tf32`."""
        if dtype == "f32" and self.name == "tf32":
            return self.flush(kit.round_to_dtype(x, "tf32"))
        return self.flush(x)

    def store(self, x: np.ndarray, dtype: str) -> np.ndarray:
        """A 16-bit intermediate (P, dS) or an output: rounded once from f32."""
        return f32(kit.round_to_dtype(self.flush(x), dtype))

    def matmul(self, a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
        """f32 accumulation of operands taken as the design's mma takes them."""
        return self.flush(f32(self.operand(a, dtype)) @ f32(self.operand(b, dtype)))

    def forward(self, s: np.ndarray, vis: np.ndarray, v: np.ndarray, dtype: str):
        """One head of one slot: s [Lq, Lk] f32 raw scores Q·Kᵀ (unscaled), vis [Lq, Lk],
        v [Lk, Dv]. Returns (O unrounded f32 [Lq, Dv], LSE f32 [Lq], rows [Lq] bool)."""
        lq, lk = s.shape
        rows = vis.any(axis=1)
        scale_log2 = f32(self.scale * LOG2E)
        m = np.full(lq, -np.inf, dtype=np.float32)
        l = np.zeros(lq, dtype=np.float32)
        acc = np.zeros((lq, v.shape[1]), dtype=np.float32)
        block = lk if self.name == "normalised" else self.block
        for c0 in range(0, lk, max(block, 1)):
            sb = np.where(vis[:, c0 : c0 + block], s[:, c0 : c0 + block], -np.inf)
            m_new = np.maximum(m, sb.max(axis=1, initial=-np.inf))
            m_use = np.where(np.isfinite(m_new), m_new, f32(0))
            alpha = np.where(np.isfinite(m), np.exp2(f32(m * scale_log2 - m_use * scale_log2)), f32(0))
            alpha = self.flush(alpha)
            e = np.where(np.isfinite(sb), np.exp2(f32(sb * scale_log2 - (m_use * scale_log2)[:, None])), f32(0))
            e = self.flush(e)
            l = self.flush(self.flush(l * alpha) + e.sum(axis=1, dtype=np.float32))
            if self.name == "normalised":
                p = self.store(e / np.where(l > 0, l, 1)[:, None], dtype)
                acc = self.flush(self.flush(acc * alpha[:, None]) + self.matmul(p, v[c0 : c0 + block], dtype))
            else:
                p = self.store(e, dtype)
                acc = self.flush(self.flush(acc * alpha[:, None]) + self.matmul(p, v[c0 : c0 + block], dtype))
            m = m_new
        if self.name == "normalised":
            o = acc
        else:
            o = self.flush(acc / np.where(l > 0, l, 1)[:, None])
        o = np.where(rows[:, None], o, f32(0))
        lse = np.where(rows, f32(m * f32(self.scale) + np.log(np.where(l > 0, l, 1))), f32(-np.inf))
        return o, f32(lse), rows

    def backward(self, s, vis, rows, q, k, v, d_o, o_stored, lse, dtype):
        """dQ, dK, dV of one head of one slot, unrounded f32, from the stored O and LSE."""
        scale = f32(self.scale)
        scale_log2 = f32(self.scale * LOG2E)
        lse_log2 = np.where(rows, f32(lse * f32(LOG2E)), f32(0))
        p = np.where(vis & rows[:, None], np.exp2(f32(s * scale_log2 - lse_log2[:, None])), f32(0))
        p = self.flush(p)
        p16 = self.store(p, dtype)
        dv = self.matmul(p16.T, d_o, dtype)
        dp = self.matmul(d_o, v.T, dtype)
        if self.name == "normalised":
            d = self.flush((self.flush(p * dp)).sum(axis=1, dtype=np.float32))
        else:
            d = self.flush((self.flush(self.flush(d_o) * self.flush(o_stored))).sum(axis=1, dtype=np.float32))
        ds = self.store(self.flush(p * self.flush(dp - d[:, None])), dtype)
        dq = self.flush(self.matmul(ds, k, dtype) * scale)
        dk = self.flush(self.matmul(ds.T, q, dtype) * scale)
        return dq, dk, dv


def attention(design: Design, case: kit.Case, want: frozenset) -> dict:
    c = case.config
    dt = c.dtype
    design.scale = c.scale
    out = kit.no_query_outputs(case)
    o_all, lse_all, dq_all, dk_all, dv_all = (out[n] for n in kit.OUTPUTS)
    grads = bool(want & {"dq", "dk", "dv"})
    g = c.group
    for i in range(case.sq.slots):
        lq, lk = int(case.sq.lens[i]), int(case.skv.lens[i])
        if lq == 0 or lk == 0:
            continue
        oq, ok = int(case.sq.starts[i]), int(case.skv.starts[i])
        vis = case.visible(i)
        dk_heads = np.zeros((lk, c.num_heads, c.head_dim_qk), dtype=np.float32)
        dv_heads = np.zeros((lk, c.num_heads, c.head_dim_v), dtype=np.float32)
        for h in range(c.num_heads):
            q = f32(case.q[oq : oq + lq, h])
            k = f32(case.k[ok : ok + lk, h // g])
            v = f32(case.v[ok : ok + lk, h // g])
            s = design.matmul(q, k.T, dt)
            o, lse, rows = design.forward(s, vis, v, dt)
            o_stored = design.store(o, dt)
            o_all[oq : oq + lq, h] = o_stored
            lse_all[oq : oq + lq, h] = lse
            if grads:
                d_o = f32(case.d_o[oq : oq + lq, h])
                dq, dk, dv = design.backward(s, vis, rows, q, k, v, d_o, o_stored, lse, dt)
                dq_all[oq : oq + lq, h] = design.store(dq, dt)
                if g > 1:
                    # per query head rounded, the group summed once in f32 (flash_attn's
                    # dk_expanded, reduced by torch)
                    dk, dv = design.store(dk, dt), design.store(dv, dt)
                dk_heads[:, h], dv_heads[:, h] = dk, dv
        if grads:
            dk_sum = dk_heads.reshape(lk, c.num_kv_heads, g, -1).sum(axis=2, dtype=np.float32)
            dv_sum = dv_heads.reshape(lk, c.num_kv_heads, g, -1).sum(axis=2, dtype=np.float32)
            dk_all[ok : ok + lk] = design.store(dk_sum, dt)
            dv_all[ok : ok + lk] = design.store(dv_sum, dt)
    return {name: a for name, a in out.items() if name in want}


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__)
    ap.add_argument("--design", choices=DESIGNS, default="fa2")
    ap.add_argument("--block", type=int, default=128, help="keys per online-softmax block (fa2, tf32)")
    ap.add_argument("--ftz", action="store_true",
                    help="flush subnormal f32 values to zero, as a fast-math (-ftz=true) build does")
    ap.add_argument("--declare", choices=["project", "envelope"], default=None,
                    help="declare this design in the handshake (caps.design; default: none), to "
                         "see the judge hold a model to a design it does not follow")
    args = ap.parse_args([] if argv is None else argv)
    if args.block < 1:
        ap.error(f"--block {args.block}: must be at least 1")
    design = Design(args.design, args.block, args.ftz)
    caps = kit.Caps(
        dtypes=["bf16", "f16"] + (["f32"] if args.design == "tf32" else []),
        masks=list(kit.MASKS), window=True, gqa=True, dv_ne_dqk=True, max_tokens=1 << 14,
        backward=True, lse=True, padded_offsets=True, arch="cpu", design=args.declare,
    )
    ftz = " --ftz" if args.ftz else ""
    prov = {"implementation": f"adapters/design_model.py --design {args.design} --block {args.block}{ftz}"}
    return kit.Adapter(f"design-model-{args.design}", f"numpy {np.__version__}", caps,
                       lambda case, want: attention(design, case, want), prov, no_key_lse=args.no_key_lse)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter(sys.argv[1:])))
