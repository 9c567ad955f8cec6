#!/usr/bin/env python3
"""torch_sdpa: `torch.nn.functional.scaled_dot_product_attention` pinned to one kernel.

    python3 adapters/torch_sdpa.py --kernel math|efficient|flash|cudnn [--carry-poison]
                                   [--no-key-lse -inf|+inf|nan]

How a THD case becomes SDPA calls (`docs/adapters.md` has the table of capabilities):
- math, efficient, cudnn: one padded batch `[B, H, S, D]` (slot b in row b) with a boolean
  `attn_mask [B, 1, Sq, Sk]` that holds the case's mask exactly (causal top-left or
  bottom-right per slot, windows, lengths). Query rows past a slot's length are pad rows:
  they see key 0 of their row so that they are never fully masked (only the case's own
  no-key rows are), and their d_o is 0, so they add exactly 0 to dK and dV.
- flash (takes no mask): slots are grouped by (Lq, Lk) and each group runs as a dense batch
  with no mask; causal masks go through `is_causal`, which is top-left: a bottom-right mask
  with Lq != Lk is `unsupported` (the CPU's flash kernel would run it top-left), and SDPA's
  CUDA flash refuses top-left with Lq != Lk (`unsupported` with torch's reason; the CPU's
  runs it). No windows.
- Kernel pinning: `torch.nn.attention.sdpa_kernel([one backend])`; the autograd node that
  produced O is checked to be that kernel's (`ScaledDotProduct{Flash,Efficient,Cudnn}...`).
- LSE: the tensor the kernel saved for its own backward (`_saved_logsumexp` /
  `_saved_log_sumexp` of that node, `[B, H, S]`, S rounded up to 32 on efficient); math
  has none (lse false).
- Backward: autograd (`torch.autograd.grad` with the padded d_o).
- Don't-care tokens: never handed to torch by default (the padded batch is zero past each
  slot's length); `--carry-poison` fills a slot's pad key/value positions with its own
  pad-between-seqs tokens, so NaN/Inf poison reaches keys every row has masked out (not
  query rows: SDPA cannot know a query row is padding). Don't-care outputs are written 0
  (LSE -inf): torch never computed them. The math kernel fails `--carry-poison` by design:
  it applies the boolean mask as an additive -inf bias (NaN + -inf is NaN) and multiplies
  P = 0 by the masked values (0 * NaN is NaN), so a NaN or inf at a masked key reaches O and
  the gradients (CPU, seed 108: 108 of 341 cases failed, 11 groups, all of that kind).
- No-key rows: math, efficient and cudnn were seen to write O = 0 (external-apis.md §0b).
  The LSE each writes there is declared per kernel (`NO_KEY_LSE`; --no-key-lse overrides)
  and recorded in the handshake; the kit maps exactly that value to -inf in the rows the
  case says see no key, and the campaign reports any other value:
  flash +inf (FA2's `lse = sum == 0 ? INFINITY : ...`); efficient measured at start
  (`probe`: PyTorch's memory-efficient kernel sets a fully masked row's max to 0 and its sum
  to 1 since the safe-softmax change of torch 2.5, so 0 is expected; read from source, not
  yet run); cudnn measured at start (cuDNN documents no value: on the H200, cuDNN 9 of
  torch 2.11 wrote -65535.07 and -65534.83, the `underflow` convention, FINDINGS.md item 3);
  math has no LSE.
- Cases with no query token at all are answered without a launch (all outputs zero).
- Bias (semantics.md §1.9; math, efficient, cudnn): SDPA's float `attn_mask` is added to the
  scores after the scale, which is TE's post-scale bias. The mask becomes `[B, H, Sq, Sk]`
  float: the case's bias (any broadcast, or ALiBi's bottom-right distances per slot) where the
  case's mask lets a key through, -inf elsewhere. A real row whose every key the bias hides
  would be a NaN row in SDPA; §1.9 says it has no visible key, so it is run like a pad row
  (key 0, d_o 0: nothing reaches dK, dV) and written O = 0, LSE = -inf, dQ = 0.
- The float mask's dtype: the math kernel takes it in f32 (PyTorch computes a 16-bit case in
  f32 there), so ALiBi's bias reaches it as semantics.md §1.9 forms it. The fused kernels take
  it in the query's dtype only; a case whose mask does not hold exactly in that dtype (ALiBi
  past small distances) is `unsupported` there, as running it would run another bias (seed
  29 of the H100 campaign: ALiBi at distance 100 rounded to f16 moved O by 1.6e-2).
- dBias (post-scale bias; math and efficient declare dbias): the float mask is built in torch
  from a leaf tensor, the case's bias `[Bb, Hb, Sq, Sk]` with requires_grad: sliced to the
  padded batch, expanded to `[B, H, Sq, Sk]`, -inf where the case's mask or the bias hides a
  key, 0 at key 0 of pad and hidden rows (`torch.where`, so those entries take no gradient).
  `torch.autograd.grad` then gives dBias with the sum over the broadcast slots and heads done
  by autograd. cudnn declares no dbias: torch's cuDNN backward returns dQ, dK and dV only
  (its attn_mask is passed without requires_grad). ALiBi has no dBias (§1.9).
- Determinism (efficient and flash declare dq nondeterministic, `caps.nondeterministic`). Flash
  runs FA2's backward with deterministic=false, dQ added over key blocks with atomics (PyTorch
  warns "Flash Attention defaults to a non-deterministic algorithm"), as torch_varlen.py. PyTorch's
  memory-efficient backward splits the keys over thread blocks (`num_splits_key`) and each
  adds its partial dQ into one f32 accumulator in the order the blocks take its lock
  (aten/src/ATen/native/transformers/cuda/attention_backward.cu; under
  `torch.use_deterministic_algorithms(True, warn_only=True)` it warns "Memory Efficient
  attention defaults to a non-deterministic algorithm", pytorch/pytorch#101847, and strict
  deterministic mode forces one split, #91979). We do not set that mode: the campaign tests
  the kernel as frameworks call it, so dQ's reruns are held to tolerance, not to their bits.
  dK and dV are each written by the one block that owns their keys, and stay bitwise.

Cannot express: dropout; bias and windows on flash (no mask); dBias on cudnn; top-left/bottom-right causal with
Lq != Lk on flash (unsupported per case); GQA on efficient (SDPA refuses it); f32 on flash
and cudnn; head dims outside the list in `caps_for`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402

FUSED_DIMS = [16, 32, 64, 128, 192, 256]
NODE = {"efficient": "Efficient", "flash": "Flash", "cudnn": "Cudnn"}
# What each kernel writes into the LSE of a row with no visible key (see the header).
NO_KEY_LSE = {"math": "-inf", "flash": "+inf", "efficient": kit.PROBE, "cudnn": kit.PROBE}


def caps_for(kernel: str) -> kit.Caps:
    caps = kit.Caps(
        dtypes=["bf16", "f16", "f32"], masks=list(kit.MASKS), window=True, gqa=True, dv_ne_dqk=True,
        max_tokens=1 << 16, backward=True, lse=kernel != "math", padded_offsets=True,
    )
    # A float attn_mask carries the bias; flash takes no mask. Its gradient: math (autograd
    # through the decomposition) and efficient (the kernel's grad_bias); not cudnn (see the header).
    caps.bias = kernel != "flash"
    caps.dbias = kernel in ("math", "efficient")
    if kernel == "efficient":
        caps.gqa = False
        caps.head_dims = FUSED_DIMS
        # dQ's key splits are summed in run order (see the header); dK, dV stay bitwise.
        caps.nondeterministic = ("dq",)
        caps.nondeterministic_note = "dq summed over key splits in the order they take an atomic lock"
    if kernel == "flash":
        caps.dtypes, caps.window, caps.dv_ne_dqk, caps.head_dims = ["bf16", "f16"], False, False, FUSED_DIMS
        # The same FA2 backward as torch_varlen.py's flash (deterministic=false there too).
        caps.nondeterministic = ("dq",)
        caps.nondeterministic_note = "dq summed over key blocks with atomics (FA2, deterministic=false)"
    if kernel == "cudnn":
        caps.dtypes, caps.head_dims = ["bf16", "f16"], [d for d in FUSED_DIMS if d != 192]
    return caps


def pad_row_mask(case: kit.Case, sq: int, sk: int) -> np.ndarray:
    """[B, 1, Sq, Sk] bool: the case's mask, plus key 0 for the pad rows past each slot."""
    m = case.padded_mask(sq, sk)
    if sk:
        for b in range(case.sq.slots):
            m[b, int(case.sq.lens[b]) :, 0] = True
    return m[:, None]


