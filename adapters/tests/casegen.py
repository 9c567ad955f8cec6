"""Builds case files for the adapter tests (random inputs exact in the case dtype)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import smallseq_adapter as kit  # noqa: E402


def make_case(
    lens_q,
    lens_kv,
    *,
    dtype="f32",
    heads=2,
    kv_heads=None,
    dqk=8,
    dv=None,
    mask="padding",
    window=(-1, -1),
    scale=None,
    gaps_q=None,
    gaps_kv=None,
    tail_q=0,
    tail_kv=0,
    backward=True,
    seed=0,
    poison=np.nan,
):
    """A case with slot lengths `lens_*`, `gaps_*[i]` don't-care tokens after slot i, `tail_*`
    tokens of tail slack, and `poison` in every don't-care token."""
    rng = np.random.default_rng(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    dv = dqk if dv is None else dv
    cfg = kit.Config(
        dtype, heads, kv_heads, dqk, dv, mask, tuple(window), 1.0 / np.sqrt(dqk) if scale is None else scale
    )

    def side(lens, gaps, tail):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        gaps = [0] * len(lens) if gaps is None else list(gaps)
        spans = np.array(lens) + np.array(gaps, dtype=np.int64)
        off = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        return kit.make_side(cu, off if any(gaps) else None, int(off[-1]) + tail)

    sq, skv = side(lens_q, gaps_q, tail_q), side(lens_kv, gaps_kv, tail_kv)

    def tensor(side, h, d):
        x = kit.round_to_dtype(rng.standard_normal((side.tokens, h, d)), dtype).astype(np.float32)
        x[~side.valid()] = poison
        return x

    q = tensor(sq, heads, dqk)
    k = tensor(skv, kv_heads, dqk)
    v = tensor(skv, kv_heads, dv)
    d_o = tensor(sq, heads, dv) if backward else None
    return kit.Case(cfg, q, k, v, d_o, sq, skv, {"smallseq.seed": str(seed)})


def with_bias(case, shape="1hss", sq=None, sk=None, seed=0, slopes=None):
    """`case` with semantics.md §1.9's bias: a post-scale tensor of broadcast `shape`
    (`[Bb, Hb, sq, sk]`, by default the longest lengths; random values exact in the case dtype),
    or, with `shape="alibi"`, ALiBi with `slopes` (default 0.5, 0.25, ...)."""
    import dataclasses

    c = case.config
    if shape == "alibi":
        cfg = dataclasses.replace(c, bias="alibi", bias_shape="")
        s = np.array([0.5 ** (h + 1) for h in range(c.num_heads)] if slopes is None else slopes, np.float32)
        return kit.Case(cfg, case.q, case.k, case.v, case.d_o, case.sq, case.skv, dict(case.meta), alibi_slopes=s)
    cfg = dataclasses.replace(c, bias="post_scale_bias", bias_shape=shape)
    bb = case.sq.slots if shape[0] == "b" else 1
    hb = c.num_heads if shape[1] == "h" else 1
    sq = case.sq.max_len if sq is None else sq
    sk = case.skv.max_len if sk is None else sk
    rng = np.random.default_rng(seed)
    t = kit.round_to_dtype(rng.standard_normal((bb, hb, sq, sk)), c.dtype).astype(np.float32)
    return kit.Case(cfg, case.q, case.k, case.v, case.d_o, case.sq, case.skv, dict(case.meta), bias=t)
