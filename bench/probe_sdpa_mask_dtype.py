"""Which SDPA kernels take a float attn_mask in f32 with 16-bit q, k, v (adapters/torch_sdpa.py
refuses a mask its fused kernels would round; this checks the premise on a GPU). One line per
kernel and dtype: `accepted` (and the largest difference of O against the same call with the
mask rounded to the dtype, 0 when the kernel rounds it itself) or the error's first line.
    python3 bench/probe_sdpa_mask_dtype.py
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 16, 64, device="cuda", dtype=dt, generator=g) for _ in range(3))
        # An ALiBi-like bias: not exact in either 16-bit type.
        mask = -0.0123 * torch.arange(16, device="cuda", dtype=torch.float32).view(1, 1, 1, 16).expand(2, 4, 16, 16)
        for name, kernel in KERNELS.items():
            try:
                with sdpa_kernel([kernel]):
                    o32 = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    o16 = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(dt))
                torch.cuda.synchronize()
                diff = (o32.float() - o16.float()).abs().max().item()
                print(f"{name} {dt}: accepted; O differs from the dtype-rounded mask's by {diff:.3e}")
            except Exception as e:  # each kernel's refusal is what this probe reports
                print(f"{name} {dt}: refused: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
