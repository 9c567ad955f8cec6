#!/usr/bin/env python3
"""te_jax: TransformerEngine JAX `fused_attn` on THD with a `SequenceDescriptor`.

    python3 adapters/te_jax.py [--no-lse] [--no-key-lse -inf|+inf|nan]

NOT RUN HERE: TransformerEngine is not installable on the project's machines (no GPU build
here, no network on the H200). This adapter is written to TE's documented JAX API
(NVIDIA/TransformerEngine and ROCm/TransformerEngine `transformer_engine/jax/attention.py`,
`cpp_extensions/attention.py`); only its conversions are unit-tested
(adapters/tests/test_adapters.py). Expect to adjust it on first contact with a TE build.

How a case is called:
- q `[1, Tq, H, D]`, k/v `[1, Tk, Hkv, D]`: the whole THD buffer as one row, don't-care
  tokens included (TE sees the campaign's poison there, as a TE user's buffer would hold
  garbage); `SequenceDescriptor.from_seqlens_and_offsets((seqlens_q, seqlens_kv),
  (offsets_q, offsets_kv))` with `[1, M]` seqlens and `[1, M+1]` offsets (M = slots; -1 in
  unused entries), i.e. cu_seqlens and cu_seqlens_*_padded unchanged, zero-length slots
  included (TE's own compaction of them is part of what is tested).
- BSHD cases go through TE's dense path instead: `[B, S, H, D]`, `BSHD_BSHD_BSHD`,
  `SequenceDescriptor.from_seqlens((lens_q, lens_kv))`, softmax_aux `[B, H, S, 1]`.
- `qkv_layout=THD_THD_THD`, the case's mask as TE's `AttnMaskType` (all six exist),
  `window_size=(left, right)`; dropout 0, no bias, `is_training=True`.
- TE aligns windows bottom-right only for `*_BOTTOM_RIGHT` masks; with another mask and a
  window, a slot with Lq != Lk is `unsupported` (it would differ from semantics §1 by design).
- O, dQ, dK, dV are what TE wrote for every token, don't-care tokens included (TE's
  contract zero-fills them; the campaign judges it). The LSE (softmax_aux) is TE-internal,
  so its rows at don't-care tokens are written -inf by the adapter.
- LSE: `cpp_extensions.fused_attn_fwd` (the primitive behind `fused_attn`) returns
  `softmax_aux`: `[1, Tq, H, 1]` token-major (cuDNN >= 9.6 THD, and ROCm CK after PR #625) or
  `[1, H, Tq, 1]` head-major (older ROCm CK); read off its shape. cuDNN < 9.6 gives
  `[1, H, S, M]` per segment, which is not a per-token LSE: then `lse` is `unsupported`.
  The forward runs twice when LSE is wanted (once inside `jax.vjp`, once for the aux).
- Backward: `jax.vjp` of `fused_attn` (TE's custom_vjp calls its fused backward).
- `env` (e.g. `NVTE_FUSED_ATTN_CK_SMALLSEQ=1`) is applied around tracing and running; the
  jitted executable is cached per (config, env), so TE sizes its workspace and executes
  under the same environment (te-smallseq-path.md §3.2 describes what goes wrong otherwise;
  `trace_env` is not offered: that needs `harness_options`, which also needs `fill`).

Cannot express: dropout, bias, f32, head_dim_v != head_dim_qk, a window with Lq != Lk on a
non-bottom-right mask; paths and workspaces (TE reports neither to a caller).
"""

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402

TE_MASKS = {
    "no_mask": "NO_MASK",
    "padding": "PADDING_MASK",
    "causal": "CAUSAL_MASK",
    "padding_causal": "PADDING_CAUSAL_MASK",
    "causal_bottom_right": "CAUSAL_BOTTOM_RIGHT_MASK",
    "padding_causal_bottom_right": "PADDING_CAUSAL_BOTTOM_RIGHT_MASK",
}


