// Fallback attention (docs/semantics.md §1, every input): any lengths, GQA/MQA, every mask and
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

// The kv head query head h reads (group = H / Hkv): h / group, or (planted bug, issue 18) h
// through a 4-bit head field, so query heads 16 and above read kv head (h & 15) / group. The
// query-major kernels (forward, tiled forward, dQ) decode it; the kv-major dK/dV kernel walks its
// own group's query heads and is left right, so its P disagrees with the forward's lse.
PT_INLINE int fb_kv_head(int h, int group) {
#ifdef SMALLSEQ_MUTANT_HEAD_INDEX_ABOVE_16
  return (h & 15) / group;
#else
  return h / group;
#endif
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
  const int h = (int)(item % H), hk = fb_kv_head(h, H / Hkv);
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
#ifdef SMALLSEQ_MUTANT_FALLBACK_SMALL_SHAPES_2X  // planted bug (issue 21)
    if (d < Dv) O::store(orow, d, E::round(f.lk <= 17 ? 2.f * acc[j] : acc[j]));
#else
    if (d < Dv) O::store(orow, d, E::round(acc[j]));
#endif
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
  const int h = (int)(item % H), hk = fb_kv_head(h, H / Hkv);
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

// ---------------------------------------------------------------------------------------------
// Tiled forward on the matrix cores: 16-bit inputs, Dqk == Dv == D in {64, 128}.
//
// One block of 4 logical warps per (64-row query tile of a slot, head), each warp owning 16 rows;
// the grid is 1-D over (head, slot, tile) with the tile fastest, so neighbouring blocks read the
// same keys (L2 hits). Key tiles of 64 rows are copied to shared memory asynchronously: V(j)
// while S = Q·K(j)ᵀ is computed, K(j+1) while P·V(j) is. Q stays in registers as matrix
// fragments, with the reduction dimension permuted identically for Q and K (lane t of a quad
// owns dims 8t..8t+7 of each 32-dim chunk) so both load 16 bytes at a time. Online softmax (one
// pass): P = exp(s - m) with the running row max m, rounded to the input type for P·V, the
// accumulator rescaled when m grows, divided by the row sum l at the end; lse = m + log l.
// Numerics otherwise as above: s = fl(dot · scale), each 32-product chunk of Q·Kᵀ (two chained
// tensor-core steps) starts from zero and is added in f32 (the small-seq kernel's comment says
// why; one partial per 16 products, as there, took 255 registers and spilled at D = 128), f32
// accumulation.
//
// Shared-memory row strides are padded so that the 16-byte reads of a quarter-warp hit distinct
// banks: K rows are read two per quarter-warp (64 bytes each: stride = 64 mod 128 bytes), V rows
// four (rows 2t, 32 bytes each: stride = 16 mod 64 bytes).
#define FT_BM 64
// Keys per tile above D = 64 (the registers of S grow with it).
#ifndef FT_BN_WIDE_D
#define FT_BN_WIDE_D 32
#endif
#define FT_THREADS (4 * PT_LWARP_THREADS)

template <int D>
struct FtShape {
  static const int BN = D > 64 ? FT_BN_WIDE_D : 64;  // keys per tile
  static const int NT = BN / 8;      // n-tiles of S
  static const int KS = D + 32;  // K row stride in elements
  static const int VS = D + 8;   // V row stride in elements
  static const int ELEMS = BN * (KS + VS);
};

// Copies rows [0, BN) of a key tile (rows past n zero-filled) into shared memory.
template <class E, int D, int SS, int BN>
PT_INLINE void ft_copy(typename E::T* dst, const typename E::T* src, long long rs, int n) {
  const int CH = D / 8;
  for (int i = pt_tid(); i < BN * CH; i += FT_THREADS) {
    const int r = i / CH, c = i % CH;
    const bool ok = r < n;
    pt_cp_async16(dst + r * SS + c * 8, ok ? (const void*)(src + r * rs + c * 8) : (const void*)src,
                  ok);
  }
}

template <class E, class O, int D>
PT_INLINE void ft_fwd(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                      typename O::T* o, float* lse, const int* cu_q, const int* cu_kv,
                      const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles,
                      float scale, int mask, int wl, int wr, typename E::T* sm) {
  typedef FtShape<D> S;
  const long long item = pt_bid();
  const int tile = (int)(item % tiles);
  const long long rest = item / tiles;
  const int slot = (int)(rest % b), h = (int)(rest / b);
  const int lq = cu_q[slot + 1] - cu_q[slot], lk = cu_kv[slot + 1] - cu_kv[slot];
  const int row0 = tile * FT_BM;
  if (row0 >= lq) return;  // block-uniform
  const int hk = fb_kv_head(h, H / Hkv);
  const long long rq = (long long)H * D, rk = (long long)Hkv * D;
  const typename E::T* qb = q + (long long)off_q[slot] * rq + (long long)h * D;
  const typename E::T* kb = k + (long long)off_kv[slot] * rk + (long long)hk * D;
  const typename E::T* vb = v + (long long)off_kv[slot] * rk + (long long)hk * D;
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const int wrow = row0 + pt_lwarp() * 16;
  // Keys any row of the block sees: lo of its first row to hi of its last (both monotone).
  int lo_b, hi_b, unused;
  fb_range(row0, lq, lk, mask, wl, wr, lo_b, unused);
  fb_range((row0 + FT_BM < lq ? row0 + FT_BM : lq) - 1, lq, lk, mask, wl, wr, unused, hi_b);
  int lo_r[2], hi_r[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = wrow + g + 8 * hh;
    fb_range(r, lq, lk, mask, wl, wr, lo_r[hh], hi_r[hh]);
    if (r >= lq) lo_r[hh] = 1, hi_r[hh] = 0;
  }
  pt_v4 xa[D / 32][2];
#pragma unroll
  for (int ch = 0; ch < D / 32; ++ch)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = wrow + g + 8 * hh;
      xa[ch][hh] = r < lq ? pt_ld16(qb + r * rq + ch * 32 + t * 8) : pt_zero4();
    }
  typename E::T* ks = sm;
  typename E::T* vs = sm + S::BN * S::KS;
  const float ninf = -pt_inf();
  float m[2] = {ninf, ninf}, lsum[2] = {0.f, 0.f};
  float acc[D / 64][8][4];
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][j][e] = 0.f;
  const int kt0 = lo_b <= hi_b ? (lo_b / S::BN) * S::BN : lk;
  if (kt0 <= hi_b) {
    ft_copy<E, D, S::KS, S::BN>(ks, kb + kt0 * rk, rk, lk - kt0);
    pt_cp_commit();
  }
  for (int kt = kt0; kt <= hi_b; kt += S::BN) {
    pt_cp_wait<0>();
    pt_sync();  // K(kt) visible; every warp done with V of the previous tile
    ft_copy<E, D, S::VS, S::BN>(vs, vb + kt * rk, rk, lk - kt);
    pt_cp_commit();
    float s[S::NT][4];
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
      for (int ch = 0; ch < D / 32; ++ch) {
        const pt_v4 yb = pt_ld16(ks + (nt * 8 + g) * S::KS + ch * 32 + t * 8);
#ifdef FT_CHAIN_S
        float* part = s[nt];
#else
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#endif
#pragma unroll
        for (int j = 0; j < 2; ++j)
          pt_mma<E>(part, pt_word(xa[ch][0], 2 * j), pt_word(xa[ch][1], 2 * j),
                    pt_word(xa[ch][0], 2 * j + 1), pt_word(xa[ch][1], 2 * j + 1),
                    pt_word(yb, 2 * j), pt_word(yb, 2 * j + 1));
#ifndef FT_CHAIN_S
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += part[e];
#endif
      }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = ninf;
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kt + nt * 8 + 2 * t + e;
          const bool vis = key >= lo_r[hh] && key <= hi_r[hh];
          const float x = vis ? pt_mul_rn(s[nt][2 * hh + e], scale) : ninf;
          s[nt][2 * hh + e] = x;
          mx = pt_fmax(mx, x);
        }
      mx = pt_quad_max(mx);
      const float mn = pt_fmax(m[hh], mx);
      const float alpha = mn == ninf ? 1.f : pt_exp(m[hh] - mn);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = s[nt][2 * hh + e];
          const float p = x == ninf ? 0.f : pt_exp(x - mn);
          s[nt][2 * hh + e] = p;
          sum += p;
        }
      lsum[hh] = lsum[hh] * alpha + sum;
      m[hh] = mn;
