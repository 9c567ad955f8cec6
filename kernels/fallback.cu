// Fallback attention (semantics.md §1, every input): any lengths, GQA/MQA, every mask and
// window, bf16/f16/f32, Dqk != Dv allowed (each <= FB_MAXD).
//
// One warp (wavefront) per (query token, head) for the forward and for dQ, one per (key token,
// kv head) for dK/dV: the kv-head-major kernel loops over the query heads of its group and over
// the query rows of its slot in a fixed order, so GQA gradients are summed deterministically
// without atomics. Work items are decoded from a 1-D grid over tokens; tokens outside every
// slot are skipped (never read, never written). Lanes take keys (or query rows) in groups of
// PT_WARP for the dot products, then broadcast the probabilities to lanes that own output dims.
//
// Numerics follow the small-seq kernels: f32 accumulation, the score s = fl(dot · scale) rounded
// once (pt_mul_rn: an FMA of dot · scale - lse would differ from the forward's rounded s by up to
// half an ulp of s, which on large scores turns a one-key row's P = 1 into 1 - 1e-5 and its exactly
// zero gradients into O(dP · 1e-5)), P = exp(s - m) / l rounded to the input type before P·V,
// outputs rounded at store. The backward keeps P and dS in f32: a scalar kernel has no 16-bit
// operand to round them for, and dS rounded to f16 overflowed to inf on large inputs whose f32
// dS and gradients are finite.
//
// The backward renormalises the recomputed P: P = exp(s - lse) / Z with Z = Σ exp(s - lse) over
// the row (the query-side kernel stores Z beside D). With the forward's own LSE, Z = 1 to
// rounding; with an LSE from another kernel (the small-seq forward sums its dot products in
// another order) Z absorbs the mismatch, so a one-key row still gets P = 1 and dS = 0 exactly, and
// D = Σ P·dP is formed from the same P as dS.
#include "portable.h"

#define FB_WPB 4
#define FB_MAXD 512
#define FB_NJ (FB_MAXD / PT_WARP)

struct FbRow {
  int slot, r, lq, lk;
  long long oq, ok;
};

// The slot holding token t (offsets non-decreasing; the last slot starting at or before t).
PT_INLINE bool fb_find(FbRow& f, long long t, const int* cu, const int* off, const int* cu_o,
                       const int* off_o, int b) {
  int lo = 0, hi = b;  // first index in [0, b) with off[i] > t
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if ((long long)off[mid] <= t) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return false;
  int i = lo - 1;
  int len = cu[i + 1] - cu[i];
  long long r = t - off[i];
  if (r >= len) return false;
  f.slot = i;
  f.r = (int)r;
  f.lq = len;
  f.lk = cu_o[i + 1] - cu_o[i];
  f.oq = off[i];
  f.ok = off_o[i];
  return true;
}

// Keys visible to row r: [lo, hi] (empty when lo > hi).
PT_INLINE void fb_range(int r, int lq, int lk, int mask, int wl, int wr, int& lo, int& hi) {
  lo = 0;
  hi = lk - 1;
  const int diag = r + (lk - lq);
  if (mask == 1 && r < hi) hi = r;
  if (mask == 2 && diag < hi) hi = diag;
  if (wl >= 0 && diag - wl > lo) lo = diag - wl;
  if (wr >= 0 && diag + wr < hi) hi = diag + wr;
}

// x + y·z. 16-bit products are exact in f32, so an FMA changes nothing there; f32 products are
// rounded before the add, as the emulation (the yardstick of the tolerance) rounds them: fused,
// the f32 scores and o drifted 5x the emulation's error from the f64 value (fuzz seed 7, case 846).
template <class E>
PT_INLINE float fb_madd(float x, float y, float z) {
  return E::IS16 ? x + y * z : x + pt_mul_rn(y, z);
}

template <class E>
PT_INLINE float fb_dot(const float* xs, const typename E::T* y, int d) {
  float acc = 0.f;
  for (int i = 0; i < d; ++i) acc = fb_madd<E>(acc, xs[i], E::load(y, i));
  return acc;
}

