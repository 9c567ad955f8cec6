# Times the PyTorch peers on the workloads of `smallseq bench` (same lengths: splitmix64 seed 1)
# and prints ratios against the kernels' figures from bench.json (SMALLSEQ_BENCH_OUT / argv[1]).
# Usage on the GPU machine: python3 bench/peers.py $OUT/bench.json   (writes $OUT/peers.json)
import json, os, sys
import torch
import triton.testing as tt

dev = "cuda"
M64 = (1 << 64) - 1

class Rng:
    def __init__(self, seed): self.s = seed
    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    def range(self, lo, hi): return lo + self.next() % (hi - lo + 1)

WORKLOADS = [  # as workloads() in src/cli/bench.rs
    ("fix16_h16_d128_B4096", 4096, (16, 16), (16, 16), 16, 128),
    ("rnd1-17_h16_d128_B8192", 8192, (1, 17), (1, 17), 16, 128),
    ("rnd1-17_h32_d256_B4096", 4096, (1, 17), (1, 17), 32, 256),
    ("q1_kv2-16_h16_d128_B32768", 32768, (1, 1), (2, 16), 16, 128),
    ("fix512_h16_d128_B64", 64, (512, 512), (512, 512), 16, 128),
]

def bench(fn): return tt.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3  # us

def main():
    ours = {}
    if len(sys.argv) > 1 and os.path.exists(sys.argv[1]):
        for f in json.load(open(sys.argv[1])):
            ours[(f["workload"], f["kernel"])] = f["us"]
    res = []
    print(f"{'workload':28} {'peer':28} {'us':>10}")
    for name, B, ql, kl, h, d in WORKLOADS:
        r = Rng(1)
        lens = [(r.range(*ql), r.range(*kl)) for _ in range(B)]
        lq = torch.tensor([a for a, _ in lens], dtype=torch.int32)
        lk = torch.tensor([b for _, b in lens], dtype=torch.int32)
        cq = torch.zeros(B + 1, dtype=torch.int32); cq[1:] = torch.cumsum(lq, 0)
        ck = torch.zeros(B + 1, dtype=torch.int32); ck[1:] = torch.cumsum(lk, 0)
        cq, ck = cq.to(dev), ck.to(dev)
        tq, tk, mq, mk = int(lq.sum()), int(lk.sum()), int(lq.max()), int(lk.max())
        q = torch.randn(tq, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(tk, h, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(tk, h, d, device=dev, dtype=torch.bfloat16)
        peers = {}
        try:
            f = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, False, False)
            o, lse, ps, po, _ = f()
            peers["flash_varlen_fwd"] = bench(f)
            do = torch.randn_like(o)
            b = lambda: torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, False, ps, po)
            b()
            peers["flash_varlen_bwd"] = bench(b)
        except Exception as e:
            print(name, "flash ERR", repr(e)[:120])
        try:
            f = lambda: torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cq, ck, mq, mk, 0.0, 0, True)
            f()
            peers["mem_efficient_varlen_fwd"] = bench(f)
        except Exception as e:
            print(name, "mem-efficient ERR", repr(e)[:120])
        for p, us in peers.items():
            print(f"{name:28} {p:28} {us:10.1f}")
            res.append(dict(workload=name, peer=p, us=us))
        fwd_peers = [us for p, us in peers.items() if p.endswith("_fwd") and "bwd" not in p]
        best_fwd = min(fwd_peers) if fwd_peers else None
        for kern, peer in (("small_seq_fwd", best_fwd), ("fallback_fwd", peers.get("flash_varlen_fwd")),
                           ("small_seq_bwd", peers.get("flash_varlen_bwd")), ("fallback_bwd", peers.get("flash_varlen_bwd"))):
            if (name, kern) in ours and peer:
                print(f"{name:28} ratio peer/{kern:18} {peer / ours[(name, kern)]:8.2f}x")
        del q, k, v
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp")
    json.dump(res, open(os.path.join(out, "peers.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