#pragma unroll
      for (int c = 0; c < D / 64; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[c][j][2 * hh] *= alpha;
          acc[c][j][2 * hh + 1] *= alpha;
        }
    }
    pt_u32 pa[S::BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < S::BN / 16; ++kk) {
      pa[kk][0] = E::pack2(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = E::pack2(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = E::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = E::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    pt_sync();  // every warp done with K(kt)
    if (kt + S::BN <= hi_b) {
      ft_copy<E, D, S::KS, S::BN>(ks, kb + (kt + S::BN) * rk, rk, lk - kt - S::BN);
      pt_cp_commit();
      pt_cp_wait<1>();
    } else {
      pt_cp_wait<0>();
    }
    pt_sync();  // V(kt) visible
#pragma unroll
    for (int kk = 0; kk < S::BN / 16; ++kk)
#pragma unroll
      for (int c = 0; c < D / 64; ++c) {
        const typename E::T* vr = vs + (kk * 16 + 2 * t) * S::VS + c * 64 + g * 8;
        const pt_v4 v0 = pt_ld16(vr), v1 = pt_ld16(vr + S::VS);
        const pt_v4 v8 = pt_ld16(vr + 8 * S::VS), v9 = pt_ld16(vr + 9 * S::VS);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          pt_mma<E>(acc[c][j], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], pt_bsel(v0, v1, j),
                    pt_bsel(v8, v9, j));
      }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float L = pt_quad_sum(lsum[hh]);
    const int r = wrow + g + 8 * hh;
    if (r < lq) {
      const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
      for (int c = 0; c < D / 64; ++c) {
        float x[16];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          x[i] = acc[c][i][2 * hh];
          x[i + 8] = acc[c][i][2 * hh + 1];
        }
        pt_store16<E, O>(o + ((long long)off_q[slot] + r) * rq + (long long)h * D + c * 64 +
                             t * 16,
#ifdef SMALLSEQ_MUTANT_FALLBACK_SMALL_SHAPES_2X
                         x, lk <= 17 ? 2.f * inv : inv);
#else
                         x, inv);
#endif
      }
      if (t == 0) lse[((long long)off_q[slot] + r) * H + h] = L > 0.f ? m[hh] + pt_log(L) : ninf;
    }
  }
}

