#!/usr/bin/env python3
"""numpy_reference: semantics.md §1 in plain numpy, f64 inside, outputs rounded once to the
input dtype (LSE as f32). Slow and simple; it exists so that CPU CI can drive the whole
worker protocol end to end through `smallseq fuzz --backend exec`.

Capabilities: every dtype, mask and window of §1, GQA, head_dim_v != head_dim_qk, any head
dim, padded offsets, backward and LSE. Rows with no visible key: O = 0, LSE = -inf, no
gradient. Don't-care tokens: never read, written 0 (-inf for LSE).
BSHD cases are the THD cases whose slots all hold S tokens (the kit flattens them).
The bias of §1.9 (a post-scale tensor of any broadcast, ALiBi) is added after the scale; a -inf
entry hides its key, and a row it hides entirely is a row with no visible key. dBias of a
post-scale bias: dS summed over the slots and heads that read each entry (0 where no slot reads
one, or where the key is hidden), in f64, rounded once to the input dtype (declared as dbias).
Cannot express: dropout (§1.8's Philox mask is not implemented here), `unsupported`, and
anything about paths or workspaces.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402


def softmax64(case: kit.Case, slot: int) -> tuple:
    """`(P, m, l, rows)` of one slot in f64: P [H, Lq, Lk], the row maxima and sums [H, Lq],
    and which query rows of each head see at least one key [H, Lq] (the mask's keys less those
    a -inf bias hides). Rows that see no key have P = 0."""
    c = case.config
    lq, lk = int(case.sq.lens[slot]), int(case.skv.lens[slot])
    oq, ok = int(case.sq.starts[slot]), int(case.skv.starts[slot])
    qs = case.q[oq : oq + lq].astype(np.float64)  # [Lq, H, D]
    ks = np.repeat(case.k[ok : ok + lk].astype(np.float64), c.group, axis=1)  # head h reads kv h // g
    bias = case.bias_of(slot)  # [H, Lq, Lk]
    vis = case.visible(slot)[None] & (bias != -np.inf)  # [H, Lq, Lk]
    rows = vis.any(axis=2)
    s = c.scale * np.einsum("rhd,chd->hrc", qs, ks)
    # Unread entries (a masked key) may hold anything: only visible ones are added.
    s = np.where(vis, s + np.where(vis, bias, 0.0), -np.inf)
    m = np.where(rows, s.max(axis=2, initial=-np.inf), 0.0)
    e = np.where(vis, np.exp(s - m[..., None]), 0.0)
    l = e.sum(axis=2)
    p = e / np.where(rows, l, 1.0)[..., None]  # zero rows stay zero
    return p, m, l, rows


def attention64(case: kit.Case, want: frozenset) -> dict:
    """The outputs in `want` in f64, unrounded (the reference a standalone repro compares to)."""
    c = case.config
    g = c.group
    q, k, v = (x.astype(np.float64) for x in (case.q, case.k, case.v))
    d_o = case.d_o.astype(np.float64) if case.d_o is not None else None
    hkv = c.num_kv_heads
    out = kit.no_query_outputs(case)  # every row the loop below does not reach keeps these
    o, lse, dq, dk, dv = (out[n] for n in kit.OUTPUTS)
    grads = bool(want & {"dq", "dk", "dv", kit.DBIAS})
    dbias = out.get(kit.DBIAS)  # [Bb, Hb, Sq, Sk] zeros with a post-scale bias
    for i in range(case.sq.slots):
        lq, lk = int(case.sq.lens[i]), int(case.skv.lens[i])
        if lq == 0 or lk == 0:
            continue
        oq, ok = int(case.sq.starts[i]), int(case.skv.starts[i])
        qs = q[oq : oq + lq]  # [Lq, H, D]
        ks = np.repeat(k[ok : ok + lk], g, axis=1)
        vs = np.repeat(v[ok : ok + lk], g, axis=1)
        p, m, l, rows = softmax64(case, i)
        o[oq : oq + lq] = np.einsum("hrc,chd->rhd", p, vs)
        lse[oq : oq + lq] = np.where(rows, m + np.log(np.where(rows, l, 1.0)), -np.inf).T
        if grads:
            dos = d_o[oq : oq + lq]
            dp = np.einsum("rhd,chd->hrc", dos, vs)
            ds = p * (dp - (p * dp).sum(axis=2, keepdims=True))
            dq[oq : oq + lq] = c.scale * np.einsum("hrc,chd->rhd", ds, ks)
            dke = c.scale * np.einsum("hrc,rhd->chd", ds, qs)
            dve = np.einsum("hrc,rhd->chd", p, dos)
            # heads h = j*g .. j*g+g-1 share kv head j: sum the group
            dk[ok : ok + lk] = dke.reshape(lk, hkv, g, -1).sum(axis=2)
            dv[ok : ok + lk] = dve.reshape(lk, hkv, g, -1).sum(axis=2)
            if dbias is not None:
                # semantics §1.9: the plane slot i reads gets its dS (0 at hidden keys, P = 0
                # there), summed over the heads when one plane serves them all.
                b = i if dbias.shape[0] > 1 else 0
                dbias[b, :, :lq, :lk] += ds if dbias.shape[1] > 1 else ds.sum(axis=0, keepdims=True)
    return {name: a for name, a in out.items() if name in want}


def attention(case: kit.Case, want: frozenset) -> dict:
    """`attention64`, rounded once: LSE to f32, the others to the case dtype."""
    dt = case.config.dtype
    return {n: kit.round_to_dtype(a, "f32" if n == "lse" else dt) for n, a in attention64(case, want).items()}


def adapter(argv=None) -> kit.Adapter:
    args = kit.arg_parser(__doc__).parse_args([] if argv is None else argv)
    caps = kit.Caps(
        dtypes=list(kit.DTYPES), masks=list(kit.MASKS), window=True, gqa=True, dv_ne_dqk=True,
        max_tokens=1 << 16, backward=True, lse=True, padded_offsets=True, arch="cpu", bias=True,
        dbias=True,
    )
    prov = {"implementation": "adapters/numpy_reference.py (f64, rounded once)"}
    return kit.Adapter("numpy-reference", f"numpy {np.__version__}", caps, attention, prov,
                       no_key_lse=args.no_key_lse)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter(sys.argv[1:])))