def descriptor_arrays(case: kit.Case):
    """(seqlens_q, seqlens_kv, offsets_q, offsets_kv) for `from_seqlens_and_offsets`, and
    max_segments_per_seq (at least 1: TE sizes arrays from it)."""
    m = max(case.sq.slots, 1)
    sl_q, off_q = kit.te_seqlens_offsets(case.sq, m)
    sl_kv, off_kv = kit.te_seqlens_offsets(case.skv, m)
    return sl_q, sl_kv, off_q, off_kv, m


def bshd_shape(case: kit.Case):
    """(B, S_q, S_kv) of a BSHD case (every slot holds S tokens; the case reader checked)."""
    b = case.sq.slots
    return b, (case.sq.tokens // b if b else 0), (case.skv.tokens // b if b else 0)


def window_for(case: kit.Case):
    """TE's `window_size`, or Unsupported where TE's alignment differs from §1's."""
    c = case.config
    if c.window == (-1, -1):
        return None
    if c.causal != "bottom_right":
        both = (case.sq.lens > 0) & (case.skv.lens > 0)
        if np.any(case.sq.lens[both] != case.skv.lens[both]):
            raise kit.Unsupported(f"window {list(c.window)} with mask {c.mask} and Lq != Lk: TE aligns it top-left")
    return tuple(int(x) for x in c.window)


def aux_layout(shape, heads: int, tokens: int) -> str:
    """"th" or "ht" for a softmax_aux of `shape`; Unsupported for the per-segment layout."""
    dims = list(shape)
    if len(dims) == 4 and dims[0] == 1 and dims[3] == 1:
        a, b = dims[1], dims[2]
        if (a, b) == (tokens, heads):
            return "th"
        if (a, b) == (heads, tokens):
            return "ht"
    raise kit.Unsupported(f"softmax_aux of shape {dims} is not a per-token LSE for {tokens} tokens and {heads} heads")


def keywords(fn, **kw):
    """The keyword arguments `fn` takes (TE's signatures moved between versions)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


class TeJax:
    def __init__(self, lse: bool):
        self.lse = lse
        self.cache = {}

    def setup(self, adapter: kit.Adapter):
        import jax
        import jax.numpy as jnp
        import transformer_engine
        from transformer_engine.jax import attention as te_attn
        from transformer_engine.jax.cpp_extensions import attention as te_ext

        self.jax, self.jnp, self.te, self.ext = jax, jnp, te_attn, te_ext
        dev = jax.devices()[0]
        adapter.version = f"transformer_engine {getattr(transformer_engine, '__version__', '?')}, jax {jax.__version__}"
        adapter.provenance.update({"device": str(getattr(dev, "device_kind", dev))})
        adapter.caps.arch = os.environ.get("SMALLSEQ_ARCH")  # e.g. gfx942; the dispatch gate asks it

    def static_args(self, case):
        te = self.te
        c = case.config
        kw = dict(
            attn_bias_type=te.AttnBiasType.NO_BIAS,
            attn_mask_type=getattr(te.AttnMaskType, TE_MASKS[c.mask]),
            qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD if c.layout == "bshd" else te.QKVLayout.THD_THD_THD,
            scaling_factor=float(c.scale),
            dropout_probability=0.0,
            is_training=True,
            window_size=window_for(case),
        )
        if hasattr(te, "AttnSoftmaxType"):
            kw["softmax_type"] = te.AttnSoftmaxType.VANILLA_SOFTMAX
        return kw

    def compiled(self, key, static, m, with_lse, grads):
        if key not in self.cache:
            jax, te, ext = self.jax, self.te, self.ext

            def desc(sl_q, sl_kv, off_q, off_kv):
                if off_q is None:
                    return te.SequenceDescriptor.from_seqlens((sl_q, sl_kv))
                return te.SequenceDescriptor.from_seqlens_and_offsets((sl_q, sl_kv), (off_q, off_kv))

            def fwd_bwd(q, k, v, g, sl_q, sl_kv, off_q, off_kv):
                sd = desc(sl_q, sl_kv, off_q, off_kv)
                kw = keywords(te.fused_attn, bias=None, sequence_descriptor=sd, seed=None,
                              max_segments_per_seq=m, **static)

                def f(q, k, v):
                    return te.fused_attn((q, k, v), **kw)

                out, vjp = jax.vjp(f, q, k, v)
                res = {"o": out}
                if grads:
                    res["dq"], res["dk"], res["dv"] = vjp(g)
                if with_lse:
                    kx = keywords(ext.fused_attn_fwd, bias=None, softmax_offset=None, sequence_descriptor=sd,
                                  seed=None, max_segments_per_seq=m, **static)
                    _, aux, _ = ext.fused_attn_fwd((q, k, v), **kx)
                    res["lse"] = aux
                return res

            self.cache[key] = jax.jit(fwd_bwd)
        return self.cache[key]

    def run(self, case: kit.Case, want: frozenset) -> dict:
        jnp = self.jnp
        c = case.config
        static = self.static_args(case)
        dt = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[c.dtype]
        grads = bool(want & {"dq", "dk", "dv"})
        d_o = case.d_o if grads else np.zeros((case.sq.tokens, c.num_heads, c.head_dim_v), np.float32)
        if c.layout == "bshd":
            (b, s_q, s_kv), m = bshd_shape(case), 1
            shapes = [(b, s_q), (b, s_kv), (b, s_kv), (b, s_q)]
            ints = [case.sq.lens.astype(np.int32), case.skv.lens.astype(np.int32), None, None]
        else:
            sl_q, sl_kv, off_q, off_kv, m = descriptor_arrays(case)
            shapes = [(1, case.sq.tokens), (1, case.skv.tokens), (1, case.skv.tokens), (1, case.sq.tokens)]
            ints = [sl_q, sl_kv, off_q, off_kv]
        args = [jnp.asarray(x.reshape(shp + x.shape[1:]), dtype=dt) for x, shp in zip((case.q, case.k, case.v, d_o), shapes)]
        args += [None if x is None else jnp.asarray(x) for x in ints]
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("NVTE_")))
        key = (tuple(sorted((k, str(v)) for k, v in static.items())), m, "lse" in want, grads, env)
        with kit.calling("transformer_engine"):
            res = self.compiled(key, static, m, "lse" in want, grads)(*args)
            res = {n: np.asarray(t.astype(jnp.float32)) for n, t in res.items()}
        out = {n: res[n].reshape((-1,) + res[n].shape[2:]) for n in ("o", "dq", "dk", "dv") if n in res}
        if "lse" in want:
            aux = res["lse"]
            if c.layout == "bshd":
                out["lse"] = kit.lse_to_thd(aux[..., 0], case.sq, "bhs")
                return out
            layout = aux_layout(aux.shape, c.num_heads, case.sq.tokens)
            # softmax_aux is TE-internal: its rows at don't-care tokens mean nothing, so they
            # become -inf; valid rows are TE's values, unchanged
            out["lse"] = kit.lse_to_thd(aux[0, :, :, 0], case.sq, layout)
        return out


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__)
    ap.add_argument("--no-lse", action="store_true")
    args = ap.parse_args(argv)
    impl = TeJax(not args.no_lse)
    caps = kit.Caps(
        dtypes=["bf16", "f16"], masks=list(kit.MASKS), window=True, gqa=True,
        head_dims=[32, 64, 128, 256], max_tokens=1 << 20, backward=True, lse=not args.no_lse,
        padded_offsets=True,
    )
    caps.devices = args.devices
    return kit.Adapter("te-jax-fused-attn", "transformer_engine", caps, impl.run,
                       no_key_lse=args.no_key_lse, setup=impl.setup)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter()))