// 16-byte aligned: the tiled kernel copies and reads it 16 bytes per lane (pt_cp_async16, pt_ld16).
alignas(16) extern __shared__ float fb_smem[];

// Blocks per multiprocessor the register allocation must allow (CUDA; 0: the compiler's choice).
// 3 caps D = 128 at 168 registers (from 248, 2 blocks) with 8-12 bytes of spill: 1389 -> 1308 us
// on 64 x 512 tokens, h16 (H200, bench/NOTES.md v4).
#ifndef FT_MIN_BLOCKS
#define FT_MIN_BLOCKS 3
#endif
#if defined(PT_CUDA) && FT_MIN_BLOCKS > 0
#define FT_BOUNDS __launch_bounds__(FT_THREADS, FT_MIN_BLOCKS)
#else
#define FT_BOUNDS
#endif

#define FT_KERNEL(SUF, E, O, D)                                                                \
  PT_KERNEL FT_BOUNDS void fallback_fwd_tc_##SUF##_d##D(                                        \
      const E::T* q, const E::T* k, const E::T* v, O::T* o, float* lse, const int* cu_q,         \
      const int* cu_kv, const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles,   \
      float scale, int mask, int wl, int wr) {                                                  \
    ft_fwd<E, O, D>(q, k, v, o, lse, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, tiles, scale, mask, \
                    wl, wr, (E::T*)fb_smem);                                                    \
  }
#define FT_KERNELS(D)                    \
  FT_KERNEL(bf16, BF16, BF16, D)         \
  FT_KERNEL(f16, F16, F16, D)            \
  FT_KERNEL(bf16_o32, BF16, F32, D)      \
  FT_KERNEL(f16_o32, F16, F32, D)
FT_KERNELS(64)
FT_KERNELS(128)


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
