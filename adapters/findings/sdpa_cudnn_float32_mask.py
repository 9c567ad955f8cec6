#!/usr/bin/env python3
"""Standalone (torch and numpy only): does SDPA's cuDNN kernel apply a float32 attn_mask given
with 16-bit q, k and v?

bench/probe_sdpa_mask_dtype.py (H100, torch 2.11, 2026-12-06) saw the cuDNN kernel accept an
f32 additive mask beside bf16/f16 q, k, v, where the efficient kernel refuses it ("invalid
dtype for bias - should match query's dtype") and the flash kernel takes no mask at all, and
saw its O differ by 3.6 from the same call with the mask rounded to the dtype, for a mask
whose rounding moves no entry by more than 1e-3. A kernel that accepts an input must apply it
(semantics §1.3: the bias is added to every score before the softmax).

Each mask variant runs through the cuDNN kernel and is judged against a float64 reference of
the same mask (inputs exact in the dtype): an f32 mask, contiguous and broadcast (stride 0),
and the mask rounded to the dtype, contiguous and broadcast. The rounded-mask calls show what
the kernel's own error is; an f32 call far beyond it, where the rounded one is close, means
the f32 mask is not applied as given.

    python3 sdpa_cudnn_float32_mask.py [--dtype bf16|f16] [--kernel cudnn|math|efficient]

Exits 1 if an accepted mask gives O off the reference by more than 20 times the
rounded-contiguous call's error plus 1e-2 (the finding reproduces), 0 if every accepted mask
is applied, 2 if the kernel runs no variant (no GPU, or the kernel refuses them all). Without
a GPU, `--kernel math` runs on the CPU: a check of the script itself.
"""

import argparse
import sys

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, SQ, SK, D = 2, 4, 16, 16, 64
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def reference(q, k, v, bias, scale):
    """float64 O of softmax(q·kᵀ·scale + bias)·v over [B, H, SQ, D]."""
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale + bias
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--kernel", default="cudnn", choices=sorted(BACKENDS))
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and args.kernel != "math":
        print(f"{args.kernel}: needs a GPU")
        return 2
    rng = np.random.default_rng(3)
    exact = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(dtype).double().numpy()  # noqa: E731
    q, k, v = exact(B, H, SQ, D), exact(B, H, SK, D), exact(B, H, SK, D)
    scale = 1.0 / np.sqrt(D)
    # An ALiBi-like bias per head (slopes 2^-1..2^-4 times the key distance): not exact in
    # either 16-bit type, and large enough to move the softmax.
    slopes = 2.0 ** -np.arange(1, H + 1)
    dist = np.abs(np.arange(SQ)[:, None] - np.arange(SK)[None, :])
    bias32 = (-slopes[:, None, None] * dist[None] * 1.37).astype(np.float32)  # [H, SQ, SK]
    bias_rounded = torch.from_numpy(bias32).to(dtype).double().numpy()
    t = lambda x: torch.from_numpy(x).to(dev, dtype)  # noqa: E731
    tq, tk, tv = t(q), t(k), t(v)
    full32 = torch.from_numpy(np.broadcast_to(bias32, (B, H, SQ, SK)).copy()).to(dev)
    variants = {
        "rounded, contiguous": (full32.to(dtype).contiguous(), bias_rounded),
        "rounded, broadcast": (full32[:1].to(dtype).expand(B, H, SQ, SK), bias_rounded),
        "float32, contiguous": (full32.contiguous(), bias32.astype(np.float64)),
        "float32, broadcast": (full32[:1].expand(B, H, SQ, SK), bias32.astype(np.float64)),
    }
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {where}, "
          f"{args.kernel}, {args.dtype}, B {B} H {H} Sq {SQ} Sk {SK} d {D}")
    errors = {}
    for name, (mask, bias) in variants.items():
        try:
            with sdpa_kernel([BACKENDS[args.kernel]]):
                o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"{name}: refused: {str(e).splitlines()[0][:160]}")
            continue
        err = float(np.max(np.abs(o.double().cpu().numpy() - reference(q, k, v, bias, scale))))
        errors[name] = err
        print(f"{name}: max |O - float64 reference| {err:.4g}")
    if not errors:
        return 2
    base = errors.get("rounded, contiguous", min(errors.values()))
    bad = [n for n, e in errors.items() if e > 20 * base + 1e-2]
    if bad:
        print(f"REPRODUCED: {args.kernel} accepts the mask but does not apply it as given: "
              + ", ".join(f"{n} ({errors[n]:.3g})" for n in bad))
        return 1
    print(f"not reproduced: every mask {args.kernel} accepted is applied (errors within 20x of {base:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