template <class E>
PT_INLINE void fb_to_smem(float* xs, const typename E::T* x, int d) {
  for (int i = pt_lane(); i < d; i += PT_WARP) xs[i] = E::load(x, i);
}

// Forward: o, lse for every valid query token.
template <class E, class O>
PT_INLINE void fb_fwd(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                      typename O::T* o, float* lse, const int* cu_q, const int* cu_kv,
                      const int* off_q, const int* off_kv, int b, int H, int Hkv, int Dqk,
                      int Dv, long long tq, float scale, int mask, int wl, int wr, float* smem) {
  const int w = pt_tid() / PT_WARP, lane = pt_lane();
  long long item = pt_bid() * FB_WPB + w;
  if (item >= tq * H) return;
  const long long t = item / H;
  const int h = (int)(item % H), hk = h / (H / Hkv);
  FbRow f;
  if (!fb_find(f, t, cu_q, off_q, cu_kv, off_kv, b)) return;
  int lo, hi;
  fb_range(f.r, f.lq, f.lk, mask, wl, wr, lo, hi);
  float* qs = smem + w * Dqk;
  fb_to_smem<E>(qs, q + (t * H + h) * Dqk, Dqk);
  pt_syncwarp();
  const float ninf = -pt_inf();
  // Pass 1: per-lane online max/sum, then combined.
  float m = ninf, l = 0.f;
  for (int c0 = lo; c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi) {
      float s = pt_mul_rn(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk), scale);
      if (s > m) {
        l = l * pt_exp(m - s) + 1.f;
        m = s;
      } else {
        l += pt_exp(s - m);
      }
    }
  }
  const float M = pt_warp_max(m);
  const float L = pt_warp_sum(m == ninf ? 0.f : l * pt_exp(m - M));
  float acc[FB_NJ];
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) acc[j] = 0.f;
  for (int c0 = lo; c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    float p = 0.f;
    if (c <= hi) {
      float s = pt_mul_rn(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk), scale);
      p = E::round(pt_exp(s - M) / L);
    }
    int n = hi - c0 + 1 < PT_WARP ? hi - c0 + 1 : PT_WARP;
    for (int cc = 0; cc < n; ++cc) {
      float pc = pt_shfl(p, cc);
      const typename E::T* vr = v + ((f.ok + c0 + cc) * Hkv + hk) * Dv;
#pragma unroll
      for (int j = 0; j < FB_NJ; ++j) {
        int d = lane + j * PT_WARP;
        if (d < Dv) acc[j] = fb_madd<E>(acc[j], pc, E::load(vr, d));
      }
    }
  }
  typename O::T* orow = o + (t * H + h) * Dv;
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
    if (d < Dv) O::store(orow, d, E::round(acc[j]));
  }
  if (lane == 0) lse[t * H + h] = lo <= hi ? M + pt_log(L) : ninf;
}