def padded_bias(case: kit.Case, sq: int, sk: int) -> np.ndarray:
    """[B, H, Sq, Sk] f64: what semantics.md §1.9 adds to each slot's scores, 0 past its lengths."""
    bias = np.zeros((case.sq.slots, case.config.num_heads, sq, sk))
    for b in range(case.sq.slots):
        lq, lk = int(case.sq.lens[b]), int(case.skv.lens[b])
        bias[b, :, :lq, :lk] = case.bias_of(b)
    return bias


def mask_parts(case: kit.Case, sq: int, sk: int):
    """`(vis, key0, hidden)` of the bias mask (see the header): `vis [B, H, Sq, Sk]`, the keys
    the case's mask and bias let through; `key0 [B, H, Sq, Sk]`, key 0 of the pad rows and of
    the rows the bias hides entirely (0 in the mask, so that SDPA sees no fully masked row);
    `hidden [B, H, Sq]`, those hidden rows (written as §1.3 says by `hide_rows`)."""
    b_n, h_n = case.sq.slots, case.config.num_heads
    seen = case.padded_mask(sq, sk)  # [B, Sq, Sk]
    vis = seen[:, None] & (padded_bias(case, sq, sk) != -np.inf)
    hidden = seen.any(axis=2)[:, None] & ~vis.any(axis=3)
    key0 = np.zeros((b_n, h_n, sq, sk), dtype=bool)
    if sk:
        pad = np.zeros((b_n, h_n, sq), dtype=bool)
        for b in range(b_n):
            pad[b, :, int(case.sq.lens[b]) :] = True
        key0[..., 0] = pad | hidden
    return vis, key0, hidden


