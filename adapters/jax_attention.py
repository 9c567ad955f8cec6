#!/usr/bin/env python3
"""jax_attention: `jax.nn.dot_product_attention` (padded batch plus sequence lengths).

    python3 adapters/jax_attention.py --implementation xla|cudnn [--lse]
                                      [--precision highest|default] [--no-key-lse -inf|+inf|nan]

- THD -> `[B, S, N, H]` with slot b in row b, `query_seq_lengths` / `key_value_seq_lengths`
  from cu_seqlens (both always given: jax-ml/jax#23349). Pad positions hold zeros; outputs at
  don't-care tokens are written 0 (LSE -inf): JAX never computed them. S is rounded up to a
  power of two (at least 8), and on xla B too (extra rows of length 0), so that cases share
  jitted executables; they are also cached on disk (SMALLSEQ_JAX_CACHE, default
  /tmp/smallseq-jax-cache) for every worker.
- Masks, chosen so that JAX's own arguments carry them wherever they are exact: top-left
  causal -> `is_causal`; bottom-right causal and windows -> `is_causal` / `local_window_size`
  when every slot has Lq == Lk (JAX's window and causal are index-aligned, i.e. top-left,
  which equals semantics §1's bottom-right alignment only then). Otherwise xla gets the
  exact boolean `mask` [B, 1, Sq, Sk]; cudnn cannot take it and answers `unsupported`.
  cudnn also refuses a right window without causal (JAX raises; reported as unsupported).
- Backward: `jax.vjp` of the call, cotangent = the padded d_o.
- `jax_default_matmul_precision` is "highest" unless `--precision default` (XLA may use TF32
  for f32 dots on the GPU by default, which f32 cases would then fail by design).
- LSE: `return_residual=True` (jax >= 0.8.1) gives `[B, T, N]` **in the input dtype**
  (bf16 keeps 8 significant bits), so `lse` is off unless `--lse` is given; with it, expect
  LSE mismatches from that rounding alone on bf16/f16.
- Rows with no visible key: XLA attends uniformly to every key of the row (masked logits
  are a large finite negative), so `no_key_row` is `other` on xla; cudnn declares `zero`.

Cannot express: dropout, bias, head_dim_v != head_dim_qk, f32 on cudnn, bottom-right
causal or windows with Lq != Lk on cudnn, right windows without causal on cudnn.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402


def bucket(n: int) -> int:
    """A padded length for n tokens: the next power of two, at least 8, so that cases share
    compiled executables (padding positions are masked by the sequence lengths)."""
    return max(8, 1 << max(n - 1, 0).bit_length())


def plan(case: kit.Case, implementation: str, sq: int = None, sk: int = None) -> dict:
    """The keyword arguments that express the case's mask and window in a padded batch of
    `sq` x `sk` (default: the longest slots): `is_causal`, `local_window_size` and, on xla
    when nothing else is exact, `mask` (numpy bool [B, 1, sq, sk])."""
    sq = case.sq.max_len if sq is None else sq
    sk = case.skv.max_len if sk is None else sk
    c = case.config
    both = (case.sq.lens > 0) & (case.skv.lens > 0)
    square = bool(np.all(case.sq.lens[both] == case.skv.lens[both]))
    windowed = c.window != (-1, -1)
    exact = square or (not windowed and c.causal != "bottom_right")
    if not exact:
        if implementation == "cudnn":
            raise kit.Unsupported(
                f"{c.mask} with window {list(c.window)} and Lq != Lk: JAX's masks are top-left aligned and cudnn takes no explicit mask"
            )
        return {"is_causal": False, "local_window_size": None, "mask": case.padded_mask(sq, sk)[:, None]}
    out = {"is_causal": c.causal is not None, "local_window_size": None, "mask": None}
    if windowed:
        far = max(sq, sk) + 1  # "unbounded" within any row
        left, right = c.window
        out["local_window_size"] = (left if left >= 0 else far, right if right >= 0 else far)
    return out


class JaxAttention:
    def __init__(self, implementation: str, precision: str = "highest"):
        self.impl, self.precision = implementation, precision
        self.cache = {}

    def setup(self, adapter: kit.Adapter):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # one worker per job
        import jax
        import jax.numpy as jnp

        # f32 cases are judged as f32 arithmetic: no TF32 in XLA's dots unless asked
        jax.config.update("jax_default_matmul_precision", self.precision)
        # compiling dominates a small case; workers share compiled executables through this
        cache = os.environ.get("SMALLSEQ_JAX_CACHE", os.path.join("/tmp", "smallseq-jax-cache"))
        for key, value in (("jax_compilation_cache_dir", cache), ("jax_persistent_cache_min_compile_time_secs", 0)):
            try:
                jax.config.update(key, value)
            except (AttributeError, KeyError, ValueError) as e:
                kit.log(f"jax config {key}: {e}")

        self.jax, self.jnp = jax, jnp
        dev = jax.devices()[0]
        adapter.version = f"jax {jax.__version__}"
        adapter.provenance.update(
            {"implementation": self.impl, "precision": self.precision, "device": str(getattr(dev, "device_kind", dev))}
        )
        if dev.platform == "cpu":
            self.drop_dtypes_cpu_refuses(adapter)

    def drop_dtypes_cpu_refuses(self, adapter: kit.Adapter):
        """XLA's CPU backend refuses some dtypes' dots outright (jax 0.10 at "highest":
        `The precision 'F16_F16_F32' is not supported by dot_general on CPU`): a forward and
        backward of the kit's 4-query probe case through this adapter in each declared dtype,
        and the ones that fail leave the handshake's dtypes, so a campaign draws no case that
        every run would decline (a CPU campaign of seed 103 drew 167 such f16 cases of 401)."""
        kept = []
        for name in adapter.caps.dtypes:
            case = kit.no_key_probe_case(name, 16)
            case = dataclasses.replace(case, d_o=np.ones_like(case.q))
            try:
                self.run(case, frozenset({"o", "dq", "dk", "dv"}))
                kept.append(name)
            except Exception as e:  # what XLA raises differs across jax versions
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                kit.log(f"{name} left out: XLA on this CPU refuses it ({first})")
        adapter.caps.dtypes = kept

    def compiled(self, static):
        """One jitted forward (+ vjp) per mask/scale/output choice; jax caches per shape."""
        if static not in self.cache:
            jax = self.jax
            is_causal, window, scale, with_lse, grads = static

            def f(q, k, v, lq, lk, mask):
                r = jax.nn.dot_product_attention(
                    q, k, v, mask=mask, scale=scale, is_causal=is_causal,
                    query_seq_lengths=lq, key_value_seq_lengths=lk,
                    local_window_size=window, implementation=self.impl,
                    **({"return_residual": True} if with_lse else {}),
                )
                return r if with_lse else (r, None)

            def fwd_bwd(q, k, v, g, lq, lk, mask):
                out, vjp, lse = jax.vjp(lambda q, k, v: f(q, k, v, lq, lk, mask), q, k, v, has_aux=True)
                res = {"o": out}
                if with_lse:
                    res["lse"] = lse
                if grads:
                    res["dq"], res["dk"], res["dv"] = vjp(g)
                return res

            self.cache[static] = jax.jit(fwd_bwd)
        return self.cache[static]

    def run(self, case: kit.Case, want: frozenset) -> dict:
        jnp = self.jnp
        c = case.config
        tq = case.sq.tokens
        if case.sq.max_len == 0:
            return kit.no_query_outputs(case)
        sq, sk = bucket(case.sq.max_len), bucket(case.skv.max_len)
        b = case.sq.slots
        # xla also pads the batch (rows of length 0 are ignored); cudnn gets the exact batch,
        # since zero-length rows are a known cuDNN hazard the adapter must not introduce
        bb = bucket(b) if self.impl == "xla" else b
        kw = plan(case, self.impl, sq, sk)
        dt = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[c.dtype]

        def batch(x, side, s):
            p = kit.to_padded(x, side, s)
            return np.concatenate([p, np.zeros((bb - b,) + p.shape[1:], p.dtype)])

        def lens(side):
            return jnp.asarray(np.concatenate([side.lens, np.zeros(bb - b, np.int64)]), dtype=jnp.int32)

        grads = bool(want & {"dq", "dk", "dv"})
        d_o = case.d_o if grads else np.zeros((tq, c.num_heads, c.head_dim_v), np.float32)
        if self.impl == "xla":
            # XLA attends uniformly in a row with no visible key; a user leaves such rows out
            # of the loss, so their d_o is 0 and they add nothing to dK / dV.
            d_o = np.where(case.no_key_rows()[:, None, None], 0.0, d_o)
        q, g = (jnp.asarray(batch(x, case.sq, sq), dtype=dt) for x in (case.q, d_o))
        k, v = (jnp.asarray(batch(x, case.skv, sk), dtype=dt) for x in (case.k, case.v))
        mask = None
        if kw["mask"] is not None:
            mask = jnp.asarray(np.concatenate([kw["mask"], np.zeros((bb - b,) + kw["mask"].shape[1:], bool)]))
        static = (kw["is_causal"], kw["local_window_size"], float(c.scale), "lse" in want, grads)
        with kit.calling(f"jax {self.impl}"):
            res = self.compiled(static)(q, k, v, g, lens(case.sq), lens(case.skv), mask)
            res = {n: np.asarray(t.astype(jnp.float32))[:b] for n, t in res.items()}
        return kit.from_padded_outputs(case, res, lse_layout="bsh")


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__)
    ap.add_argument("--implementation", required=True, choices=["xla", "cudnn"])
    ap.add_argument("--lse", action="store_true")
    ap.add_argument("--precision", default="highest", choices=["highest", "default"])
    args = ap.parse_args(argv)
    impl = JaxAttention(args.implementation, args.precision)
    cudnn = args.implementation == "cudnn"
    caps = kit.Caps(
        dtypes=["bf16", "f16"] if cudnn else ["bf16", "f16", "f32"], masks=list(kit.MASKS),
        window=True, gqa=True, head_dims=[16, 32, 64, 128, 192, 256] if cudnn else None,
        max_tokens=1 << 16, backward=True, lse=args.lse, padded_offsets=True,
        no_key_row="zero" if cudnn else "other",
        # jit compiles each new shape (and each relation's run is a new one): a call ran past
        # the default 30 s on an H100 host busy with eight campaigns and passed on a fresh
        # worker (seed 71, 2026-12-07); a real hang is still caught, in three minutes
        case_timeout_s=180.0,
    )
    caps.devices = args.devices
    return kit.Adapter(f"jax-dpa-{args.implementation}", "jax", caps, impl.run,
                       no_key_lse=args.no_key_lse, setup=impl.setup)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter()))
