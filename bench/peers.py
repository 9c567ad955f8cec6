#!/usr/bin/env python3
"""Times every PyTorch and JAX "peer" attention on the workloads of `smallseq bench` and
prints ratios against the kernels' figures from bench.json.

Usage on the GPU machine (needs torch with CUDA; triton for the timer, else CUDA events; JAX with
CUDA for the JAX peers, run by bench/peers_jax.py in its own process):

    python3 bench/peers.py [BENCH_JSON]          # writes $OUT/peers.json (OUT default /tmp)

Here (no GPU): `python3 bench/peers.py --device cpu --small` runs tiny workloads with the CPU
peers (SDPA math, JAX xla), the correctness check, the tables, the JSON and a self-test that
deliberately wrong peers are flagged; it exits 1 if the self-test fails.

Workloads: src/cli/bench.rs `workloads()` and `lengths()` (splitmix64 seed 1, q then kv length per
slot). bf16, non-causal, no mask beyond padding, scale 1/sqrt(D). Packed peers get the THD
tensors ([T, H, D] + cu_seqlens); padded peers get [B, maxL, H, D] copies (viewed as
[B, H, maxL, D] for SDPA, BTNH for JAX) with the sequence lengths or a boolean key-padding mask
[B, 1, 1, maxLk]; the pack->pad conversion is done once, outside the timing.

Each peer is checked before it counts: its output at the valid query tokens (and dQ at valid
query tokens, dK/dV at valid key tokens) against an fp32 reference computed on the padded batch
with the mask, chunked over the slots. Error = max |peer - ref| over valid tokens / max |ref|.
A peer over the tolerance is "ignores padding" (when it matches the fp32 attention over the
zero-padded keys instead) or "wrong"; one that raises is "refused" (the exception's first line).
Only correct peers enter the best-peer ratios.

Module level is plain Python (no torch), so bench/peers_jax.py can import the workloads,
lengths, tolerances and verdict logic from here.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import queue
import time
import warnings

M64 = (1 << 64) - 1

# Tolerances, relative to the fp32 reference's max |value| over the valid tokens of the
# workload (per output tensor). bf16 keeps 8 significant bits: one rounding is at most 2^-9
# (0.2 %) of a value, so a correct bf16 kernel (bf16 inputs, fp32 accumulation, P and dS
# rounded to bf16 before their matmuls, outputs rounded once) sits at a few 2^-9 of the max:
# 0.2-1 % in the forward, up to about 2 % in dQ/dK, where dS = P (dP - rowsum(dO o)) cancels.
# A peer that lets the zero-padded keys into the softmax, or attends across slots, is off by
# the share of the softmax mass those keys take, (maxL - L) / maxL of it with zero scores:
# 10-90 % of the max on every padded workload. 2e-2 (fwd) and 5e-2 (bwd) sit between the two
# with a factor of several on each side; every peer's measured error is printed beside it.
TOL_FWD = 2e-2
TOL_BWD = 5e-2


class Rng:
    """splitmix64, as smallseq::harness::rng::Rng."""

    def __init__(self, seed):
        self.s = seed

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def range(self, lo, hi):
        return lo + self.next() % (hi - lo + 1)


# As workloads() in src/cli/bench.rs: name, slots, q length range, kv length range, heads, head dim.
WORKLOADS = [
    ("fix16_h16_d128_B4096", 4096, (16, 16), (16, 16), 16, 128),
    ("rnd1-17_h16_d128_B8192", 8192, (1, 17), (1, 17), 16, 128),
    ("rnd1-17_h32_d256_B4096", 4096, (1, 17), (1, 17), 32, 256),
    ("q1_kv2-16_h16_d128_B32768", 32768, (1, 1), (2, 16), 16, 128),
    ("fix512_h16_d128_B64", 64, (512, 512), (512, 512), 16, 128),
]


class Workload:
    def __init__(self, name, slots, ql, kl, heads, head_dim, small=False):
        self.name, self.slots, self.ql, self.kl = name, slots, ql, kl
        self.heads, self.head_dim, self.small = heads, head_dim, small

    def lengths(self):
        """(q, kv) length per slot, the sequence of src/cli/bench.rs lengths()."""
        r = Rng(1)
        return [(r.range(*self.ql), r.range(*self.kl)) for _ in range(self.slots)]

    def describe(self):
        return (f"{self.slots} slots, q {self.ql[0]}..{self.ql[1]}, kv {self.kl[0]}..{self.kl[1]}, "
                f"h{self.heads} d{self.head_dim}" + (" (--small)" if self.small else ""))


def workload_list(small=False, only=None):
    out = []
    for name, b, ql, kl, h, d in WORKLOADS:
        if only and not any(part in name for part in only):
            continue
        if small:  # same length draws (the first slots of the sequence), tiny shapes
            b = 2 if ql[1] > 64 else 12
            h, d = 2, (64 if d > 128 else 32)
        out.append(Workload(name, b, ql, kl, h, d, small))
    return out


def one_line(e):
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:240]}" if first else type(e).__name__


def new_record(wname, peer, call, layout, timed_bwd):
    return dict(kind="peer", workload=wname, peer=peer, call=call, layout=layout,
                fwd_us=None, bwd_us=None, fwd_err=None, fwd_err_unmasked=None, bwd_err=None,
                fwd_status=None, bwd_status=None, verdict=None, reason=None,
                timed_bwd=timed_bwd)


def fwd_status_from(err, err_unmasked):
    """Verdict of a forward check (err relative to max |ref|; err_unmasked the same against the
    attention over the zero-padded keys, or None)."""
    if err is not None and err <= TOL_FWD:
        return "ok"
    if err_unmasked is not None and err_unmasked <= TOL_FWD:
        return "ignores padding"
    return "wrong"


def bwd_status_from(errs):
    return "ok" if max(errs.values()) <= TOL_BWD else "wrong"


def finish(rec):
    """Fills rec['verdict'] from the per-pass statuses."""
    f, b = rec["fwd_status"], rec["bwd_status"]
    if f != "ok":
        v = f
        if f in ("wrong", "ignores padding") and rec["fwd_err"] is not None:
            v += f" (fwd err {fmt_err(rec['fwd_err'])})"
    elif b in ("ok", "none"):
        v = "ok" if b == "ok" else "ok (no backward)"
    else:
        v = f"fwd ok, bwd {b}"
        if b == "wrong":
            worst = max(rec["bwd_err"], key=rec["bwd_err"].get)
            v += f" ({worst} err {fmt_err(rec['bwd_err'][worst])})"
    if rec.get("reason") and (f in ("refused", "oom", "skip") or (f == "ok" and b in ("refused", "oom"))):
        v += f": {rec['reason']}"
    rec["verdict"] = v
    return rec


def fmt_err(e):
    if e is None:
        return "-"
    return "inf/nan" if not math.isfinite(e) else f"{e:.1e}"


def fmt_us(u):
    return "-" if u is None else f"{u:.1f}"


def print_table(w, recs, file=sys.stdout):
    print(f"\n== {w.name}: {w.describe()}", file=file)
    print(f"{'peer':30} {'fwd us':>10} {'bwd us':>10} {'fwd err':>8} {'bwd err':>8}  verdict", file=file)
    for r in recs:
        be = max(r["bwd_err"].values()) if r.get("bwd_err") else None
        # a JAX time that fell back to the wall clock (bench/peers_jax.py) is marked, with why
        walls = [f"{p} {r[p + '_timer']}" for p in ("fwd", "bwd")
                 if str(r.get(p + "_timer", "device")).startswith("wall")]
        print(f"{r['peer']:30} {fmt_us(r['fwd_us']):>10} {fmt_us(r['bwd_us']):>10} "
              f"{fmt_err(r['fwd_err']):>8} {fmt_err(be):>8}  {r['verdict']}"
              + ("" if not walls else "  (" + "; ".join(walls) + ")"), file=file)


def best(recs, which):
    if which == "fwd":
        ok = [r for r in recs if r["fwd_status"] == "ok" and r["fwd_us"] is not None]
        key = "fwd_us"
    else:
        ok = [r for r in recs if r["fwd_status"] == "ok" and r["bwd_status"] == "ok" and r["bwd_us"] is not None]
        key = "bwd_us"
    return min(ok, key=lambda r: r[key]) if ok else None


def ratios(w, recs, ours, file=sys.stdout):
    """Ratio records for the kernels of BENCH_JSON on this workload (printed too)."""
    out = []
    flash = next((r for r in recs if r["peer"] == "flash_varlen"), None)
    plans = [
        ("small_seq_fwd", "fwd", best(recs, "fwd"), "peer/ours"),
        ("small_seq_bwd", "bwd", best(recs, "bwd"), "peer/ours"),
        ("fallback_fwd", "fwd", flash if flash and flash["fwd_status"] == "ok" else None, "ours/flash"),
        ("fallback_bwd", "bwd", flash if flash and flash["fwd_status"] == "ok" and flash["bwd_status"] == "ok" else None, "ours/flash"),
    ]
    for kern, which, peer, kind in plans:
        if (w.name, kern) not in ours:
            continue
        us = ours[(w.name, kern)]
        rec = dict(kind="ratio", workload=w.name, kernel=kern, ours_us=us, against=None,
                   peer_us=None, ratio=None, ratio_is=kind)
        if peer is None:
            what = "best correct peer" if kind == "peer/ours" else "flash_varlen"
            print(f"  {kern:14} {us:10.1f} us | no correct {what} {which}: no ratio", file=file)
        else:
            pus = peer[which + "_us"]
            rec.update(against=peer["peer"], peer_us=pus,
                       ratio=(pus / us) if kind == "peer/ours" else (us / pus))
            label = "best correct peer" if kind == "peer/ours" else "flash varlen"
            goal = "" if kind == "peer/ours" else " (goal: within 3x)"
            print(f"  {kern:14} {us:10.1f} us | {label} {which}: {peer['peer']} {pus:.1f} us | "
                  f"{kind} {rec['ratio']:.2f}x{goal}", file=file)
        out.append(rec)
    return out


def load_ours(path):
    ours = {}
    if path and os.path.exists(path):
        for f in json.load(open(path)):
            if "workload" in f and "kernel" in f and "us" in f:
                ours[(f["workload"], f["kernel"])] = f["us"]
    return ours


# --------------------------------------------------------------------------------------------
# Everything below needs torch (imported in main()).

torch = None
F = None


def import_torch():
    global torch, F
    import torch as _t
    import torch.nn.functional as _f
    torch, F = _t, _f


class Ctx:
    """One workload's tensors: packed THD, padded copies, mask, index maps."""

    def __init__(self, w, dev):
        self.w, self.dev = w, dev
        lens = w.lengths()
        B, H, D = w.slots, w.heads, w.head_dim
        self.B, self.H, self.D = B, H, D
        lq = torch.tensor([a for a, _ in lens], dtype=torch.int64)
        lk = torch.tensor([b for _, b in lens], dtype=torch.int64)
        self.lq, self.lk = lq, lk
        cq = torch.zeros(B + 1, dtype=torch.int64)
        cq[1:] = torch.cumsum(lq, 0)
        ck = torch.zeros(B + 1, dtype=torch.int64)
        ck[1:] = torch.cumsum(lk, 0)
        self.cq_host, self.ck_host = cq, ck
        self.cq, self.ck = cq.to(torch.int32).to(dev), ck.to(torch.int32).to(dev)
        self.tq, self.tk = int(lq.sum()), int(lk.sum())
        self.mq, self.mk = int(lq.max()), int(lk.max())
        self.scale = 1.0 / math.sqrt(D)
        g = torch.Generator(device=dev)
        g.manual_seed(7)
        bf = torch.bfloat16
        self.q = torch.randn(self.tq, H, D, device=dev, dtype=bf, generator=g)
        self.k = torch.randn(self.tk, H, D, device=dev, dtype=bf, generator=g)
        self.v = torch.randn(self.tk, H, D, device=dev, dtype=bf, generator=g)
        self.do = torch.randn(self.tq, H, D, device=dev, dtype=bf, generator=g)
        # token -> (slot, position in slot)
        self.bq = torch.repeat_interleave(torch.arange(B), lq).to(dev)
        self.pq = (torch.arange(self.tq) - torch.repeat_interleave(cq[:-1], lq)).to(dev)
        self.bk = torch.repeat_interleave(torch.arange(B), lk).to(dev)
        self.pk = (torch.arange(self.tk) - torch.repeat_interleave(ck[:-1], lk)).to(dev)
        # padded [B, L, H, D]; zero outside the slots (dO too, so padded query rows add nothing
        # to dK/dV)
        self.qp = self.pad_q(self.q)
        self.kp = self.pad_k(self.k)
        self.vp = self.pad_k(self.v)
        self.dop = self.pad_q(self.do)
        self.kmask = torch.arange(self.mk, device=dev)[None, :] < lk.to(dev)[:, None]  # [B, Lk]
        self.attn_mask = self.kmask[:, None, None, :]  # [B, 1, 1, Lk]: key padding, all queries
        self.empty_kv = int((lk == 0).sum())

    def pad_q(self, x):
        p = torch.zeros(self.B, self.mq, self.H, self.D, device=self.dev, dtype=x.dtype)
        p[self.bq, self.pq] = x
        return p

    def pad_k(self, x):
        p = torch.zeros(self.B, self.mk, self.H, self.D, device=self.dev, dtype=x.dtype)
        p[self.bk, self.pk] = x
        return p

    # padded [B, H, L, D] views (of [B, L, H, D] storage) back to packed [T, H, D]
    def unpad_q(self, x_bhld):
        return x_bhld.transpose(1, 2)[self.bq, self.pq]

    def unpad_k(self, x_bhld):
        return x_bhld.transpose(1, 2)[self.bk, self.pk]