def bias_mask(case: kit.Case, sq: int, sk: int):
    """`(mask, hidden)`: the `[B, H, Sq, Sk]` f32 additive attn_mask of the case's bias (see the
    header) and `[B, H, Sq]` bool, the real rows the bias hides entirely (`mask_parts`)."""
    vis, key0, hidden = mask_parts(case, sq, sk)
    bias = padded_bias(case, sq, sk)
    mask = np.where(key0, 0.0, np.where(vis, np.where(vis, bias, 0.0), -np.inf))
    return mask.astype(np.float32), hidden


def inexact_mask(mask: np.ndarray, dtype: str, kernel: str):
    """`unsupported` when the float mask `[B, H, Sq, Sk]` does not hold exactly in `dtype` at a
    key it lets through: the fused kernels take it in the query's dtype, so they would run
    another bias than the case's (ALiBi's `slope · distance`, which semantics.md §1.9 forms
    in f32; a post-scale bias is stored in the input dtype and always holds)."""
    finite = np.isfinite(mask)
    rounded = kit.round_to_dtype(np.where(finite, mask, 0.0), dtype)
    off = np.argwhere(finite & (rounded != mask))
    if len(off):
        i = tuple(int(x) for x in off[0])
        raise kit.Unsupported(f"the bias {float(mask[i])!r} at [slot, head, row, key] {list(i)} is not exact in "
                              f"{dtype}, and SDPA's {kernel} kernel takes its float mask in the query's dtype")


def hide_rows(res: dict, hidden: np.ndarray):
    """Writes the rows `hidden [B, H, Sq]` as rows with no visible key: O = 0, LSE = -inf,
    dQ = 0 (`res` holds the padded `[B, S, H, D]` outputs and the kernel's `[B, H, S]` LSE)."""
    b, h, r = np.nonzero(hidden)
    for name in ("o", "dq"):
        if name in res:
            res[name][b, r, h] = 0.0
    if "lse" in res:
        res["lse"][b, h, r] = -np.inf


def length_groups(case: kit.Case):
    """{(Lq, Lk): [slots]} for the slots with at least one query."""
    groups = {}
    for b in range(case.sq.slots):
        lq, lk = int(case.sq.lens[b]), int(case.skv.lens[b])
        if lq:
            groups.setdefault((lq, lk), []).append(b)
    return groups


