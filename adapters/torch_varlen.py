#!/usr/bin/env python3
"""torch_varlen: `torch.nn.attention.varlen.varlen_attn` (packed THD with cu_seqlens).

    python3 adapters/torch_varlen.py [--kernel flash|cudnn] [--tail trim|pass]
                                     [--no-key-lse -inf|+inf|nan]

- Pinned to one kernel with `sdpa_kernel([FLASH_ATTENTION])` (or CUDNN): varlen_attn picks
  cuDNN or flash by `max_q` otherwise (external-apis.md §1.1). Without `varlen_attn`
  (torch < 2.9) the adapter calls `aten._flash_attention_forward` and its backward itself.
- Masks: the case's mask and window become FA2's `window_size` (bottom-right aligned, like
  semantics §1): causal bottom-right = right bound 0. Top-left causal equals it only when
  every slot has Lq == Lk; other top-left cases are `unsupported`.
- LSE: `return_aux=AuxRequest(lse=True)`; its layout is read off its shape (`[H, T]` on
  CUDA, `[T, H]`, or `[B, H, max_q]` on ROCm). FA kernels write +inf for rows with no key
  (external-apis.md §1.4), so `--no-key-lse` defaults to +inf on flash; cuDNN documents no
  value, so on cudnn it is measured at start (`probe`, recorded in the handshake).
- Backward: autograd through varlen_attn's registered backward.
- Cases with no query token at all are answered without a launch (all outputs zero).
- Determinism (flash declares dq nondeterministic, `caps.nondeterministic`): torch's flash
  backward passes `deterministic = false` to FA2's `mha_varlen_bwd` unless
  `torch.use_deterministic_algorithms(True)` is set, and warns under `warn_only=True` that
  "Flash Attention defaults to a non-deterministic algorithm"
  (aten/src/ATen/native/transformers/cuda/attention_backward.cu). FA2's backward then adds
  each key block's dQ into an f32 accumulator with atomics, in run order; dK and dV belong
  to the block of their keys and stay bitwise. An H200 campaign saw 2 determinism failures
  (adapters/FINDINGS.md). We do not set the deterministic mode: frameworks call it as is.
- Don't-care tokens: varlen_attn has no padded offsets, so `padded_offsets` is false (the
  campaign sends no gaps between slots). Tail slack past `cu_seqlens[-1]`: `--tail trim`
  (default) slices it off before the call, as external-apis.md advises, and writes 0 /
  -inf there; `--tail pass` hands the whole buffer to varlen_attn (it then writes whatever
  it writes there), which reaches the NaN-gradient defect of pytorch/pytorch#176793.

Cannot express: dropout, bias, f32, head_dim_v != head_dim_qk, gaps between slots,
top-left causal with Lq != Lk, GQA unless this torch has `enable_gqa` (2.12).
"""

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import smallseq_adapter as kit  # noqa: E402

HEAD_DIMS = [16, 32, 64, 128, 192, 256]


def window_size(case: kit.Case):
    """FA2 `(left, right)` for the case, bottom-right aligned; raises Unsupported for a
    top-left causal mask that differs from bottom-right on some slot."""
    left, right = case.config.window
    if case.config.causal is not None:
        if case.config.causal == "top_left":
            both = (case.sq.lens > 0) & (case.skv.lens > 0)
            if np.any(case.sq.lens[both] != case.skv.lens[both]):
                raise kit.Unsupported("top-left causal with Lq != Lk: varlen_attn's causal is bottom-right")
        right = 0 if right < 0 else min(right, 0)
    return int(left), int(right)


def lse_layout(shape, heads: int, tokens: int) -> str:
    """Which of the kit's LSE layouts a varlen LSE of `shape` is."""
    shape = tuple(d for d in shape if d != 1) if len(shape) > 2 else tuple(shape)
    if len(shape) == 3:
        return "bhs"
    if shape == (heads, tokens):
        return "ht"
    if shape == (tokens, heads):
        return "th"
    raise kit.Internal(f"varlen LSE of shape {list(shape)} for {heads} heads and {tokens} tokens")


