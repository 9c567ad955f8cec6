#!/usr/bin/env python3
"""Standalone (torch and numpy only): do query rows that see no key add to dK and dV, and is
their O zero?

FINDINGS.md item 4. One sequence of 40 queries and 33 keys under a bottom-right causal mask
(row i sees keys j <= i - 7), so rows 0-6 see no key at all. By the semantics of masked
attention (and TransformerEngine's), such a row has P = 0: its O is 0 and, whatever its dO,
it adds nothing to dK or dV. Each SDPA kernel that takes a boolean mask runs twice: with a
random dO on every row, and with dO zeroed on rows 0-6. Both must give the same dK and dV
(and both must match a float64 reference). A kernel whose dK/dV differ between the two runs
lets rows without keys contribute to the gradients. Their O must be 0 (semantics §1, and what
PyTorch's math kernel returns); the seed 29 campaign's ten cuDNN defect groups (H100,
2026-12-06) all have such rows, and their largest O errors sit there (1.5 where |V| is 2).

    python3 sdpa_no_key_rows_backward.py [--dtype bf16|f16] [--kernels cudnn,efficient,math]

Prints one line per kernel and run; exits 1 if a kernel's no-key rows contribute or hold a
nonzero O (the finding reproduces), 0 if none does, 2 if no kernel could run. Without a GPU
only the math kernel runs (on the CPU), a check of the script itself.
"""

import argparse
import sys

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SQ, SK, D = 40, 33, 32
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def visible():
    """[SQ, SK] bool: row i sees key j when j <= i - (SQ - SK) (bottom-right causal)."""
    i = np.arange(SQ)[:, None]
    j = np.arange(SK)[None, :]
    return j <= i - (SQ - SK)


def reference(q, k, v, d_o, scale, vis):
    """float64 forward and backward of masked attention; rows without keys have P = 0."""
    s = (q @ k.T) * scale
    s = np.where(vis, s, -np.inf)
    m = np.max(s, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(vis, np.exp(s - m), 0.0)
    z = e.sum(axis=1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    dv = p.T @ d_o
    dp = d_o @ v.T
    ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    dk = ds.T @ q * scale
    return dk, dv


def run(kernel, dtype, q, k, v, d_o, scale, vis):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = lambda x, g: torch.from_numpy(x).to(dev, dtype).reshape(1, 1, *x.shape).requires_grad_(g)  # noqa: E731
    tq, tk, tv = t(q, True), t(k, True), t(v, True)
    mask = torch.from_numpy(vis).to(dev).reshape(1, 1, SQ, SK)
    with sdpa_kernel([BACKENDS[kernel]]):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale)
    dk, dv = torch.autograd.grad(out, (tk, tv), t(d_o, False))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (dk[0, 0].double().cpu().numpy(), dv[0, 0].double().cpu().numpy(),
            out[0, 0].detach().double().cpu().numpy())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--kernels", default="cudnn,efficient,math")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    rng = np.random.default_rng(8)
    # Inputs exactly representable in the dtype, so every kernel and the reference see the same.
    x = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(dtype).double().numpy()  # noqa: E731
    q, k, v, d_o = x(SQ, D), x(SK, D), x(SK, D), x(SQ, D)
    scale = 1.0 / np.sqrt(D)
    vis = visible()
    no_key = ~vis.any(axis=1)
    d_o_zeroed = np.where(no_key[:, None], 0.0, d_o)
    ref_dk, ref_dv = reference(q, k, v, d_o, scale, vis)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{where}, {args.dtype}, Sq {SQ}, Sk {SK}, d {D}, "
          f"rows without keys: {int(no_key.sum())}")
    contributes, nonzero_o, ran = [], [], 0
    for kernel in args.kernels.split(","):
        try:
            a = run(kernel, dtype, q, k, v, d_o, scale, vis)
            again = run(kernel, dtype, q, k, v, d_o, scale, vis)
            b = run(kernel, dtype, q, k, v, d_o_zeroed, scale, vis)
        except RuntimeError as e:
            print(f"{kernel}: did not run: {str(e).splitlines()[0]}")
            continue
        ran += 1
        for name, got, want in (("dk", a[0], ref_dk), ("dv", a[1], ref_dv)):
            print(f"{kernel} {name}: max |error| vs float64 {np.max(np.abs(got - want)):.4g} "
                  f"(|ref| max {np.max(np.abs(want)):.4g})")
        o_no_key = float(np.max(np.abs(a[2][no_key])))
        print(f"{kernel}: O on the rows without keys: max |O| {o_no_key:.4g} (must be 0)")
        if o_no_key > 0:
            nonzero_o.append(kernel)
        change = lambda x, y: max(np.max(np.abs(x[0] - y[0])), np.max(np.abs(x[1] - y[1])))  # noqa: E731
        diff, noise = change(a, b), change(a, again)
        print(f"{kernel}: dK/dV change by {diff:.4g} when dO is zeroed on the rows without keys "
              f"(a rerun of the same call changes them by {noise:.4g})")
        # A rerun's own spread (atomics) is not the finding; 1e-3 of the gradient's scale is.
        if diff > max(10 * noise, 1e-3 * max(np.max(np.abs(ref_dk)), np.max(np.abs(ref_dv)))):
            contributes.append(kernel)
    if ran == 0:
        return 2
    if contributes:
        print("REPRODUCED: rows without keys contribute to dK/dV on " + ", ".join(contributes))
    if nonzero_o:
        print("REPRODUCED: rows without keys hold a nonzero O on " + ", ".join(nonzero_o))
    if not (contributes or nonzero_o):
        print("not reproduced: no kernel's rows without keys contribute or hold a nonzero O")
    return 1 if contributes or nonzero_o else 0


if __name__ == "__main__":
    sys.exit(main())