class TorchSdpa:
    def __init__(self, kernel: str, carry_poison: bool):
        self.kernel = kernel
        self.pad = "span" if carry_poison else "zero"

    def setup(self, adapter: kit.Adapter):
        import torch

        self.torch = torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "math": SDPBackend.MATH,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }[self.kernel]
        self.pinned = lambda: sdpa_kernel([backend])
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        adapter.version = f"torch {torch.__version__}"
        adapter.provenance.update(
            {
                "kernel": self.kernel,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "cuda": str(torch.version.cuda),
                "cudnn": str(torch.backends.cudnn.version()),
                "poison": self.pad,
            }
        )
        adapter.caps.arch = (
            "sm_{}{}".format(*torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else "cpu"
        )

    def tensor(self, x, dtype, grad):
        t = self.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.dev)
        return t.to(dtype).requires_grad_(grad)

    def lse_of(self, out):
        """The LSE the kernel saved for its backward, from the autograd node that made O."""
        seen, todo = set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            name = type(node).__name__
            if "ScaledDotProduct" in name:
                if NODE[self.kernel] not in name:
                    raise kit.Internal(f"pinned to {self.kernel} but torch ran {name}")
                # `_saved_logsumexp` (flash, cudnn) or `_saved_log_sumexp` (efficient)
                for attr in sorted(a for a in dir(node) if a.startswith("_saved_") and "sumexp" in a):
                    return getattr(node, attr)
                raise kit.Internal(f"{name} holds no saved logsumexp")
            todo.extend(n for n, _ in node.next_functions)
        raise kit.Internal(f"no ScaledDotProduct node behind O on the {self.kernel} kernel")

    def dtype(self, case):
        torch = self.torch
        return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[case.config.dtype]

    def bias_leaf_mask(self, case, sq, sk):
        """`(mask, leaf, hidden)`: `bias_mask` built in torch from `leaf`, the case's bias tensor
        `[Bb, Hb, Sq', Sk']` in the input dtype with requires_grad (see the header)."""
        torch = self.torch
        dt = self.dtype(case)
        vis, key0, hidden = mask_parts(case, sq, sk)
        leaf = torch.from_numpy(np.ascontiguousarray(case.bias)).to(self.dev).to(dt).requires_grad_(True)
        full = leaf[:, :, :sq, :sk].expand(case.sq.slots, case.config.num_heads, sq, sk)
        on = lambda x: torch.from_numpy(x).to(self.dev)  # noqa: E731
        m = torch.where(on(vis), full, torch.full((), -np.inf, dtype=dt, device=self.dev))
        m = torch.where(on(key0), torch.zeros((), dtype=dt, device=self.dev), m)
        return m, leaf, hidden

    def call(self, case, q, k, v, d_o, mask, is_causal, want, leaf=None):
        """One SDPA call on padded [B, S, H, D] numpy arrays; returns numpy [B, S, ...]. `mask`
        is numpy or, with `leaf` (the bias whose gradient is dbias), a torch tensor."""
        torch = self.torch
        dt = self.dtype(case)
        c = case.config
        grads = bool(want & {"dq", "dk", "dv", "dbias"})
        need_graph = grads or ("lse" in want and self.kernel != "math")
        tq, tk, tv = (self.tensor(x, dt, need_graph).transpose(1, 2) for x in (q, k, v))
        m = torch.from_numpy(mask).to(self.dev) if isinstance(mask, np.ndarray) else mask
        if m is not None and m.dtype != torch.bool and not (self.kernel == "math" and m.dtype == torch.float32):
            m = m.to(dt)  # the fused kernels take a float mask in the query's dtype (see the header)
        res = {}
        with kit.calling(f"torch {self.kernel}"):
            with self.pinned():
                out = torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, attn_mask=m, is_causal=is_causal, scale=c.scale,
                    enable_gqa=c.num_heads != c.num_kv_heads,
                )
            if "lse" in want and self.kernel != "math":
                res["lse"] = self.lse_of(out).float().cpu().numpy()
            if grads:
                g = self.tensor(d_o, dt, False).transpose(1, 2)
                inputs = (tq, tk, tv) if leaf is None else (tq, tk, tv, leaf)
                got = torch.autograd.grad(out, inputs, g, allow_unused=True)
                res.update({n: t.transpose(1, 2).float().cpu().numpy() for n, t in zip(("dq", "dk", "dv"), got)})
                if leaf is not None:
                    if got[3] is None and m.numel() == 0:
                        # no key in the launch (a split's part of empty key slots): SDPA's
                        # graph never reads the bias, and no entry has a gradient
                        got = got[:3] + (torch.zeros_like(leaf),)
                    if got[3] is None:
                        raise kit.Internal(f"torch {self.kernel} returned no attn_mask gradient: "
                                           "this kernel cannot declare dbias")
                    res["dbias"] = got[3].float().cpu().numpy()
            torch.cuda.synchronize() if self.dev.type == "cuda" else None
        res["o"] = out.detach().transpose(1, 2).float().cpu().numpy()
        return res

    def run(self, case: kit.Case, want: frozenset) -> dict:
        c = case.config
        if case.sq.max_len == 0:
            return kit.no_query_outputs(case)
        if self.kernel == "flash":
            return self.run_groups(case, want)
        sq, sk = case.sq.max_len, case.skv.max_len
        d_o = case.d_o if case.d_o is not None else np.zeros((case.sq.tokens, c.num_heads, c.head_dim_v))
        d_o = kit.to_padded(d_o, case.sq, sq, "zero")
        leaf, hidden = None, None
        if "dbias" in want:
            mask, leaf, hidden = self.bias_leaf_mask(case, sq, sk)
        elif c.bias != "none":
            mask, hidden = bias_mask(case, sq, sk)
            if self.kernel != "math":
                inexact_mask(mask, c.dtype, self.kernel)
        else:
            mask = pad_row_mask(case, sq, sk)
        if hidden is not None:
            b, h, r = np.nonzero(hidden)
            d_o[b, r, h] = 0.0  # a hidden row adds nothing to dK, dV (nor to dBias)
        res = self.call(
            case,
            kit.to_padded(case.q, case.sq, sq),  # pad query rows are real rows to SDPA: no poison
            kit.to_padded(case.k, case.skv, sk, self.pad),
            kit.to_padded(case.v, case.skv, sk, self.pad),
            d_o,
            mask,
            False,
            want,
            leaf,
        )
        if hidden is not None:
            hide_rows(res, hidden)
        return self.unpad(case, res, want)

    def run_groups(self, case, want):
        c = case.config
        b, sq, sk = case.sq.slots, case.sq.max_len, case.skv.max_len
        acc = {
            "o": np.zeros((b, sq, c.num_heads, c.head_dim_v), np.float32),
            "lse": np.full((b, c.num_heads, sq), -np.inf, np.float32),
            "dq": np.zeros((b, sq, c.num_heads, c.head_dim_qk), np.float32),
            "dk": np.zeros((b, sk, c.num_kv_heads, c.head_dim_qk), np.float32),
            "dv": np.zeros((b, sk, c.num_kv_heads, c.head_dim_v), np.float32),
        }
        d_o = case.d_o if case.d_o is not None else np.zeros((case.sq.tokens, c.num_heads, c.head_dim_v))
        for (lq, lk), slots in length_groups(case).items():
            if c.causal == "bottom_right" and lq != lk:
                # SDPA's is_causal is top-left: the GPU kernel refuses Lq != Lk, but the CPU
                # flash kernel runs it top-left, which is another mask than the case's.
                raise kit.Unsupported(f"bottom-right causal with Lq {lq} != Lk {lk}: SDPA's is_causal is top-left")
            pick = lambda x, side, s: kit.to_padded(x, side, s)[slots]  # noqa: E731
            res = self.call(
                case,
                pick(case.q, case.sq, sq)[:, :lq],
                pick(case.k, case.skv, sk)[:, :lk],
                pick(case.v, case.skv, sk)[:, :lk],
                pick(d_o, case.sq, sq)[:, :lq],
                None,
                c.causal is not None,
                want,
            )
            for name, arr in res.items():
                if name == "lse":
                    acc["lse"][slots, :, :lq] = arr[:, :, :lq]
                else:
                    acc[name][slots, : arr.shape[1]] = arr
        return self.unpad(case, acc, want)

    def unpad(self, case, res, want):
        padded = {n: a for n, a in res.items() if n in kit.OUTPUTS and (n in want or n == "o")}
        out = kit.from_padded_outputs(case, padded)
        if "dbias" in res:
            out["dbias"] = res["dbias"]  # the bias tensor's own shape: nothing to unpad
        return out


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__, no_key_lse=None)
    ap.add_argument("--kernel", required=True, choices=["math", "efficient", "flash", "cudnn"])
    ap.add_argument("--carry-poison", action="store_true")
    args = ap.parse_args(argv)
    impl = TorchSdpa(args.kernel, args.carry_poison)
    no_key_lse = args.no_key_lse or NO_KEY_LSE[args.kernel]
    caps = caps_for(args.kernel)
    caps.devices = args.devices
    return kit.Adapter(f"torch-sdpa-{args.kernel}", "torch", caps, impl.run,
                       no_key_lse=no_key_lse, setup=impl.setup)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter()))
