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
reference's max |value|, peers.py's tolerances and verdicts. Timing: each synchronised call's
device span in the JAX profiler's trace (its first kernel's start to its last kernel's end, as
CUDA events around it measure; the L2 written over between calls, as peers.py's torch timer
does), median after a warm-up; where the trace holds no device kernels (no CUPTI, a CPU run) the
wall clock with jax.block_until_ready, which includes JAX's dispatch, and the record says so
(`fwd_timer`, `bwd_timer`; `--timer wall` asks for it).

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


# Annotation of one timed call in the profiler's trace, and the bytes written between calls.
CALL_MARK = "smallseq_timed_call_"
FLUSH_BYTES = 256 << 20


def read_trace(d):
    """The events of the Chrome-format trace `jax.profiler.trace(d, create_perfetto_trace=True)`
    wrote under `d`."""
    import glob
    import gzip

    found = sorted(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
        raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {d}")
    with gzip.open(found[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def is_gpu_process(name):
    return name.startswith("/device:GPU")


def device_spans(events, mark, is_device):
    """Per call annotated `mark + i` (complete events, `ph` X, times in us), the span of the
    complete events of the processes `is_device(process name)` accepts that start inside the
    annotation: from the first one's start to the last one's end. Calls without such an event
    are left out."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    calls = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in complete
                   if str(e.get("name", "")).startswith(mark))
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in complete
                     if is_device(names.get(e.get("pid"), "")))
    spans = []
    for t0, t1 in calls:
        inside = [k for k in kernels if t0 <= k[0] <= t1]
        if inside:
            spans.append(max(k[1] for k in inside) - inside[0][0])
    return spans


def err(msg):
    print(msg, file=sys.stderr, flush=True)


def is_oom(e):
    t = str(e)
    return "RESOURCE_EXHAUSTED" in t or "out of memory" in t.lower()


class Runner:
    def __init__(self, jax, jnp, np, args):
        self.jax, self.jnp, self.np, self.args = jax, jnp, np, args
        self.flush = self.flush_fn = None
        # why device timing cannot work here, once it failed (no CUPTI, a CPU run): every
        # later call takes the wall clock at once instead of tracing again
        self.no_device_timer = None

    def block(self, x):
        return self.jax.block_until_ready(x)

    def bench(self, fn):
        """`(us, timer)` per call: the median device time of synchronised calls after a warm-up
        (`device_us`), or, where the profiler gives no device events, the median wall clock
        (dispatch included) and the reason."""
        a = self.args
        self.block(fn())
        t0 = time.perf_counter()
        self.block(fn())
        est = max(time.perf_counter() - t0, 1e-6)
        for _ in range(max(1, int(a.warmup_ms * 1e-3 / est))):
            self.block(fn())
        reps = min(2000, max(5, int(a.rep_ms * 1e-3 / est)))
        if a.timer == "device" and self.no_device_timer is None:
            try:
                return self.device_us(fn, min(reps, 200)), "device"
            except Exception as e:  # noqa: BLE001
                self.no_device_timer = P.one_line(e)
                err(f"device timing failed, wall clock instead: {self.no_device_timer}")
        why = "--timer wall" if a.timer == "wall" else self.no_device_timer
        wall = f"wall clock ({why})"
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.block(fn())
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6, wall

    def device_us(self, fn, reps):
        """Median over `reps` calls of each call's device span (its first kernel's start to its
        last kernel's end), from the JAX profiler's trace: what CUDA events around the call
        measure, without JAX's dispatch. Each call runs synchronised under an annotation, after
        a write of `FLUSH_BYTES` that evicts the L2 (outside the annotation), as bench/peers.py's
        torch timer does."""
        import tempfile

        jax, jnp = self.jax, self.jnp
        if self.flush is None:
            self.flush = jnp.zeros(FLUSH_BYTES // 4, jnp.float32)
            self.flush_fn = jax.jit(lambda x: x + 1.0)
        with tempfile.TemporaryDirectory(prefix="smallseq-jax-trace-") as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for i in range(reps):
                    self.block(self.flush_fn(self.flush))
                    with jax.profiler.TraceAnnotation(f"{CALL_MARK}{i}"):
                        self.block(fn())
            events = read_trace(d)
        spans = device_spans(events, CALL_MARK, is_gpu_process)
        if len(spans) < reps:
            raise RuntimeError(f"the trace holds device kernels for {len(spans)} of {reps} calls")
        return statistics.median(spans)

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
            rec["fwd_us"], rec["fwd_timer"] = self.bench(lambda: fwd(q, k, v, lq, lk))
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
            rec["bwd_us"], rec["bwd_timer"] = self.bench(lambda: bwd(vjp, do))
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


def timing_note(args):
    how = ("device span per call from the JAX profiler (first kernel start to last kernel end, the L2 "
           "written over between calls)" if args.timer == "device" else "wall clock per call")
    return (f"{how}, median (warmup {args.warmup_ms} ms, {args.rep_ms} ms of repetitions); a record whose "
            "fwd_timer or bwd_timer names the wall clock fell back to it and says why")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--warmup-ms", type=int, default=50)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--timer", default="device", choices=("device", "wall"),
                    help="device: each call's kernels in the JAX profiler's trace (as CUDA events "
                         "would time them); wall: the wall clock of synchronised calls")
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
                timing=timing_note(args))
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