def chunk_slots(c, grads):
    """Slots per reference chunk: about 2^27 fp32 elements live at once."""
    per = c.H * ((4 if grads else 2) * c.mq * c.mk + 4 * (c.mq + c.mk) * c.D)
    return max(1, (1 << 27) // per)


class Reference:
    """fp32 attention on the padded batch with the key-padding mask, chunked over the slots,
    gathered to packed [T, H, D] at the valid tokens. Fully masked rows (a slot with no key)
    give 0 output and zero gradients."""

    def __init__(self, c):
        self.c = c
        self.o, self.dq, self.dk, self.dv = self._run(masked=True, grads=True)
        self.max = {n: float(getattr(self, n).abs().max()) if getattr(self, n).numel() else 0.0
                    for n in ("o", "dq", "dk", "dv")}
        self._unmasked = None

    def unmasked_o(self):
        if self._unmasked is None:
            self._unmasked = self._run(masked=False, grads=False)[0]
        return self._unmasked

    def _run(self, masked, grads):
        c = self.c
        f32 = torch.float32
        o = torch.empty(c.tq, c.H, c.D, device=c.dev, dtype=f32)
        dq = torch.empty_like(o) if grads else None
        dk = torch.empty(c.tk, c.H, c.D, device=c.dev, dtype=f32) if grads else None
        dv = torch.empty_like(dk) if grads else None
        step = chunk_slots(c, grads)
        for b0 in range(0, c.B, step):
            b1 = min(c.B, b0 + step)
            t0, t1 = int(c.cq_host[b0]), int(c.cq_host[b1])
            s0, s1 = int(c.ck_host[b0]), int(c.ck_host[b1])
            with torch.enable_grad():
                qs = c.qp[b0:b1].to(f32).transpose(1, 2).requires_grad_(grads)
                ks = c.kp[b0:b1].to(f32).transpose(1, 2).requires_grad_(grads)
                vs = c.vp[b0:b1].to(f32).transpose(1, 2).requires_grad_(grads)
                s = torch.matmul(qs, ks.transpose(-1, -2)) * c.scale
                if masked:
                    m = c.attn_mask[b0:b1]
                    p = torch.softmax(s.masked_fill(~m, -1e30), -1) * m
                else:
                    p = torch.softmax(s, -1)
                os_ = torch.matmul(p, vs)  # [b, H, Lq, D]
                if grads:
                    g = torch.autograd.grad(os_, (qs, ks, vs), c.dop[b0:b1].to(f32).transpose(1, 2))
            lbq, lpq = c.bq[t0:t1] - b0, c.pq[t0:t1]
            lbk, lpk = c.bk[s0:s1] - b0, c.pk[s0:s1]
            o[t0:t1] = os_.detach().transpose(1, 2)[lbq, lpq]
            if grads:
                dq[t0:t1] = g[0].transpose(1, 2)[lbq, lpq]
                dk[s0:s1] = g[1].transpose(1, 2)[lbk, lpk]
                dv[s0:s1] = g[2].transpose(1, 2)[lbk, lpk]
            del s, p, os_
        return o, dq, dk, dv


def rel_err(x, ref, refmax):
    """max |x - ref| / refmax over packed tokens, chunked; inf for any NaN/inf."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(x.shape)} != expected {tuple(ref.shape)}")
    m = 0.0
    step = max(1, (1 << 24) // max(1, ref[0].numel() if ref.shape[0] else 1))
    for i in range(0, ref.shape[0], step):
        d = (x[i:i + step].to(torch.float32) - ref[i:i + step]).abs().max()
        e = float(d)
        if not math.isfinite(e):
            return math.inf
        m = max(m, e)
    return m / refmax if refmax > 0 else (0.0 if m == 0 else math.inf)


class Timer:
    def __init__(self, dev, warmup_ms, rep_ms):
        self.dev, self.warmup_ms, self.rep_ms = dev, warmup_ms, rep_ms
        self.tt = None
        if dev == "cuda":
            try:
                import triton.testing as tt
                self.tt = tt
                self.what = (f"triton.testing.do_bench median (warmup {warmup_ms} ms, {rep_ms} ms of "
                             f"repetitions, L2 flushed before each; CUDA events)")
            except ImportError as e:
                self.what = (f"CUDA events per call, median (warmup {warmup_ms} ms, {rep_ms} ms of "
                             f"repetitions, L2 flushed before each); triton missing: {one_line(e)}")
                self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        else:
            self.what = f"wall clock per call, median (warmup {warmup_ms} ms, {rep_ms} ms of repetitions; CPU)"

    def __call__(self, fn):
        if self.tt is not None:
            try:
                return self.tt.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3
            except TypeError:  # older triton: no return_mode
                return self.tt.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=[0.5]) * 1e3
        if self.dev == "cuda":
            return self._events(fn)
        return self._wall(fn)

    def _wall(self, fn):
        fn()
        t0 = time.perf_counter()
        fn()
        est = max(time.perf_counter() - t0, 1e-6)
        for _ in range(max(1, int(self.warmup_ms * 1e-3 / est))):
            fn()
        ts = []
        for _ in range(max(3, int(self.rep_ms * 1e-3 / est))):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    def _events(self, fn):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            fn()
        b.record()
        torch.cuda.synchronize()
        est = max(a.elapsed_time(b) / 3, 1e-3)  # ms
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        n = max(3, int(self.rep_ms / est))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


def call_op(op, **vals):
    """Calls an aten op by its schema's argument names (robust to positional changes between
    torch versions); an argument of the schema without a default and without a value raises."""
    schema = op.default._schema
    kw = {}
    for a in schema.arguments:
        if a.name in vals:
            kw[a.name] = vals[a.name]
        elif not a.has_default_value():
            if a.type.kind() == "OptionalType":
                kw[a.name] = None
            else:
                raise TypeError(f"{schema.name}: argument '{a.name}' not supplied (schema: {schema})")
    return op(**kw)


# --------------------------------------------------------------------------------------------
# Peers. Each build(c) returns (fwd, fwd_out, make_bwd): fwd() is timed; fwd_out() returns the
# output packed [Tq, H, D]; make_bwd() (or None) runs one forward and returns (bwd, grads): bwd()
# is timed (the backward alone), grads() returns packed (dQ, dK, dV).

class Peer:
    def __init__(self, name, call, layout, build, needs_cuda=True, ctx=None, available=None,
                 timed_bwd=None, control=False):
        self.name, self.call, self.layout, self.build = name, call, layout, build
        self.needs_cuda, self.ctx, self.available = needs_cuda, ctx, available
        self.timed_bwd, self.control = timed_bwd, control


def aten_has(name):
    return None if hasattr(torch.ops.aten, name) else f"torch {torch.__version__} has no aten.{name}"


def build_flash(c):
    aten = torch.ops.aten

    def fwd():
        return call_op(aten._flash_attention_forward, query=c.q, key=c.k, value=c.v, cum_seq_q=c.cq,
                       cum_seq_k=c.ck, max_q=c.mq, max_k=c.mk, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False)

    def make_bwd():
        o, lse, rng, unused, _ = fwd()

        def bwd():
            return call_op(aten._flash_attention_backward, grad_out=c.do, query=c.q, key=c.k, value=c.v,
                           out=o, logsumexp=lse, cum_seq_q=c.cq, cum_seq_k=c.ck, max_q=c.mq, max_k=c.mk,
                           dropout_p=0.0, is_causal=False, rng_state=rng, unused=unused,
                           philox_seed=rng, philox_offset=unused)
        return bwd, lambda: bwd()[:3]
    return fwd, lambda: fwd()[0], make_bwd


def build_efficient(c):
    aten = torch.ops.aten
    q4, k4, v4, do4 = c.q[None], c.k[None], c.v[None], c.do[None]

    def fwd():
        return call_op(aten._efficient_attention_forward, query=q4, key=k4, value=v4, bias=None,
                       cu_seqlens_q=c.cq, cu_seqlens_k=c.ck, max_seqlen_q=c.mq, max_seqlen_k=c.mk,
                       dropout_p=0.0, custom_mask_type=0, compute_log_sumexp=True)

    def make_bwd():
        r = fwd()
        o, lse, seed, off = r[0], r[1], r[2], r[3]

        def bwd():
            return call_op(aten._efficient_attention_backward, grad_out_=do4, grad_out=do4, query=q4,
                           key=k4, value=v4, bias=None, out=o, cu_seqlens_q=c.cq, cu_seqlens_k=c.ck,
                           max_seqlen_q=c.mq, max_seqlen_k=c.mk, logsumexp=lse, dropout_p=0.0,
                           philox_seed=seed, philox_offset=off, custom_mask_type=0,
                           bias_requires_grad=False)
        return bwd, lambda: [x[0] for x in bwd()[:3]]
    return fwd, lambda: fwd()[0][0], make_bwd


def build_cudnn_varlen(c):
    aten = torch.ops.aten

    def fwd():
        return call_op(aten._cudnn_attention_forward, query=c.q, key=c.k, value=c.v, attn_bias=None,
                       cum_seq_q=c.cq, cum_seq_k=c.ck, max_q=c.mq, max_k=c.mk, compute_log_sumexp=True,
                       dropout_p=0.0, is_causal=False, return_debug_mask=False)

    def make_bwd():
        r = fwd()
        o, lse, seed, off = r[0], r[1], r[6], r[7]

        def bwd():
            return call_op(aten._cudnn_attention_backward, grad_out=c.do, query=c.q, key=c.k, value=c.v,
                           out=o, logsumexp=lse, philox_seed=seed, philox_offset=off, attn_bias=None,
                           cum_seq_q=c.cq, cum_seq_k=c.ck, max_q=c.mq, max_k=c.mk, dropout_p=0.0,
                           is_causal=False)
        return bwd, lambda: bwd()[:3]
    return fwd, lambda: fwd()[0], make_bwd


def autograd_bwd(run, leaves, grad_out, to_packed):
    """One forward with grad-requiring leaves; the timed backward is torch.autograd.grad of its
    output with a fixed dO, retain_graph=True (the graph is kept for the next repetition)."""
    with torch.enable_grad():
        o = run(*leaves)

    def bwd():
        return torch.autograd.grad(o, leaves, grad_out, retain_graph=True)
    return bwd, lambda: to_packed(bwd())


def build_varlen_attn(c):
    from torch.nn.attention.varlen import varlen_attn

    def run(q, k, v):
        return varlen_attn(q, k, v, c.cq, c.ck, c.mq, c.mk)

    def make_bwd():
        leaves = tuple(x.detach().requires_grad_() for x in (c.q, c.k, c.v))
        return autograd_bwd(run, leaves, c.do, lambda g: g)
    return (lambda: run(c.q, c.k, c.v)), (lambda: run(c.q, c.k, c.v)), make_bwd


def varlen_available():
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__}: no torch.nn.attention.varlen.varlen_attn ({one_line(e)})"
    return None


def varlen_pinnable():
    r = varlen_available()
    if r:
        return r
    import torch.nn.attention.varlen as vm
    if not any(hasattr(vm, n) for n in ("_select_backend", "_should_use_cudnn")):
        return (f"torch {torch.__version__}: varlen_attn has no cuDNN path (runs flash only; "
                f"timed as varlen_attn)")
    return None


def make_sdpa_build(masked, scale_factor=1.0):
    def build(c):
        def run(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=c.attn_mask if masked else None,
                                                  scale=c.scale * scale_factor)
        qt, kt, vt = (x.transpose(1, 2) for x in (c.qp, c.kp, c.vp))  # [B, H, L, D] views

        def make_bwd():
            leaves = tuple(x.transpose(1, 2).detach().requires_grad_() for x in (c.qp, c.kp, c.vp))
            do_t = c.dop.transpose(1, 2)
            return autograd_bwd(run, leaves, do_t,
                                lambda g: (c.unpad_q(g[0]), c.unpad_k(g[1]), c.unpad_k(g[2])))
        return (lambda: run(qt, kt, vt)), (lambda: c.unpad_q(run(qt, kt, vt))), make_bwd
    return build


def sdpa_ctx(backend_name):
    def ctx():
        from torch.nn.attention import sdpa_kernel, SDPBackend
        return sdpa_kernel([getattr(SDPBackend, backend_name)])
    return ctx


def sdpa_available(backend_name):
    def avail():
        try:
            from torch.nn.attention import sdpa_kernel, SDPBackend  # noqa: F401
        except ImportError as e:
            return f"torch {torch.__version__}: no torch.nn.attention.sdpa_kernel ({one_line(e)})"
        if not hasattr(SDPBackend, backend_name):
            return f"torch {torch.__version__}: no SDPBackend.{backend_name}"
        return None
    return avail


def torch_peers(dev):
    P = []
    sdpa_call = ("F.scaled_dot_product_attention(q, k, v, attn_mask=kmask[B,1,1,Lk] bool) on padded "
                 "[B,H,maxL,D] under sdpa_kernel([SDPBackend.{}])")
    ag = "torch.autograd.grad(o, (q, k, v), dO, retain_graph=True)"
    P.append(Peer("flash_varlen",
                  "aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False) on packed [T,H,D]",
                  "packed", build_flash, available=lambda: aten_has("_flash_attention_forward"),
                  timed_bwd="aten._flash_attention_backward(dO, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, False, rng_state, unused)"))
    P.append(Peer("mem_efficient_varlen",
                  "aten._efficient_attention_forward(q[None], k[None], v[None], None, cu_q, cu_k, max_q, max_k, 0.0, 0, True)",
                  "packed", build_efficient, available=lambda: aten_has("_efficient_attention_forward"),
                  timed_bwd="aten._efficient_attention_backward(dO[None], q[None], k[None], v[None], None, o, cu_q, cu_k, max_q, max_k, lse, 0.0, seed, offset, 0, False)"))
    P.append(Peer("cudnn_varlen",
                  "aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, False, False) on packed [T,H,D]",
                  "packed", build_cudnn_varlen, available=lambda: aten_has("_cudnn_attention_forward"),
                  timed_bwd="aten._cudnn_attention_backward(dO, q, k, v, o, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, False)"))
    P.append(Peer("varlen_attn",
                  "torch.nn.attention.varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k) (its default backend choice)",
                  "packed", build_varlen_attn, available=varlen_available, timed_bwd=ag))
    for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        short = be.split("_")[0].lower()
        P.append(Peer(f"varlen_attn[{short}]",
                      f"varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k) under sdpa_kernel([SDPBackend.{be}])",
                      "packed", build_varlen_attn, ctx=sdpa_ctx(be),
                      available=lambda be=be: varlen_pinnable() or sdpa_available(be)(), timed_bwd=ag))
    for be in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "FLASH_ATTENTION"):
        short = be.split("_")[0].lower()
        P.append(Peer(f"sdpa_mask[{short}]", sdpa_call.format(be), "padded", make_sdpa_build(True),
                      needs_cuda=(be != "MATH" and be != "FLASH_ATTENTION"), ctx=sdpa_ctx(be),
                      available=sdpa_available(be), timed_bwd=ag))
    # Controls without the mask: correct only on a workload with no padding (W1); elsewhere
    # they must come out as "ignores padding".
    for be in (("FLASH_ATTENTION", "CUDNN_ATTENTION") if dev == "cuda" else ("MATH",)):
        short = be.split("_")[0].lower()
        P.append(Peer(f"sdpa_nomask[{short}]",
                      f"F.scaled_dot_product_attention(q, k, v) on padded [B,H,maxL,D], no mask, under "
                      f"sdpa_kernel([SDPBackend.{be}]) (control: right only where no slot is padded)",
                      "padded", make_sdpa_build(False), needs_cuda=(be == "CUDNN_ATTENTION"),
                      ctx=sdpa_ctx(be), available=sdpa_available(be), timed_bwd=ag, control=True))
    return P


class Capture:
    """Records warnings (the reasons SDPA gives before 'No available kernel')."""

    def __enter__(self):
        self.cm = warnings.catch_warnings(record=True)
        self.w = self.cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *a):
        return self.cm.__exit__(*a)

    def reasons(self):
        out = []
        for m in self.w:
            line = str(m.message).strip().splitlines()[0] if str(m.message).strip() else ""
            if line and line not in out:
                out.append(line[:160])
        return out[:2]


def is_oom(e):
    return isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


def refusal(rec, which, e, cap):
    status = "oom" if is_oom(e) else "refused"
    rec[which + "_status"] = status
    why = one_line(e)
    extra = [r for r in cap.reasons() if r not in why]
    if extra and status == "refused":
        why += " [" + "; ".join(extra) + "]"
    rec["reason"] = why
    if status == "oom" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_torch_peer(c, ref, peer, timer, dev, log):
    rec = new_record(c.w.name, peer.name, peer.call, peer.layout, peer.timed_bwd)
    rec["control"] = peer.control
    if peer.needs_cuda and dev != "cuda":
        rec.update(fwd_status="skip", bwd_status="skip", reason="CUDA-only peer (--device cpu)")
    else:
        why = peer.available() if peer.available else None
        if why:
            rec.update(fwd_status="skip", bwd_status="skip", reason=why)
    if rec["fwd_status"] == "skip":
        log(f"SKIP {peer.name}: {rec['reason']}")
        return finish(rec)
    cm = peer.ctx() if peer.ctx else None
    with Capture() as cap:
        if cm is not None:
            cm.__enter__()
        try:
            _run_peer_body(c, ref, peer, timer, rec, cap)
        finally:
            if cm is not None:
                cm.__exit__(None, None, None)
    finish(rec)
    log(f"{c.w.name:28} {peer.name:28} fwd {fmt_us(rec['fwd_us']):>9} us  bwd {fmt_us(rec['bwd_us']):>9} us  {rec['verdict']}")
    return rec


def _run_peer_body(c, ref, peer, timer, rec, cap):
    mk_bwd = None
    try:
        with torch.no_grad():
            fwd, fwd_out, mk_bwd = peer.build(c)
            o = fwd_out()
            rec["fwd_err"] = rel_err(o, ref.o, ref.max["o"])
            del o
            if rec["fwd_err"] > TOL_FWD:
                rec["fwd_err_unmasked"] = rel_err(fwd_out(), ref.unmasked_o(), ref.max["o"])
            rec["fwd_status"] = fwd_status_from(rec["fwd_err"], rec["fwd_err_unmasked"])
            rec["fwd_us"] = timer(fwd)
    except Exception as e:  # noqa: BLE001 - a peer may raise anything; it is reported
        refusal(rec, "fwd", e, cap)
        rec["bwd_status"] = "not run"
        return
    if mk_bwd is None:
        rec["bwd_status"] = "none"
        return
    if rec["fwd_status"] != "ok":
        rec["bwd_status"] = "not run (forward not correct)"
        return
    try:
        bwd, grads = mk_bwd()
        dq, dk, dv = grads()
        rec["bwd_err"] = {"dq": rel_err(dq, ref.dq, ref.max["dq"]),
                          "dk": rel_err(dk, ref.dk, ref.max["dk"]),
                          "dv": rel_err(dv, ref.dv, ref.max["dv"])}
        del dq, dk, dv
        rec["bwd_status"] = bwd_status_from(rec["bwd_err"])
        rec["bwd_us"] = timer(bwd)
        del bwd, grads
    except Exception as e:  # noqa: BLE001
        refusal(rec, "bwd", e, cap)


# --------------------------------------------------------------------------------------------
# JAX in its own process (bench/peers_jax.py): JSON lines over its stdin/stdout.

class JaxChild:
    def __init__(self, args, log):
        self.log, self.proc, self.dead = log, None, None
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        cmd = [sys.executable, os.path.join(here, "peers_jax.py"), "--device", args.device,
               "--warmup-ms", str(args.warmup_ms), "--rep-ms", str(args.rep_ms)]
        if args.small:
            cmd.append("--small")
        self.timeout = args.jax_timeout
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         env=env, bufsize=1)
        except OSError as e:
            self.dead = f"could not start bench/peers_jax.py: {one_line(e)}"
            return
        self.q = queue.Queue()
        threading.Thread(target=self._reader, daemon=True).start()
        line = self._wait(("READY", "UNAVAILABLE"), self.timeout)
        if line is None:
            return
        if line.startswith("UNAVAILABLE"):
            self.dead = line[len("UNAVAILABLE"):].strip()
            self.proc.wait(timeout=30)
        else:
            self.info = json.loads(line[len("READY"):])
            log(f"jax child ready: {self.info}")

    def _reader(self):
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def _wait(self, prefixes, timeout):
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self._kill(f"bench/peers_jax.py gave no answer within {timeout:.0f} s (killed)")
                return None
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait()
                self.dead = self.dead or f"bench/peers_jax.py exited (rc {rc}) before answering"
                return None
            if line.startswith(prefixes):
                return line
            self.log("jax| " + line)

    def _kill(self, why):
        self.dead = why
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def run(self, w):
        if self.dead:
            return None
        self.proc.stdin.write(json.dumps({"workload": w.name}) + "\n")
        self.proc.stdin.flush()
        line = self._wait(("RESULT",), self.timeout)
        if line is None:
            return None
        return json.loads(line[len("RESULT"):])

    def close(self):
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self._kill("closing")


JAX_PEERS = ("jax_dpa[xla]", "jax_dpa[cudnn]")


def skipped(skips, wname, pname):
    """The --skip entry (PEER or WORKLOAD/PEER, substrings) that leaves out peer `pname` on
    workload `wname`, or None."""
    for s in skips:
        wpart, _, ppart = s.rpartition("/")
        if ppart in pname and (not wpart or wpart in wname):
            return s
    return None


def jax_skip_records(w, why):
    out = []
    for name in JAX_PEERS:
        r = new_record(w.name, name, "jax.nn.dot_product_attention(..., query_seq_lengths, "
                       "key_value_seq_lengths, implementation=...)", "padded", None)
        r.update(fwd_status="skip", bwd_status="skip", reason=why)
        out.append(finish(r))
    return out


# --------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", nargs="?", default=os.environ.get("SMALLSEQ_BENCH_OUT"),
                    help="bench.json of `smallseq bench --out` (optional)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda, cpu with --small")
    ap.add_argument("--small", action="store_true",
                    help="tiny workloads (same length draws) and the self-test; for --device cpu")
    ap.add_argument("--workloads", help="only workloads whose name contains one of these (comma-separated)")
    ap.add_argument("--peers", help="only peers whose name contains one of these (comma-separated)")
    ap.add_argument("--skip", help="PyTorch peers not to time, comma-separated: PEER, or WORKLOAD/PEER for "
                    "one workload (substrings, e.g. q1/cudnn_varlen); each is printed and recorded as "
                    "skipped (--no-jax leaves out the JAX peers)")
    ap.add_argument("--no-jax", action="store_true", help="leave out the JAX peers")
    ap.add_argument("--jax-timeout", type=float, default=180.0,
                    help="seconds the JAX process may take to start or to do one workload")
    ap.add_argument("--warmup-ms", type=int, default=50)
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.small else "cuda"
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "peers.json")

    def log(msg):
        print(msg, flush=True)

    try:
        import_torch()
    except ImportError as e:
        print(f"peers.py needs torch: {one_line(e)}")
        return 2
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("peers.py: --device cuda but torch.cuda.is_available() is False (use --device cpu --small here)")
        return 2
    if dev == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    timer = Timer(dev, args.warmup_ms if not args.small else min(args.warmup_ms, 5),
                  args.rep_ms if not args.small else min(args.rep_ms, 20))
    ours = load_ours(args.bench_json)
    wl = workload_list(args.small, args.workloads.split(",") if args.workloads else None)
    peer_filter = args.peers.split(",") if args.peers else None
    skips = [x for x in (args.skip or "").split(",") if x]
    peers = [p for p in torch_peers(dev) if not peer_filter or any(s in p.name for s in peer_filter)]
    want_jax = not args.no_jax and (not peer_filter or any(s in n for s in peer_filter for n in JAX_PEERS))

    meta = dict(kind="meta", torch=torch.__version__, device=(torch.cuda.get_device_name() if dev == "cuda" else "cpu"),
                cudnn=(torch.backends.cudnn.version() if dev == "cuda" else None), python=sys.version.split()[0],
                small=args.small, bench_json=args.bench_json, have_bench_json=bool(ours),
                timing=timer.what, tol_fwd=TOL_FWD, tol_bwd=TOL_BWD,
                notes=["padded peers are timed on the padded tensors only: the pack->pad conversion "
                       "(and the unpad of their outputs) is not timed",
                       "bwd = the backward call alone: the aten backward op for the aten peers; "
                       "torch.autograd.grad(o, (q, k, v), dO, retain_graph=True) of one forward for "
                       "autograd peers; jit(vjp_fn)(dO) for JAX (residuals from one jax.vjp forward)",
                       "bwd is run and timed only for peers whose forward is correct",
                       "error = max |peer - fp32 reference| over valid tokens / max |reference|, per "
                       "tensor; reference on the padded batch with the key-padding mask",
                       "best-peer ratios use peers whose verdict is ok for that pass only"])
    log(f"torch {meta['torch']} on {meta['device']} (cuDNN {meta['cudnn']}); timing: {timer.what}")
    for n in meta["notes"]:
        log("note: " + n)
    log(f"tolerance: fwd {TOL_FWD:g}, bwd {TOL_BWD:g} of the reference's max |value|")
    for p in peers:
        log(f"peer {p.name}: {p.call}" + (f"; bwd timed: {p.timed_bwd}" if p.timed_bwd else ""))
    if not ours:
        log(f"no bench.json ({args.bench_json!r}): peers only, no ratios")

    jax = None
    if want_jax:
        jax = JaxChild(args, log)
        if jax.dead:
            log(f"SKIP jax_dpa[xla], jax_dpa[cudnn]: {jax.dead}")
        else:
            meta["jax"] = jax.info
    if jax is None or jax.dead:
        meta["jax"] = None if jax is None else f"skipped: {jax.dead}"

    records = [meta]
    tables = []

    def dump():
        with open(out_path, "w") as fh:
            json.dump(records, fh, indent=1)

    for w in wl:
        try:
            c = Ctx(w, dev)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next workload may fit
            log(f"SKIP workload {w.name}: building its tensors failed: {one_line(e)}")
            if dev == "cuda":
                torch.cuda.empty_cache()
            continue
        log(f"\n-- {w.name}: {w.describe()}; tokens q {c.tq} kv {c.tk}, max q {c.mq} kv {c.mk}; "
            f"padded q [{c.B},{c.mq},{c.H},{c.D}] kv [{c.B},{c.mk},{c.H},{c.D}]")
        if c.empty_kv:
            log(f"note: {c.empty_kv} slots have no key: their rows are fully masked (reference: 0)")
        t0 = time.perf_counter()
        try:
            ref = Reference(c)
        except Exception as e:  # noqa: BLE001
            log(f"SKIP workload {w.name}: the fp32 reference failed: {one_line(e)}")
            del c
            if dev == "cuda":
                torch.cuda.empty_cache()
            continue
        log(f"fp32 reference: {time.perf_counter() - t0:.1f} s; max |o| {ref.max['o']:.3g}, |dq| "
            f"{ref.max['dq']:.3g}, |dk| {ref.max['dk']:.3g}, |dv| {ref.max['dv']:.3g}")
        recs = []
        for p in peers:
            why = skipped(skips, w.name, p.name)
            if why is None:
                recs.append(run_torch_peer(c, ref, p, timer, dev, log))
                continue
            r = new_record(w.name, p.name, p.call, p.layout, p.timed_bwd)
            r.update(control=p.control, fwd_status="skip", bwd_status="skip", reason=f"not timed: --skip {why}")
            log(f"SKIP {p.name} on {w.name}: --skip {why}")
            recs.append(finish(r))
        del ref, c
        if dev == "cuda":
            torch.cuda.empty_cache()
        if want_jax:
            jr = jax.run(w) if jax and not jax.dead else None
            if jr is None:
                why = jax.dead if jax else "not started"
                log(f"SKIP jax_dpa[xla], jax_dpa[cudnn] on {w.name}: {why}")
                jr = jax_skip_records(w, why)
            else:
                for r in jr:
                    if r["fwd_status"] == "skip":
                        log(f"SKIP {r['peer']}: {r['reason']}")
            recs += [r for r in jr if not peer_filter or any(s in r["peer"] for s in peer_filter)]
        records.extend(recs)
        print_table(w, recs)
        rr = ratios(w, recs, ours)
        records.extend(rr)
        tables.append((w, recs, rr))
        dump()
    if jax:
        jax.close()
    dump()
    log(f"\nwrote {out_path}")
    if args.small:
        return selftest(args, records, out_path, log)
    return 0


# --------------------------------------------------------------------------------------------
# Self-test (--small): the check flags deliberately wrong peers, the padded conversion and the
# reference agree with a per-slot float64 computation on the packed tensors, the JSON reloads.

def selftest(args, records, out_path, log):
    fails = []

    def expect(cond, what):
        log(("ok   " if cond else "FAIL ") + what)
        if not cond:
            fails.append(what)

    dev = args.device
    w = next(x for x in workload_list(True) if x.name.startswith("rnd1-17_h16"))
    c = Ctx(w, dev)
    ref = Reference(c)
    # 1. reference and padding against float64 per slot on the packed tensors
    worst = {"o": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for b in range(c.B):
        t0, t1 = int(c.cq_host[b]), int(c.cq_host[b + 1])
        s0, s1 = int(c.ck_host[b]), int(c.ck_host[b + 1])
        q, k, v = (x.double().transpose(0, 1).requires_grad_() for x in (c.q[t0:t1], c.k[s0:s1], c.v[s0:s1]))
        with torch.enable_grad():
            o = torch.softmax(q @ k.transpose(-1, -2) * c.scale, -1) @ v
            g = torch.autograd.grad(o, (q, k, v), c.do[t0:t1].double().transpose(0, 1))
        for n, x, r in (("o", o, ref.o[t0:t1]), ("dq", g[0], ref.dq[t0:t1]), ("dk", g[1], ref.dk[s0:s1]),
                        ("dv", g[2], ref.dv[s0:s1])):
            worst[n] = max(worst[n], float((x.detach().transpose(0, 1) - r.double()).abs().max()) / ref.max[n])
    expect(all(e < 1e-5 for e in worst.values()), f"fp32 padded reference = float64 per slot on packed data ({worst})")
    expect(c.tq > c.B and bool((c.lk < c.mk).any()), "the self-test workload has padded keys")
    timer = Timer(dev, 1, 2)
    noop = lambda m: None  # noqa: E731

    def verdict(peer):
        return run_torch_peer(c, ref, peer, timer, dev, noop)

    math_ctx, math_av = sdpa_ctx("MATH"), sdpa_available("MATH")
    r = verdict(Peer("t_mask", "", "padded", make_sdpa_build(True), needs_cuda=False, ctx=math_ctx, available=math_av))
    expect(r["fwd_status"] == "ok" and r["bwd_status"] == "ok", f"SDPA math with the mask: ok ({r['verdict']}, {r['fwd_err']}, {r['bwd_err']})")
    r = verdict(Peer("t_nomask", "", "padded", make_sdpa_build(False), needs_cuda=False, ctx=math_ctx, available=math_av))
    expect(r["fwd_status"] == "ignores padding" and r["bwd_status"].startswith("not run"),
           f"SDPA math without the mask: 'ignores padding', no backward ({r['verdict']})")
    r = verdict(Peer("t_scale", "", "padded", make_sdpa_build(True, scale_factor=1.5), needs_cuda=False, ctx=math_ctx, available=math_av))
    expect(r["fwd_status"] == "wrong", f"SDPA math with the mask, scale x1.5: 'wrong' ({r['verdict']})")

    def build_bad_bwd(cc):
        fwd, fwd_out, mk = make_sdpa_build(True)(cc)

        def mk2():
            bwd, grads = mk()
            return bwd, lambda: tuple(x * (1.2 if i == 1 else 1.0) for i, x in enumerate(grads()))
        return fwd, fwd_out, mk2
    r = verdict(Peer("t_badbwd", "", "padded", build_bad_bwd, needs_cuda=False, ctx=math_ctx, available=math_av))
    expect(r["fwd_status"] == "ok" and r["bwd_status"] == "wrong" and "dk" in r["verdict"],
           f"dK x1.2: 'fwd ok, bwd wrong (dk ...)' ({r['verdict']})")

    def build_raise(cc):
        raise RuntimeError("No available kernel. Aborting execution.\nsecond line")
    r = verdict(Peer("t_raise", "", "packed", build_raise, needs_cuda=False))
    expect(r["fwd_status"] == "refused" and "No available kernel" in r["verdict"] and "second" not in r["verdict"],
           f"a peer that raises: 'refused' with the first line ({r['verdict']})")

    def build_nan(cc):
        fwd, fwd_out, mk = make_sdpa_build(True)(cc)
        return fwd, (lambda: fwd_out() * float("nan")), mk
    r = verdict(Peer("t_nan", "", "padded", build_nan, needs_cuda=False, ctx=math_ctx, available=math_av))
    expect(r["fwd_status"] == "wrong" and r["fwd_err"] == math.inf, f"NaN output: 'wrong', err inf ({r['verdict']})")
    r = verdict(Peer("t_cuda", "", "packed", build_flash))
    expect(dev == "cuda" or r["fwd_status"] == "skip", f"CUDA-only peer on cpu: SKIP ({r['verdict']})")
    # best-peer selection ignores incorrect peers
    fake = [dict(peer="a", fwd_status="ignores padding", bwd_status="not run", fwd_us=1.0, bwd_us=None),
            dict(peer="b", fwd_status="ok", bwd_status="wrong", fwd_us=5.0, bwd_us=2.0),
            dict(peer="c", fwd_status="ok", bwd_status="ok", fwd_us=7.0, bwd_us=9.0),
            dict(peer="flash_varlen", fwd_status="ok", bwd_status="ok", fwd_us=8.0, bwd_us=10.0)]
    ww = Workload("x", 1, (1, 1), (1, 1), 1, 8)
    import io
    rr = ratios(ww, fake, {("x", "small_seq_fwd"): 2.5, ("x", "small_seq_bwd"): 3.0, ("x", "fallback_fwd"): 16.0,
                           ("x", "fallback_bwd"): 20.0}, file=io.StringIO())
    got = {r["kernel"]: (r["against"], round(r["ratio"], 3)) for r in rr}
    expect(got == {"small_seq_fwd": ("b", 2.0), "small_seq_bwd": ("c", 3.0), "fallback_fwd": ("flash_varlen", 2.0),
                   "fallback_bwd": ("flash_varlen", 2.0)}, f"ratios use the best correct peer per pass ({got})")
    # the run's own records
    back = json.load(open(out_path))
    peer_recs = [r for r in back if r.get("kind") == "peer"]
    expect(len(back) == len(records) and peer_recs, f"{out_path} reloads ({len(back)} records)")
    by = {(r["workload"], r["peer"]): r for r in peer_recs}
    for wname, _, ql, kl, _, _ in WORKLOADS:
        if args.workloads and not any(s in wname for s in args.workloads.split(",")):
            continue
        m, nm = by.get((wname, "sdpa_mask[math]")), by.get((wname, "sdpa_nomask[math]"))
        if m:
            expect(m["verdict"] == "ok", f"{wname}: sdpa_mask[math] ok ({m['verdict']})")
        if nm:
            padded = ql[0] != ql[1] or kl[0] != kl[1]
            want = "ignores padding" if padded else "ok"
            expect(nm["fwd_status"] == want, f"{wname}: sdpa_nomask[math] {want!r} ({nm['verdict']})")
        jx = by.get((wname, "jax_dpa[xla]"))
        if jx and jx["fwd_status"] != "skip":
            expect(jx["verdict"] == "ok", f"{wname}: jax_dpa[xla] ok ({jx['verdict']})")
        jn = by.get((wname, "jax_dpa[xla,no lengths]"))
        if jn:
            padded = ql[0] != ql[1] or kl[0] != kl[1]
            want = "ignores padding" if padded else "ok"
            expect(jn["fwd_status"] == want, f"{wname}: jax without lengths {want!r} ({jn['verdict']})")
    log(f"\nself-test: {len(fails)} failed" if fails else "\nself-test: all passed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
