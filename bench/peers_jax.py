#!/usr/bin/env python3
"""JAX peers of bench/peers.py, in a process of their own (JAX and torch each bring a cuDNN and
a GPU allocator; JAX's preallocation is turned off all the same).

Started by bench/peers.py; speaks JSON lines: prints `READY {info}` (or `UNAVAILABLE reason` and
exits), then for each line `{"workload": NAME}` on stdin runs that workload and prints
`RESULT [records]` (the record format of bench/peers.py). Progress goes to stderr.

Peers: jax.nn.dot_product_attention on the padded batch [B, maxL, N, H] (BTNH) with
query_seq_lengths / key_value_seq_lengths, implementation 'xla' and 'cudnn', forward jitted and
the backward as jit(vjp_fn)(dO) from one jax.vjp. Data: the workload's lengths (peers.py), its
own bf16 normal values, zero outside the slots (dO too). Check: an fp32 reference on the same
padded batch with the key-padding mask (einsum at Precision.HIGHEST, softmax in f32, jax.vjp for
the gradients), chunked over the slots, errors over the valid tokens relative to the
reference's max |value|, peers.py's tolerances and verdicts. Timing: wall clock per call with
jax.block_until_ready, median after a warm-up (it includes JAX's dispatch, tens of us).

Run alone for a look: `printf '{"workload": "fix16_h16_d128_B4096"}\\n' | python3 bench/peers_jax.py`.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.dont_write_bytecode = True  # no bench/__pycache__ from importing peers.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers as P  # noqa: E402  (plain Python at module level: no torch imported)


def err(msg):
    print(msg, file=sys.stderr, flush=True)


def is_oom(e):
    t = str(e)
    return "RESOURCE_EXHAUSTED" in t or "out of memory" in t.lower()


class Runner:
    def __init__(self, jax, jnp, np, args):
        self.jax, self.jnp, self.np, self.args = jax, jnp, np, args

    def block(self, x):
        return self.jax.block_until_ready(x)

    def bench(self, fn):
        """us per call: median of synchronised calls after a warm-up."""
        a = self.args
        self.block(fn())
        t0 = time.perf_counter()
        self.block(fn())
        est = max(time.perf_counter() - t0, 1e-6)
        for _ in range(max(1, int(a.warmup_ms * 1e-3 / est))):
            self.block(fn())
        ts = []
        for _ in range(min(2000, max(5, int(a.rep_ms * 1e-3 / est)))):
            t0 = time.perf_counter()
            self.block(fn())
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    def workload(self, w):
        jax, jnp, np = self.jax, self.jnp, self.np
        lens = w.lengths()
        B, H, D = w.slots, w.heads, w.head_dim
        lq = np.array([a for a, _ in lens], dtype=np.int32)
        lk = np.array([b for _, b in lens], dtype=np.int32)
        mq, mk = int(lq.max()), int(lk.max())
        scale = 1.0 / math.sqrt(D)
        bf, f32 = jnp.bfloat16, jnp.float32
        qm = np.arange(mq)[None, :] < lq[:, None]
        km = np.arange(mk)[None, :] < lk[:, None]
        ks = jax.random.split(jax.random.PRNGKey(7), 4)

        def rnd(key, L, m):
            return jax.random.normal(key, (B, L, H, D), bf) * jnp.asarray(m, bf)[:, :, None, None]
        self.q, self.k, self.v, self.do = rnd(ks[0], mq, qm), rnd(ks[1], mk, km), rnd(ks[2], mk, km), rnd(ks[3], mq, qm)
        self.lq, self.lk = jnp.asarray(lq), jnp.asarray(lk)
        self.B = B
        step = max(1, (1 << 27) // (H * (4 * mq * mk + 4 * (mq + mk) * D)))
        self.step = 1 << (step.bit_length() - 1)  # a power of two: equal chunks, one compile
        HI = jax.lax.Precision.HIGHEST

        def attn(q, k, v, lk_, masked):
            s = jnp.einsum("bqnh,bknh->bnqk", q, k, precision=HI) * scale
            if masked:
                m = (jnp.arange(k.shape[1])[None, :] < lk_[:, None])[:, None, None, :]
                p = jax.nn.softmax(jnp.where(m, s, -1e30), axis=-1) * m
            else:
                p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("bnqk,bknh->bqnh", p, v, precision=HI)

        def valid(L, lens_):
            return (jnp.arange(L)[None, :] < lens_[:, None])[:, :, None, None]

        def maxdiff(x, r, m):
            d = jnp.abs(x.astype(f32) - r)
            bad = jnp.any(jnp.logical_and(m, ~jnp.isfinite(d)))
            return jnp.where(bad, jnp.inf, jnp.max(jnp.where(m, d, 0.0)))

        def maxabs(r, m):
            return jnp.max(jnp.where(m, jnp.abs(r), 0.0))

        def fwd_errs(q, k, v, lq_, lk_, o):
            qf, kf, vf = (x.astype(f32) for x in (q, k, v))
            r = attn(qf, kf, vf, lk_, True)
            u = attn(qf, kf, vf, lk_, False)
            m = valid(q.shape[1], lq_)
            return jnp.stack([maxdiff(o, r, m), maxabs(r, m), maxdiff(o, u, m)])

        def bwd_errs(q, k, v, do, lq_, lk_, dq, dk, dv):
            qf, kf, vf = (x.astype(f32) for x in (q, k, v))
            _, vjp = jax.vjp(lambda a, b, c: attn(a, b, c, lk_, True), qf, kf, vf)
            gq, gk, gv = vjp(do.astype(f32))
            mq_, mk_ = valid(q.shape[1], lq_), valid(k.shape[1], lk_)
            return jnp.stack([maxdiff(dq, gq, mq_), maxabs(gq, mq_), maxdiff(dk, gk, mk_), maxabs(gk, mk_),
                              maxdiff(dv, gv, mk_), maxabs(gv, mk_)])
        self.fwd_errs, self.bwd_errs = jax.jit(fwd_errs), jax.jit(bwd_errs)

        names = [("jax_dpa[xla]", "xla", True), ("jax_dpa[cudnn]", "cudnn", True)]
        if w.small:  # a control that must be flagged: lengths left out
            names.append(("jax_dpa[xla,no lengths]", "xla", False))
        recs = [self.peer(w, *n) for n in names]
        del self.q, self.k, self.v, self.do
        return recs

    def chunked(self, fn, *arrays):
        tot = None
        for b0 in range(0, self.B, self.step):
            b1 = min(self.B, b0 + self.step)
            part = [float(x) for x in fn(*(a[b0:b1] for a in arrays))]
            tot = part if tot is None else [max(x, y) for x, y in zip(tot, part)]
        return tot

    def peer(self, w, name, impl, with_lengths):
        jax = self.jax
        kwargs = "query_seq_lengths=lq, key_value_seq_lengths=lk, " if with_lengths else ""
        call = (f"jax.jit(jax.nn.dot_product_attention)(q, k, v, {kwargs}implementation='{impl}') "
                f"on padded BTNH [B,maxL,N,H]" + ("" if with_lengths else " (control: no lengths)"))
        rec = P.new_record(w.name, name, call, "padded",
                           "jax.jit(lambda f, g: f(g))(vjp_fn, dO), vjp_fn from one jax.vjp of the jitted forward")
        rec["control"] = not with_lengths
        if impl == "cudnn" and self.args.device == "cpu":
            rec.update(fwd_status="skip", bwd_status="skip", reason="CUDA-only peer (--device cpu)")
            return P.finish(rec)

        def f(q, k, v, lq, lk):
            kw = dict(query_seq_lengths=lq, key_value_seq_lengths=lk) if with_lengths else {}
            return jax.nn.dot_product_attention(q, k, v, implementation=impl, **kw)
        fwd = jax.jit(f)
        q, k, v, do, lq, lk = self.q, self.k, self.v, self.do, self.lq, self.lk
        try:
            o = self.block(fwd(q, k, v, lq, lk))
            e, mx, eu = self.chunked(self.fwd_errs, q, k, v, lq, lk, o)
            del o
            rec["fwd_err"] = rel(e, mx)
            if rec["fwd_err"] > P.TOL_FWD:
                rec["fwd_err_unmasked"] = rel(eu, mx)
            rec["fwd_status"] = P.fwd_status_from(rec["fwd_err"], rec["fwd_err_unmasked"])
            rec["fwd_us"] = self.bench(lambda: fwd(q, k, v, lq, lk))
        except Exception as ex:  # noqa: BLE001
            rec.update(fwd_status="oom" if is_oom(ex) else "refused", bwd_status="not run", reason=P.one_line(ex))
            return self.done(rec)
        if rec["fwd_status"] != "ok":
            rec["bwd_status"] = "not run (forward not correct)"
            return self.done(rec)
        try:
            _, vjp = jax.vjp(lambda a, b, c: fwd(a, b, c, lq, lk), q, k, v)
            bwd = jax.jit(lambda fn, g: fn(g))
            dq, dk, dv = self.block(bwd(vjp, do))
            r = self.chunked(self.bwd_errs, q, k, v, do, lq, lk, dq, dk, dv)
            del dq, dk, dv
            rec["bwd_err"] = {"dq": rel(r[0], r[1]), "dk": rel(r[2], r[3]), "dv": rel(r[4], r[5])}
            rec["bwd_status"] = P.bwd_status_from(rec["bwd_err"])
            rec["bwd_us"] = self.bench(lambda: bwd(vjp, do))
        except Exception as ex:  # noqa: BLE001
            rec.update(bwd_status="oom" if is_oom(ex) else "refused", reason=P.one_line(ex))
        return self.done(rec)

    def done(self, rec):
        P.finish(rec)
        err(f"{rec['workload']:28} {rec['peer']:28} fwd {P.fmt_us(rec['fwd_us']):>9} us  "
            f"bwd {P.fmt_us(rec['bwd_us']):>9} us  {rec['verdict']}")
        return rec


def rel(e, mx):
    if not math.isfinite(e):
        return math.inf
    return e / mx if mx > 0 else (0.0 if e == 0 else math.inf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--warmup-ms", type=int, default=50)
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args()
    if args.small:
        args.warmup_ms, args.rep_ms = min(args.warmup_ms, 5), min(args.rep_ms, 20)
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except Exception as e:  # noqa: BLE001
        print("UNAVAILABLE no JAX here: " + P.one_line(e), flush=True)
        return 0
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    try:
        backend, devs = jax.default_backend(), [str(d) for d in jax.devices()]
    except Exception as e:  # noqa: BLE001
        print("UNAVAILABLE jax.devices() failed: " + P.one_line(e), flush=True)
        return 0
    if args.device == "cuda" and backend != "gpu":
        print(f"UNAVAILABLE jax {jax.__version__} has no GPU backend (default backend {backend}, devices {devs})",
              flush=True)
        return 0
    import inspect
    dpa = getattr(jax.nn, "dot_product_attention", None)
    if dpa is None:
        print(f"UNAVAILABLE jax {jax.__version__} has no jax.nn.dot_product_attention", flush=True)
        return 0
    params = inspect.signature(dpa).parameters
    if "query_seq_lengths" not in params or "implementation" not in params:
        print(f"UNAVAILABLE jax {jax.__version__}: dot_product_attention{inspect.signature(dpa)} takes no "
              f"sequence lengths", flush=True)
        return 0
    info = dict(jax=jax.__version__, backend=backend, devices=devs,
                preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
                timing=(f"wall clock per call with jax.block_until_ready, median (warmup {args.warmup_ms} ms, "
                        f"{args.rep_ms} ms of repetitions; includes dispatch)"))
    print("READY " + json.dumps(info), flush=True)
    runner = Runner(jax, jnp, np, args)
    wl = {w.name: w for w in P.workload_list(args.small)}
    for line in sys.stdin:
        if not line.strip():
            continue
        name = json.loads(line)["workload"]
        try:
            recs = runner.workload(wl[name])
        except Exception as e:  # noqa: BLE001
            why = ("oom: " if is_oom(e) else "jax process error: ") + P.one_line(e)
            err(f"{name}: {why}")
            recs = P.jax_skip_records(wl[name], why)
            for r in recs:
                r["fwd_status"] = "oom" if is_oom(e) else "refused"
                P.finish(r)
        print("RESULT " + json.dumps(recs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