class TorchVarlen:
    def __init__(self, kernel: str, tail: str):
        self.kernel, self.tail = kernel, tail

    def setup(self, adapter: kit.Adapter):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch = torch
        backend = SDPBackend.FLASH_ATTENTION if self.kernel == "flash" else SDPBackend.CUDNN_ATTENTION
        self.pinned = lambda: sdpa_kernel([backend])
        try:
            from torch.nn.attention.varlen import AuxRequest, varlen_attn

            self.varlen, self.aux = varlen_attn, AuxRequest
            params = inspect.signature(varlen_attn).parameters
            adapter.caps.gqa = "enable_gqa" in params
            self.has_gqa = adapter.caps.gqa
            api = "torch.nn.attention.varlen.varlen_attn"
        except ImportError:
            if self.kernel != "flash":
                raise SystemExit("torch_varlen: this torch has no varlen_attn; only --kernel flash works")
            self.varlen, self.has_gqa = None, True
            adapter.caps.gqa = True
            api = "aten._flash_attention_forward"
        adapter.version = f"torch {torch.__version__}"
        adapter.provenance.update(
            {
                "api": api,
                "kernel": self.kernel,
                "tail": self.tail,
                "device": torch.cuda.get_device_name(0),
                "cuda": str(torch.version.cuda),
                "cudnn": str(torch.backends.cudnn.version()),
            }
        )
        adapter.caps.arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0))

    def run(self, case: kit.Case, want: frozenset) -> dict:
        # A launch without a query token has nothing to compute, and varlen_attn refuses its
        # empty q ("Input tensor must have contiguous last dimension": H100, seed 67, group 85,
        # the second launch of a batch split whose slot 1 has no query).
        if case.sq.max_len == 0:
            return kit.no_query_outputs(case)
        torch = self.torch
        c = case.config
        left, right = window_size(case)
        dt = {"bf16": torch.bfloat16, "f16": torch.float16}[c.dtype]
        grads = bool(want & {"dq", "dk", "dv"})
        trim = self.tail == "trim"
        nq, nk = (int(case.sq.cu[-1]), int(case.skv.cu[-1])) if trim else (case.sq.tokens, case.skv.tokens)

        def dev(x, n, grad=False):
            return torch.from_numpy(np.ascontiguousarray(x[:n])).cuda().to(dt).requires_grad_(grad)

        q, k, v = dev(case.q, nq, grads), dev(case.k, nk, grads), dev(case.v, nk, grads)
        cu_q = torch.from_numpy(kit.packed_cu(case.sq)).cuda()
        cu_k = torch.from_numpy(kit.packed_cu(case.skv)).cuda()
        mq, mk = max(case.sq.max_len, 1), max(case.skv.max_len, 1)
        with kit.calling(f"torch varlen {self.kernel}"):
            with self.pinned():
                if self.varlen is not None:
                    kw = {"return_aux": self.aux(lse=True), "scale": c.scale, "window_size": (left, right)}
                    if self.has_gqa and c.num_heads != c.num_kv_heads:
                        kw["enable_gqa"] = True
                    out, lse = self.varlen(q, k, v, cu_q, cu_k, mq, mk, **kw)
                else:
                    out, lse = flash_forward(torch, q, k, v, cu_q, cu_k, mq, mk, c.scale, left, right)
            res = {"o": out.detach().float().cpu().numpy(), "lse": lse.detach().float().cpu().numpy()}
            if grads:
                g = dev(case.d_o, nq)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
                res.update({"dq": dq.float().cpu().numpy(), "dk": dk.float().cpu().numpy(), "dv": dv.float().cpu().numpy()})
            torch.cuda.synchronize()
        return self.back_to_thd(case, res, want)

    def back_to_thd(self, case, res, want):
        """Rows past cu_seqlens[-1] are outside varlen_attn's contract (it allocates O and LSE
        uninitialised there): they are written 0 (LSE -inf) in both --tail modes, which differ
        only in what the kernel reads."""
        out = {}
        for name, side in (("o", case.sq), ("dq", case.sq), ("dk", case.skv), ("dv", case.skv)):
            if name in res:
                arr = res[name][: int(side.cu[-1])]
                out[name] = kit.unpack(arr, side)
        if "lse" in want:
            rows = res["o"].shape[0]
            layout = lse_layout(res["lse"].shape, case.config.num_heads, rows)
            out["lse"] = kit.lse_to_thd(res["lse"], case.sq, layout, packed=rows < case.sq.tokens)
        return out


def flash_forward(torch, q, k, v, cu_q, cu_k, mq, mk, scale, left, right):
    """varlen flash for a torch without varlen_attn: the aten op, with autograd by hand."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, mq, mk, 0.0, False, False, scale=scale,
                window_size_left=left, window_size_right=right,
            )
            ctx.save_for_backward(q, k, v, out, lse, seed, offset)
            return out, lse

        @staticmethod
        def backward(ctx, g, _):
            q, k, v, out, lse, seed, offset = ctx.saved_tensors
            return torch.ops.aten._flash_attention_backward(
                g, q, k, v, out, lse, cu_q, cu_k, mq, mk, 0.0, False, seed, offset, scale=scale,
                window_size_left=left, window_size_right=right,
            )

    return Fn.apply(q, k, v)


def adapter(argv=None) -> kit.Adapter:
    ap = kit.arg_parser(__doc__, no_key_lse=None)
    ap.add_argument("--kernel", default="flash", choices=["flash", "cudnn"])
    ap.add_argument("--tail", default="trim", choices=["trim", "pass"])
    args = ap.parse_args(argv)
    no_key_lse = args.no_key_lse or ("+inf" if args.kernel == "flash" else kit.PROBE)
    impl = TorchVarlen(args.kernel, args.tail)
    caps = kit.Caps(
        dtypes=["bf16", "f16"], masks=list(kit.MASKS), window=args.kernel == "flash",
        head_dims=HEAD_DIMS, max_tokens=1 << 20, backward=True, lse=True,
    )
    caps.devices = args.devices
    if args.kernel == "flash":
        # FA2's dQ is summed over key blocks with atomics (see the header); dK, dV stay bitwise.
        caps.nondeterministic = ("dq",)
        caps.nondeterministic_note = "dq summed over key blocks with atomics (FA2, deterministic=false)"
    return kit.Adapter(f"torch-varlen-{args.kernel}", "torch", caps, impl.run,
                       no_key_lse=no_key_lse, setup=impl.setup)


if __name__ == "__main__":
    sys.exit(kit.serve(adapter()))