// Backward, query side: Z = Σ exp(s - lse) and delta = Σ P·dP (workspace) and dq for every
// valid query token.
template <class E, class O>
PT_INLINE void fb_bwd_q(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                        const typename E::T* d_o, const float* lse, float* delta, float* rowsum,
                        typename O::T* dq, const int* cu_q, const int* cu_kv, const int* off_q,
                        const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tq,
                        float scale, int mask, int wl, int wr, float* smem) {
  const int w = pt_tid() / PT_WARP, lane = pt_lane();
  long long item = pt_bid() * FB_WPB + w;
  if (item >= tq * H) return;
  const long long t = item / H;
  const int h = (int)(item % H), hk = h / (H / Hkv);
  FbRow f;
  if (!fb_find(f, t, cu_q, off_q, cu_kv, off_kv, b)) return;
  int lo, hi;
  fb_range(f.r, f.lq, f.lk, mask, wl, wr, lo, hi);
  float* qs = smem + w * (Dqk + Dv);
  float* ds = qs + Dqk;
  fb_to_smem<E>(qs, q + (t * H + h) * Dqk, Dqk);
  fb_to_smem<E>(ds, d_o + (t * H + h) * Dv, Dv);
  pt_syncwarp();
  const float ninf = -pt_inf();
  const float lr = lse[t * H + h];
  const bool live = lr != ninf;
  float zsum = 0.f;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi)
      zsum += pt_exp(pt_mul_rn(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk), scale) - lr);
  }
  const float Z = pt_warp_sum(zsum);
  // D in f64: every dS = P (dP - D) of a peaked row cancels against it, so its f32 rounding
  // error, amplified, was the whole dK error of such rows (fuzz seed 7, cases 1966, 3539).
  double dsum = 0.0;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi) {
      long long kr = (f.ok + c) * Hkv + hk;
      float e = pt_exp(pt_mul_rn(fb_dot<E>(qs, k + kr * Dqk, Dqk), scale) - lr);
      float p = Z > 0.f ? e / Z : 0.f;
      dsum += (double)p * (double)fb_dot<E>(ds, v + kr * Dv, Dv);
    }
  }
  const float D = (float)pt_warp_sum_d(dsum);
  if (lane == 0) {
    delta[t * H + h] = D;
    rowsum[t * H + h] = Z;
  }
  float acc[FB_NJ];
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) acc[j] = 0.f;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    float dsv = 0.f;
    if (c <= hi) {
      long long kr = (f.ok + c) * Hkv + hk;
      float e = pt_exp(pt_mul_rn(fb_dot<E>(qs, k + kr * Dqk, Dqk), scale) - lr);
      float p = Z > 0.f ? e / Z : 0.f;
      float dpv = fb_dot<E>(ds, v + kr * Dv, Dv);
      dsv = p * (dpv - D);
    }
    int n = hi - c0 + 1 < PT_WARP ? hi - c0 + 1 : PT_WARP;
    for (int cc = 0; cc < n; ++cc) {
      float x = pt_shfl(dsv, cc);
      const typename E::T* kr = k + ((f.ok + c0 + cc) * Hkv + hk) * Dqk;
#pragma unroll
      for (int j = 0; j < FB_NJ; ++j) {
        int d = lane + j * PT_WARP;
        if (d < Dqk) acc[j] += x * E::load(kr, d);
      }
    }
  }
  typename O::T* out = dq + (t * H + h) * Dqk;
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
    if (d < Dqk) O::store(out, d, E::round(acc[j] * scale));
  }
}

// Backward, key side: dk, dv for every valid key token and kv head, summed over the group.
template <class E, class O>
PT_INLINE void fb_bwd_kv(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                         const typename E::T* d_o, const float* lse, const float* delta,
                         const float* rowsum, typename O::T* dk, typename O::T* dv, const int* cu_q,
                         const int* cu_kv, const int* off_q, const int* off_kv, int b, int H,
                         int Hkv, int Dqk, int Dv, long long tk, float scale, int mask, int wl,
                         int wr, float* smem) {
  const int w = pt_tid() / PT_WARP, lane = pt_lane();
  long long item = pt_bid() * FB_WPB + w;
  if (item >= tk * Hkv) return;
  const long long t = item / Hkv;
  const int hk = (int)(item % Hkv), g = H / Hkv;
  FbRow f;  // here: r = key index c, lq = Lk, lk = Lq (roles swapped by the search)
  if (!fb_find(f, t, cu_kv, off_kv, cu_q, off_q, b)) return;
  const int c = f.r, lk = f.lq, lq = f.lk;
  const long long oq = f.ok;
  float* ks = smem + w * (Dqk + Dv);
  float* vs = ks + Dqk;
  fb_to_smem<E>(ks, k + (t * Hkv + hk) * Dqk, Dqk);
  fb_to_smem<E>(vs, v + (t * Hkv + hk) * Dv, Dv);
  pt_syncwarp();
  const float ninf = -pt_inf();
  float ak[FB_NJ], av[FB_NJ];
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) ak[j] = av[j] = 0.f;
  for (int hh = 0; hh < g; ++hh) {
    const int h = hk * g + hh;
    for (int r0 = 0; r0 < lq; r0 += PT_WARP) {
      int r = r0 + lane;
      float dsv = 0.f, pr = 0.f;
      if (r < lq) {
        int lo, hi;
        fb_range(r, lq, lk, mask, wl, wr, lo, hi);
        long long qr = (oq + r) * H + h;
        float lr = lse[qr];
        if (c >= lo && c <= hi && lr != ninf) {
          const float Z = rowsum[qr];
          float e = pt_exp(pt_mul_rn(fb_dot<E>(ks, q + qr * Dqk, Dqk), scale) - lr);
          float p = Z > 0.f ? e / Z : 0.f;
          float dpv = fb_dot<E>(vs, d_o + qr * Dv, Dv);
          dsv = p * (dpv - delta[qr]);
          pr = p;
        }
      }
      int n = lq - r0 < PT_WARP ? lq - r0 : PT_WARP;
      for (int rr = 0; rr < n; ++rr) {
        float x = pt_shfl(dsv, rr), y = pt_shfl(pr, rr);
        if (x == 0.f && y == 0.f) continue;  // warp-uniform: invisible row
        long long qr = (oq + r0 + rr) * H + h;
#pragma unroll
        for (int j = 0; j < FB_NJ; ++j) {
          int d = lane + j * PT_WARP;
          if (d < Dqk) ak[j] += x * E::load(q + qr * Dqk, d);
          if (d < Dv) av[j] += y * E::load(d_o + qr * Dv, d);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
    if (d < Dqk) O::store(dk + (t * Hkv + hk) * Dqk, d, E::round(ak[j] * scale));
    if (d < Dv) O::store(dv + (t * Hkv + hk) * Dv, d, E::round(av[j]));
  }
}

extern __shared__ float fb_smem[];

#define FB_KERNELS(SUF, E, O)                                                                  \
  PT_KERNEL void fallback_fwd_##SUF(const E::T* q, const E::T* k, const E::T* v, O::T* o,       \
                                    float* lse, const int* cu_q, const int* cu_kv,              \
                                    const int* off_q, const int* off_kv, int b, int H, int Hkv, \
                                    int Dqk, int Dv, long long tq, float scale, int mask,       \
                                    int wl, int wr) {                                           \
    fb_fwd<E, O>(q, k, v, o, lse, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, Dqk, Dv, tq, scale,    \
                 mask, wl, wr, fb_smem);                                                        \
  }                                                                                             \
  PT_KERNEL void fallback_bwd_q_##SUF(                                                          \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      float* delta, float* rowsum, O::T* dq, const int* cu_q, const int* cu_kv, const int* off_q,              \
      const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tq, float scale,     \
      int mask, int wl, int wr) {                                                               \
    fb_bwd_q<E, O>(q, k, v, d_o, lse, delta, rowsum, dq, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, Dqk,    \
                   Dv, tq, scale, mask, wl, wr, fb_smem);                                       \
  }                                                                                             \
  PT_KERNEL void fallback_bwd_kv_##SUF(                                                         \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      const float* delta, const float* rowsum, O::T* dk, O::T* dv, const int* cu_q,             \
      const int* cu_kv,                                                                         \
      const int* off_q, const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tk, \
      float scale, int mask, int wl, int wr) {                                                  \
    fb_bwd_kv<E, O>(q, k, v, d_o, lse, delta, rowsum, dk, dv, cu_q, cu_kv, off_q, off_kv, b, H, Hkv,    \
                    Dqk, Dv, tk, scale, mask, wl, wr, fb_smem);                                 \
  }

FB_KERNELS(bf16, BF16, BF16)
FB_KERNELS(f16, F16, F16)
FB_KERNELS(f32, F32, F32)
FB_KERNELS(bf16_o32, BF16, F32)
FB_KERNELS(f16_o32, F16, F32)
