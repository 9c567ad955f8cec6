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
//
// FTB_D_FROM_O=1 (docs/semantics.md §1.7, the second form): D = rowsum(dO ∘ O) from the O
// passed in, one reduction per (query token, head) before the query side (fb_bwd_delta,
// FlashAttention's preprocessing), so the query sides lose the passes over the keys that formed
// Z and D. Z is still needed where the LSE comes from another kernel, and costs no pass: the
// query side sums exp(s - lse) in the same pass as dS, forms dS from the unnormalised P and
// divides dQ by Z at the store (Z is a row constant of dQ = Σ (e/Z)(dP - D) K); it stores Z for
// the key side and dBias, whose P = e / Z is then exactly 1 on a one-key row, as before.
//
// FTB_D_FROM_O=2 (the tiled query side up to D = 128; elsewhere as 0): one pass from D_O =
// rowsum(dO ∘ O) that loses no value. Beside dQ_O = Σ e (dP - D_O) K it forms the exact
// D = Σ e·dP / Z (f64, as pass 1 of the two-pass form) and B = Σ e·K, and stores
// dQ = (dQ_O + (D_O - D) B) / Z, which is Σ (e / Z)(dP - D) K: the correction is of the size of
// D_O's error, so its own roundings are second order, and the cancellation D_O alone loses
// (bench/NOTES.md v21) is kept (bench/d_correction.py, "corrected"). The exact D goes to the
// key side, so the outputs follow the exact form's design. 4 matrix products per (query, key)
// pair on the query side instead of 5; B's accumulator takes the registers that held Q and dO,
// which are re-read instead (bench/NOTES.md v27).
#ifndef FTB_D_FROM_O
#define FTB_D_FROM_O 0
#endif
#if FTB_D_FROM_O < 0 || FTB_D_FROM_O > 2
#error "FTB_D_FROM_O is 0 (exact D), 1 (D from the stored O) or 2 (D from O, corrected)"
#endif
#include "portable.h"

#define FB_WPB 4
#define FB_MAXD 512
// The key-side kernel's GQA sums: 0 sums dK and dV over the group's heads and rows in one f32
// accumulator (dK scaled once at the store); 1 sums each head's rows apart and adds the head's
// sums to the group's, dK's scaled first (the emulation's order and roundings,
// reference/src/emulate.rs). With 16 heads of 128 rows an f32 dV summed
// flat sat 5x the emulation's error from the reference, past the tensor rule's threshold
// (H200, fuzz seed 2095, 3 of 77,260 cases, margins 1.02-1.32; bench/NOTES.md v13); per head,
// a host simulation of the worst element falls from 8.5e-5 to 1.5e-5 (the emulation: 2.4e-5),
// and two 10-minute H200 campaigns (137,692 cases, NOTES v14) had no failure of this kernel.
#ifndef FB_GROUP_PARTIALS
#define FB_GROUP_PARTIALS 1
#endif
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

// Dropout (docs/semantics.md §1.8), bit for bit the reference's (reference/src/dropout.rs):
// Philox 4x32-10 keyed by the seed, counter (n_lo, n_hi, r, c) with n = offset + slot * H + h,
// element kept when the first word is at or above keep_at = ceil(p * 2^32) (0: no dropout). The
// backward recomputes the forward's mask from the same arguments.
struct FbDrop {
  unsigned long long seed, offset;
  long long keep_at;
  float rescale;  // fl32(1 / (1 - p)); 0 at p = 1
};

PT_INLINE unsigned fb_philox_word0(unsigned k0, unsigned k1, unsigned x0, unsigned x1, unsigned x2,
                                   unsigned x3) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = 0xD2511F53ull * x0, p1 = 0xCD9E8D57ull * x2;
    const unsigned hi0 = (unsigned)(p0 >> 32), lo0 = (unsigned)p0;
    const unsigned hi1 = (unsigned)(p1 >> 32), lo1 = (unsigned)p1;
    x0 = hi1 ^ x1 ^ k0;
    x1 = lo1;
    x2 = hi0 ^ x3 ^ k1;
    x3 = lo0;
  }
  return x0;
}

// The factor of P's element (r, c) of head h in slot `slot`: 1 without dropout, else the
// rescale when kept and 0 when dropped.
PT_INLINE float fb_drop(const FbDrop& d, int slot, int H, int h, int r, int c) {
  if (d.keep_at <= 0) return 1.f;
  const unsigned long long n = d.offset + (unsigned long long)slot * (unsigned long long)H + h;
  const unsigned w = fb_philox_word0((unsigned)d.seed, (unsigned)(d.seed >> 32), (unsigned)n,
                                     (unsigned)(n >> 32), (unsigned)r, (unsigned)c);
  return (long long)w >= d.keep_at ? d.rescale : 0.f;
}

// The additive bias of the scores (docs/semantics.md §1.9), as the reference's AttnBias::at32
// (reference/src/bias.rs): kind 1 a post-scale tensor [bb, hb, sq, sk] of f32 values, a
// dimension of 1 broadcast; kind 2 ALiBi, one f32 slope per query head, -(slope * |r + lk - lq -
// c|) rounded once; 0 none. Added to the rounded f32 score (s = fl(fl(dot * scale) + bias)); a
// -inf entry hides its key as the mask does.
struct FbBias {
  const float* t;
  int kind, bb, hb, sq, sk;
};

PT_INLINE float fb_bias(const FbBias& B, int slot, int h, int r, int c, int lq, int lk) {
  if (B.kind == 1) {
    const long long plane = (long long)(B.bb == 1 ? 0 : slot) * B.hb + (B.hb == 1 ? 0 : h);
    return B.t[(plane * B.sq + r) * B.sk + c];
  }
  int dist = r + (lk - lq) - c;
  dist = dist < 0 ? -dist : dist;
  return -pt_mul_rn(B.t[h], (float)dist);
}

// The score of (r, c): the rounded scaled dot product plus the bias, no FMA between them.
PT_INLINE float fb_score(float dot, float scale, const FbBias& B, int slot, int h, int r, int c,
                         int lq, int lk) {
  const float s = pt_mul_rn(dot, scale);
  return B.kind == 0 ? s : s + fb_bias(B, slot, h, r, c, lq, lk);
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

// fb_dot with x read from memory: the same products and order, so the same value.
template <class E>
PT_INLINE float fb_dot_g(const typename E::T* x, const typename E::T* y, int d) {
  float acc = 0.f;
  for (int i = 0; i < d; ++i) acc = fb_madd<E>(acc, E::load(x, i), E::load(y, i));
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
                      int Dv, long long tq, float scale, int mask, int wl, int wr, FbDrop drop,
                      FbBias bias, float* smem) {
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
  const bool hides = bias.kind != 0;
  // Pass 1: per-lane online max/sum, then combined.
  float m = ninf, l = 0.f;
  for (int c0 = lo; c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi) {
      float s = fb_score(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk), scale, bias,
                         f.slot, h, f.r, c, f.lq, f.lk);
      // A key hidden by a -inf bias takes no part (exp(-inf - -inf) would be NaN). Only with a
      // bias: a case without one keeps its outputs bit for bit.
      if (hides && s == ninf) continue;
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
    const float s = c <= hi ? fb_score(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk),
                                       scale, bias, f.slot, h, f.r, c, f.lq, f.lk)
                            : ninf;
    if (c <= hi && !(hides && s == ninf)) {
      p = E::round(pt_exp(s - M) / L);
      // L sums every key; P·V takes only the kept ones, the rescale comes at the end.
      if (fb_drop(drop, f.slot, H, h, f.r, c) == 0.f) p = 0.f;
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
  if (drop.keep_at > 0) {
#pragma unroll
    for (int j = 0; j < FB_NJ; ++j) acc[j] *= drop.rescale;
  }
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
#ifdef SMALLSEQ_MUTANT_FALLBACK_SMALL_SHAPES_2X  // planted bug (issue 21)
    if (d < Dv) O::store(orow, d, E::round(f.lk <= 17 ? 2.f * acc[j] : acc[j]));
#else
    if (d < Dv) O::store(orow, d, E::round(acc[j]));
#endif
  }
  // A row whose every key is hidden (masked, or by a -inf bias) has L = 0 and lse = -inf.
  if (lane == 0) lse[t * H + h] = (hides ? L > 0.f : lo <= hi) ? M + pt_log(L) : ninf;
}

// Backward, query side: Z = Σ exp(s - lse) and delta = Σ P·dP (workspace) and dq for every
// valid query token.
template <class E, class O>
PT_INLINE void fb_bwd_q(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                        const typename E::T* d_o, const float* lse, float* delta, float* rowsum,
                        typename O::T* dq, const int* cu_q, const int* cu_kv, const int* off_q,
                        const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tq,
                        float scale, int mask, int wl, int wr, FbDrop drop, FbBias bias,
                        float* smem) {
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
#if FTB_D_FROM_O == 1
  // One pass: D from fb_bwd_delta, dS from the unnormalised P, dQ divided by Z at the store.
  const float D = live ? delta[t * H + h] : 0.f;
  float zsum = 0.f;
#else
  float zsum = 0.f;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi)
      zsum += pt_exp(fb_score(fb_dot<E>(qs, k + ((f.ok + c) * Hkv + hk) * Dqk, Dqk), scale, bias,
                              f.slot, h, f.r, c, f.lq, f.lk) -
                     lr);
  }
  const float Z = pt_warp_sum(zsum);
  // D in f64: every dS = P (dP - D) of a peaked row cancels against it, so its f32 rounding
  // error, amplified, was the whole dK error of such rows (fuzz seed 7, cases 1966, 3539).
  double dsum = 0.0;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    if (c <= hi) {
      long long kr = (f.ok + c) * Hkv + hk;
      float e = pt_exp(
          fb_score(fb_dot<E>(qs, k + kr * Dqk, Dqk), scale, bias, f.slot, h, f.r, c, f.lq, f.lk) -
          lr);
      float p = Z > 0.f ? e / Z : 0.f;
      // A dropped key's dP is exactly 0, not 0 times a product (as the reference); a kept one's
      // is rounded before D is taken from it (no FMA: the dBias kernel forms the same dP).
      const float z = fb_drop(drop, f.slot, H, h, f.r, c);
      const float dpv = z == 0.f ? 0.f : pt_mul_rn(fb_dot<E>(ds, v + kr * Dv, Dv), z);
      dsum += (double)p * (double)dpv;
    }
  }
  const float D = (float)pt_warp_sum_d(dsum);
  if (lane == 0) {
    delta[t * H + h] = D;
    rowsum[t * H + h] = Z;
  }
#endif
  float acc[FB_NJ];
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) acc[j] = 0.f;
  for (int c0 = lo; live && c0 <= hi; c0 += PT_WARP) {
    int c = c0 + lane;
    float dsv = 0.f;
    if (c <= hi) {
      long long kr = (f.ok + c) * Hkv + hk;
      float e = pt_exp(
          fb_score(fb_dot<E>(qs, k + kr * Dqk, Dqk), scale, bias, f.slot, h, f.r, c, f.lq, f.lk) -
          lr);
#if FTB_D_FROM_O == 1
      zsum += e;
      const float p = e;
#else
      float p = Z > 0.f ? e / Z : 0.f;
#endif
      const float z = fb_drop(drop, f.slot, H, h, f.r, c);
      float dpv = z == 0.f ? 0.f : pt_mul_rn(fb_dot<E>(ds, v + kr * Dv, Dv), z);
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
#if FTB_D_FROM_O == 1
  const float Z = pt_warp_sum(zsum);
  if (lane == 0) rowsum[t * H + h] = Z;
  // A row without a visible key has acc = 0 and Z = 0: no division.
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) acc[j] = Z > 0.f ? acc[j] / Z : 0.f;
#endif
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
    if (d < Dqk) O::store(out, d, E::round(acc[j] * scale));
  }
}

// D = rowsum(dO ∘ O) of every valid query token and head (FTB_D_FROM_O), from the O passed to
// the backward in the input type: f32 products (exact for 16-bit inputs) summed in f32, lanes
// over the columns, then the warp's tree. Not f64 as Σ P·dP is: here the error is O's own
// rounding to the input type (a relative 2^-9 per element for bf16), which no accumulator
// undoes; f32 adds Dv·2^-24 at most to it.
template <class E>
PT_INLINE void fb_bwd_delta(const typename E::T* o, const typename E::T* d_o, float* delta,
                            const int* cu_q, const int* cu_kv, const int* off_q,
                            const int* off_kv, int b, int H, int Dv, long long tq) {
  const int w = pt_tid() / PT_WARP, lane = pt_lane();
  const long long item = pt_bid() * FB_WPB + w;
  if (item >= tq * H) return;
  const long long t = item / H;
  FbRow f;
  if (!fb_find(f, t, cu_q, off_q, cu_kv, off_kv, b)) return;
  const long long at = item * Dv;  // (t * H + h) * Dv
  float acc = 0.f;
  for (int d = lane; d < Dv; d += PT_WARP) acc = fb_madd<E>(acc, E::load(d_o + at, d), E::load(o + at, d));
  const float D = pt_warp_sum(acc);
  if (lane == 0) delta[item] = D;
}

// Backward, key side: dk, dv for every valid key token and kv head, summed over the group.
template <class E, class O>
PT_INLINE void fb_bwd_kv(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                         const typename E::T* d_o, const float* lse, const float* delta,
                         const float* rowsum, typename O::T* dk, typename O::T* dv, const int* cu_q,
                         const int* cu_kv, const int* off_q, const int* off_kv, int b, int H,
                         int Hkv, int Dqk, int Dv, long long tk, float scale, int mask, int wl,
                         int wr, FbDrop drop, FbBias bias, float* smem) {
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
#if FB_GROUP_PARTIALS
    // This head's sums, added to the group's after its rows (the emulation's order).
    float gk[FB_NJ], gv[FB_NJ];
#pragma unroll
    for (int j = 0; j < FB_NJ; ++j) gk[j] = ak[j], gv[j] = av[j], ak[j] = av[j] = 0.f;
#endif
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
          float e = pt_exp(
              fb_score(fb_dot<E>(ks, q + qr * Dqk, Dqk), scale, bias, f.slot, h, r, c, lq, lk) -
              lr);
          float p = Z > 0.f ? e / Z : 0.f;
          const float z = fb_drop(drop, f.slot, H, h, r, c);
          float dpv = z == 0.f ? 0.f : pt_mul_rn(fb_dot<E>(vs, d_o + qr * Dv, Dv), z);
          dsv = p * (dpv - delta[qr]);
          pr = p * z;  // dV takes the dropped, rescaled P
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
#if FB_GROUP_PARTIALS
    // dK's head sum scaled before it joins the group's (rounded apart: no FMA), as emulated.
#pragma unroll
    for (int j = 0; j < FB_NJ; ++j) ak[j] = gk[j] + pt_mul_rn(ak[j], scale), av[j] = gv[j] + av[j];
#endif
  }
#pragma unroll
  for (int j = 0; j < FB_NJ; ++j) {
    int d = lane + j * PT_WARP;
    if (d < Dqk) O::store(dk + (t * Hkv + hk) * Dqk, d, E::round(FB_GROUP_PARTIALS ? ak[j] : ak[j] * scale));
    if (d < Dv) O::store(dv + (t * Hkv + hk) * Dv, d, E::round(av[j]));
  }
}

// dBias of a post-scale bias: one work item per row (bb, hh, i) of the [Bb, Hb, Sq, Sk] tensor,
// lanes over its keys. Each element sums the f32 dS of the slots and heads that read it, in slot
// then head order (the CPU backend's store_dbias: deterministic, no atomics), and is rounded to
// the input type once; an element no slot reads is 0. dS = P (dP - D) is recomputed exactly as
// the query side forms it (same products, same order, its stored D and Z), so it is that
// kernel's dS bit for bit; it runs after the query side. (With FTB_D_FROM_O the query side
// forms dS from the unnormalised P and divides dQ by Z; this kernel takes P = e / Z, the key
// side's dS.)
template <class E, class O>
PT_INLINE void fb_dbias(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                        const typename E::T* d_o, const float* lse, const float* delta,
                        const float* rowsum, typename O::T* dbias, const int* cu_q,
                        const int* cu_kv, const int* off_q, const int* off_kv, int b, int H,
                        int Hkv, int Dqk, int Dv, long long rows, float scale, int mask, int wl,
                        int wr, FbDrop drop, FbBias bias) {
  const int w = pt_tid() / PT_WARP, lane = pt_lane();
  const long long item = pt_bid() * FB_WPB + w;
  if (item >= rows) return;  // rows = bb * hb * sq
  const int i = (int)(item % bias.sq);
  const int plane = (int)(item / bias.sq), bb = plane / bias.hb, hh = plane % bias.hb;
  const float ninf = -pt_inf();
  const int s0 = bias.bb == 1 ? 0 : bb, s1 = bias.bb == 1 ? b : bb + 1;
  const int h0 = bias.hb == 1 ? 0 : hh, h1 = bias.hb == 1 ? H : hh + 1;
  for (int c = lane; c < bias.sk; c += PT_WARP) {
    float acc = 0.f;
    for (int slot = s0; slot < s1; ++slot) {
      const int lq = cu_q[slot + 1] - cu_q[slot], lk = cu_kv[slot + 1] - cu_kv[slot];
      if (i >= lq || c >= lk) continue;
      int lo, hi;
      fb_range(i, lq, lk, mask, wl, wr, lo, hi);
      if (c < lo || c > hi) continue;
      const long long t = (long long)off_q[slot] + i, kt = (long long)off_kv[slot] + c;
      for (int h = h0; h < h1; ++h) {
        const long long qr = t * H + h, kr = kt * Hkv + fb_kv_head(h, H / Hkv);
        const float lr = lse[qr];
        if (lr == ninf) continue;
        const float Z = rowsum[qr];
        const float e = pt_exp(fb_score(fb_dot_g<E>(q + qr * Dqk, k + kr * Dqk, Dqk), scale, bias,
                                        slot, h, i, c, lq, lk) -
                               lr);
        const float p = Z > 0.f ? e / Z : 0.f;
        const float z = fb_drop(drop, slot, H, h, i, c);
        const float dpv = z == 0.f ? 0.f : pt_mul_rn(fb_dot_g<E>(d_o + qr * Dv, v + kr * Dv, Dv), z);
        acc += pt_mul_rn(p, dpv - delta[qr]);  // dS rounded before the sum, as stored
      }
    }
    O::store(dbias + (long long)item * bias.sk, c, E::round(acc));
  }
}

// ---------------------------------------------------------------------------------------------
// Tiled forward on the matrix cores: 16-bit inputs, Dqk == Dv == D in {64, 128, 256}.
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
// Keys per tile above D = 64 (the registers of S grow with it), and at D = 256 (where the
// shared memory of a 64-key tile would pass the 48 KiB a launch gets by default).
#ifndef FT_BN_WIDE_D
#define FT_BN_WIDE_D 32
#endif
#ifndef FT_BN_D256
#define FT_BN_D256 32
#endif
#define FT_THREADS (4 * PT_LWARP_THREADS)

template <int D>
struct FtShape {
  static const int BN = D > 128 ? FT_BN_D256 : (D > 64 ? FT_BN_WIDE_D : 64);  // keys per tile
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

// The work item of a tiled block: the grid is 1-D over (head, slot, tile), tile fastest (both
// tiled directions and both sides of the backward).
struct FtItem {
  int tile, slot, head, lq, lk;
};
PT_INLINE FtItem ft_item(long long item, int tiles, int b, const int* cu_q, const int* cu_kv) {
  const long long rest = item / tiles;
  FtItem it;
  it.tile = (int)(item % tiles);
  it.slot = (int)(rest % b);
  it.head = (int)(rest / b);
  it.lq = cu_q[it.slot + 1] - cu_q[it.slot];
  it.lk = cu_kv[it.slot + 1] - cu_kv[it.slot];
  return it;
}

template <class E, class O, int D>
PT_INLINE void ft_fwd(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                      typename O::T* o, float* lse, const int* cu_q, const int* cu_kv,
                      const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles,
                      float scale, int mask, int wl, int wr, typename E::T* sm) {
  typedef FtShape<D> S;
  const FtItem it = ft_item(pt_bid(), tiles, b, cu_q, cu_kv);
  const int tile = it.tile, slot = it.slot, h = it.head, lq = it.lq, lk = it.lk;
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
  // Q as fragments, held in registers up to D = 128. At D = 256 they would not fit beside the
  // P·V accumulator (128 registers), so each key tile re-reads them (L1 hits).
  pt_v4 xa[D <= 128 ? D / 32 : 1][2];
  if constexpr (D <= 128) {
#pragma unroll
    for (int ch = 0; ch < D / 32; ++ch)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = wrow + g + 8 * hh;
        xa[ch][hh] = r < lq ? pt_ld16(qb + r * rq + ch * 32 + t * 8) : pt_zero4();
      }
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
        pt_v4 a0, a1;
        if constexpr (D <= 128) {
          a0 = xa[ch][0];
          a1 = xa[ch][1];
        } else {
          const int r = wrow + g;
          a0 = r < lq ? pt_ld16(qb + r * rq + ch * 32 + t * 8) : pt_zero4();
          a1 = r + 8 < lq ? pt_ld16(qb + (r + 8) * rq + ch * 32 + t * 8) : pt_zero4();
        }
#ifdef FT_CHAIN_S
        float* part = s[nt];
#else
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#endif
#pragma unroll
        for (int j = 0; j < 2; ++j)
          pt_mma<E>(part, pt_word(a0, 2 * j), pt_word(a1, 2 * j), pt_word(a0, 2 * j + 1),
                    pt_word(a1, 2 * j + 1), pt_word(yb, 2 * j), pt_word(yb, 2 * j + 1));
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

// ---------------------------------------------------------------------------------------------
// Tiled backward on the matrix cores: the same inputs as the tiled forward (16-bit, Dqk == Dv ==
// D in {64, 128, 256}), in two kernels, as the scalar backward, so that every gradient is summed
// in a fixed order without atomics (the determinism property reruns each case bitwise).
//
// Query side, one block per (64-row query tile, head), each warp owning 16 rows as in the
// forward, Q and dO as fragments (held up to D = 128, re-read at 256: FtbFrags). Pass 1 over the key tiles: S = Q·Kᵀ and dP = dO·Vᵀ, then
// Z = Σ exp(s - lse) and Σ exp(s - lse)·dP (f64, the reason is fb_bwd_q's); D = that sum / Z.
// Pass 2: S and dP again, dS = P·(dP - D) with P = exp(s - lse) / Z, scaled into the input
// type's range per 16 x 16 block and rounded to it (ftb_ds_scale: as the small-seq kernels and
// the emulation do), dQ += dS·K. D and Z go to
// the workspace for the key side. With FTB_D_FROM_O=1, D comes from fb_bwd_delta and pass 1 goes:
// one pass forms Z beside dS = e·(dP - D) and divides dQ by Z (3 matrix products per (query,
// key) pair on this side instead of 5); with 2, the same pass corrects dQ by the exact D (4).
// Key side, one block per (64-key tile, kv head), each warp owning 16 keys: over the group's
// query heads and the query tiles that can see the block's keys, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, P
// and dS from the query side's lse, Z and D, dV += P·dO (P rounded to the input type, as the
// forward's P·V) and dK += dS·Q. K and V fragments are re-read (L1) for every query tile: held,
// they and the two accumulators took more than 255 registers at D = 128. At D = 256 each work
// item has two blocks, one for dV and one for dK (FtbParts).
//
// Both kernels copy their column tiles (K and V; Q and dO) to shared memory in one cp.async
// group and read them in both roles: as B with the reduction over dims (rows g, the forward's K
// read) and as B with the reduction over rows (rows 2t, 2t+1, 2t+8, 2t+9, the forward's V read).

// A tile read in both roles cannot have conflict-free 16-byte reads under one row padding: the
// reduction over dims has a quarter-warp read rows g in {0, 1} at chunks t (wants a row stride of
// 16 mod 32 words), the one over rows reads rows 2t at chunks g (wants 4 mod 8 words). Padded
// rows (D + 32 elements: the first) left the second 4-way conflicted, 1-2e8 conflicts per
// 512-token launch (NOTES v11). Swizzled rows serve both: chunk c of row r sits at chunk
// c ^ f(r) of its row, f(r) = (r & 6) ^ ((r & 1) << 2), which sends rows g = 0, 1 to chunk
// halves 0-3 and 4-7 and rows 2t to chunk pairs 2t. FTB_SWIZZLE=0 keeps the padded rows.
#ifndef FTB_SWIZZLE
#define FTB_SWIZZLE 1
#endif
// The largest D whose tiles are swizzled: at D = 256 the swizzle's index arithmetic took the key
// side's spill from 48 to 132 bytes, and padded rows there are 4 % faster on W3's backward
// (36,692 against 38,233 us; H200, bench/NOTES.md v14).
#ifndef FTB_SWIZZLE_MAX_D
#define FTB_SWIZZLE_MAX_D 128
#endif
// Columns per tile (keys in the query-side kernel, queries in the key-side one).
template <int D>
struct FtbShape {
  static const int BN = D > 64 ? 32 : 64;
  static const int NT = BN / 8;
  enum { SWIZZLED = FTB_SWIZZLE && D <= FTB_SWIZZLE_MAX_D };  // an enum: no PTX global
  enum { S = SWIZZLED ? D : D + 32 };  // row stride in elements (both tiles)
  static const int ELEMS = 2 * BN * S;
  // Element offset of 16-byte chunk c of row r.
  static PT_INLINE int at(int r, int c) {
    return r * S + ((SWIZZLED ? c ^ ((r & 6) ^ ((r & 1) << 2)) : c) << 3);
  }
};

// FT_COPY_HOIST=1: the tiled backward's column-tile copies up to D = 128 with the strides
// hoisted out of the copy loop (below): the same values (only the addresses are computed
// otherwise), ptxas spills 48 and 24 bytes at D = 128 where it spilled 64 and 32, and the
// backward took 0.935x the time on 512-token slots, 0.95x on W1 and W2 (H100, bench/NOTES.md
// v27; at D = 256 it spilled more, and the tiled forward's key tiles at 256, hoisted and
// unrolled, spilled 16 bytes where 520 and took 1.19x the time: neither is hoisted). 0 until
// its device campaign.
#ifndef FT_COPY_HOIST
#define FT_COPY_HOIST 0
#endif

// Copies rows [0, BN) of a column tile (rows past n zero-filled) into shared memory.
template <class E, int D>
PT_INLINE void ftb_copy(typename E::T* dst, const typename E::T* src, long long rs, int n) {
  typedef FtbShape<D> S;
  const int CH = D / 8;
  if constexpr (FT_COPY_HOIST && D <= 128) {
    // Thread i copies chunk i % CH of rows i / CH + k·STEP: its chunk, source column and place
    // in the row are the same for every k (the swizzle repeats every 8 rows, and STEP is a
    // multiple of 8), so each copy adds two strides. Written as i / CH and i % CH per copy (the
    // other branch), the index arithmetic was the hottest code of both tiled backward kernels
    // on 512-token slots (ncu, bench/NOTES.md v27).
    const int STEP = FT_THREADS / CH;
    static_assert(FT_THREADS % CH == 0 && S::BN % STEP == 0, "whole rows per pass of the block");
    static_assert(!S::SWIZZLED || STEP % 8 == 0, "the swizzle's period divides the row step");
    const int r0 = pt_tid() / CH, c = pt_tid() % CH;
    typename E::T* d = dst + S::at(r0, c);
    const typename E::T* from = src + r0 * rs + c * 8;
    const long long step = STEP * rs;
#pragma unroll 1
    for (int r = r0; r < S::BN; r += STEP, d += STEP * S::S, from += step) {
      const bool ok = r < n;
      pt_cp_async16(d, ok ? (const void*)from : (const void*)src, ok);
    }
  } else {
    for (int i = pt_tid(); i < S::BN * CH; i += FT_THREADS) {
      const int r = i / CH, c = i % CH;
      const bool ok = r < n;
      pt_cp_async16(dst + S::at(r, c),
                    ok ? (const void*)(src + r * rs + c * 8) : (const void*)src, ok);
    }
  }
}

PT_INLINE double pt_quad_sum_d(double x) {
  x += pt_shfl_d(x, pt_lane() ^ 1);
  return x + pt_shfl_d(x, pt_lane() ^ 2);
}

// Rows of a slot that can see a key in [c0, c1]: [r0, r1] (empty when r0 > r1). The visible
// range [lo, hi] of row r only grows with r (fb_range), so each end is a binary search.
PT_INLINE void fb_rows_seeing(int c0, int c1, int lq, int lk, int mask, int wl, int wr, int& r0,
                              int& r1) {
  int a = 0, b = lq;  // first row with hi >= c0
  while (a < b) {
    const int mid = (a + b) >> 1;
    int lo, hi;
    fb_range(mid, lq, lk, mask, wl, wr, lo, hi);
    if (hi >= c0) b = mid;
    else a = mid + 1;
  }
  r0 = a;
  a = 0, b = lq;  // first row with lo > c1
  while (a < b) {
    const int mid = (a + b) >> 1;
    int lo, hi;
    fb_range(mid, lq, lk, mask, wl, wr, lo, hi);
    if (lo > c1) b = mid;
    else a = mid + 1;
  }
  r1 = a - 1;
}

// x[nt][e] += Σ_d a[row][d] · y[nt*8 + col][d] over 32-dim chunks (each chunk from zero, added in
// f32: the forward's order), a from an FtbFrags (lane t: dims 8t..8t+7 of each chunk), y rows in
// shared memory (FtbShape's layout).
template <class E, int D, int NT, class A>
PT_INLINE void ftb_dots(float (*x)[4], const A& a, const typename E::T* y) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int ch = 0; ch < D / 32; ++ch) {
      const pt_v4 yb = pt_ld16(y + FtbShape<D>::at(nt * 8 + g, ch * 4 + t));
      const pt_v4 a0 = a.at(ch, 0), a1 = a.at(ch, 1);
      float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 2; ++j)
        pt_mma<E>(part, pt_word(a0, 2 * j), pt_word(a1, 2 * j), pt_word(a0, 2 * j + 1),
                  pt_word(a1, 2 * j + 1), pt_word(yb, 2 * j), pt_word(yb, 2 * j + 1));
#pragma unroll
      for (int e = 0; e < 4; ++e) x[nt][e] += part[e];
    }
}

// The fragments of 16 rows (row0 + g, row0 + g + 8; zero at and past n) of a row-major tensor.
template <int D>
PT_INLINE void ftb_rows(pt_v4 (*a)[2], const void* base16, long long rs, int row0, int n) {
  const pt_u16* base = (const pt_u16*)base16;
  const int t = pt_llane() & 3, g = pt_llane() >> 2;
#pragma unroll
  for (int ch = 0; ch < D / 32; ++ch)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row0 + g + 8 * hh;
      a[ch][hh] = r < n ? pt_ld16(base + r * rs + ch * 32 + t * 8) : pt_zero4();
    }
}

// The A operand of ftb_dots: 16 rows of a row-major tensor as fragments. Up to D = 128 they are
// held in registers; at D = 256 (64 registers per tensor) they would not fit beside a 128-register
// accumulator, so each use re-reads them (L1 hits), as the D = 256 forward re-reads Q.
template <int D, bool HELD = (D <= 128)>
struct FtbFrags {
  pt_v4 a[D / 32][2];
  PT_INLINE void load(const void* base, long long rs, int row0, int n) {
    ftb_rows<D>(a, base, rs, row0, n);
  }
  PT_INLINE pt_v4 at(int ch, int hh) const { return a[ch][hh]; }
};
template <int D>
struct FtbFrags<D, false> {
  const pt_u16* base;
  long long rs;
  int row0, n;
  PT_INLINE void load(const void* b, long long s, int r0, int nn) {
    base = (const pt_u16*)b, rs = s, row0 = r0, n = nn;
  }
  PT_INLINE pt_v4 at(int ch, int hh) const {
    const int r = row0 + (pt_llane() >> 2) + 8 * hh;
    return r < n ? pt_ld16(base + r * rs + ch * 32 + (pt_llane() & 3) * 8) : pt_zero4();
  }
};

template <int D>
PT_INLINE void ftb_scale_acc(float (*acc)[8][4], float by) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][j][e] *= by;
}

// dS of a warp's 16 x BN tile (accumulator layout) brought into E's range before it is packed
// as a 16-bit operand, as the small-seq kernels do it (ss_ds_scale, reference/src/ds_scale.rs):
// false, and nothing done, when no |dS| of the tile lies past E's range (one vote: the tile
// computes exactly what the unscaled design did); else each 16 x 16 block kk whose largest
// finite |dS| is past E's largest finite value is multiplied by the least power of two that
// brings it under, inv[kk] undoes it on the f32 products (ftb_rows_mma), and true. The tiles of
// both kernels start at multiples of 16 rows and keys of the slot, so the blocks are the
// emulation's.
template <class E, int BN>
PT_INLINE bool ftb_ds_scale(float (*x)[4], float (&inv)[BN / 16]) {
  bool past = false;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) past |= pt_past_range<E>(x[nt][e]);
  if (!pt_lwarp_any(past)) return false;  // warp-uniform
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    float mb = 0.f;
#pragma unroll
    for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) mb = pt_fmax(mb, pt_finite_abs(x[nt][e]));
    const float sc = pt_range_scale<E>(pt_lwarp_max(mb));
    inv[kk] = 1.f / sc;
#pragma unroll
    for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[nt][e] *= sc;
  }
  return true;
}

// acc[c][j] += A · y over BN rows of y (shared memory, FtbShape's layout), A given as packed fragments of
// a 16 x BN matrix (pa[kk]: columns kk*16..kk*16+15); output dims permuted as in the forward's
// P·V (n-tile j, column 2t+e of chunk c is dim c*64 + (2t+e)*8 + j).
// SCALED: inv holds each 16 x 16 block's inverse range scale (ftb_ds_scale); the accumulator
// joins a scaled block's scale for its products and leaves it after, both exact (powers of
// two). A separate instantiation, so the unscaled path is the code it always was.
template <class E, int D, int BN, bool SCALED = false>
PT_INLINE void ftb_rows_mma(float (*acc)[8][4], const pt_u32 (*pa)[4], const typename E::T* y,
                            const float* inv = nullptr) {
  typedef FtbShape<D> S;
  const int l = pt_llane(), g = l >> 2, t = l & 3;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const float bi = SCALED ? inv[kk] : 1.f;
    if (SCALED && bi != 1.f) ftb_scale_acc<D>(acc, 1.f / bi);
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      const int r = kk * 16 + 2 * t, ck = c * 8 + g;
      const pt_v4 v0 = pt_ld16(y + S::at(r, ck)), v1 = pt_ld16(y + S::at(r + 1, ck));
      const pt_v4 v8 = pt_ld16(y + S::at(r + 8, ck)), v9 = pt_ld16(y + S::at(r + 9, ck));
#pragma unroll
      for (int j = 0; j < 8; ++j)
        pt_mma<E>(acc[c][j], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], pt_bsel(v0, v1, j),
                  pt_bsel(v8, v9, j));
    }
    if (SCALED && bi != 1.f) ftb_scale_acc<D>(acc, bi);
  }
}

// A fragments of the 16 x BN matrix x (accumulator layout), each value passed through f first.
template <class E, int BN, class F>
PT_INLINE void ftb_pack(pt_u32 (*pa)[4], const float (*x)[4], F f) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    pa[kk][0] = E::pack2(f(x[2 * kk][0]), f(x[2 * kk][1]));
    pa[kk][1] = E::pack2(f(x[2 * kk][2]), f(x[2 * kk][3]));
    pa[kk][2] = E::pack2(f(x[2 * kk + 1][0]), f(x[2 * kk + 1][1]));
    pa[kk][3] = E::pack2(f(x[2 * kk + 1][2]), f(x[2 * kk + 1][3]));
  }
}

template <class E>
struct FtbSat {
  PT_INLINE float operator()(float x) const { return pt_sat<E>(x); }
};
struct FtbSame {
  PT_INLINE float operator()(float x) const { return x; }
};

// Stores a 16-row accumulator (rows row0 + g, + 8 below n) times mul, rounded, at p + r * rs.
template <class E, class O, int D>
PT_INLINE void ftb_store(typename O::T* p, long long rs, int row0, int n, float (*acc)[8][4],
                         float mul) {
  const int t = pt_llane() & 3, g = pt_llane() >> 2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row0 + g + 8 * hh;
    if (r >= n) continue;
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[i] = acc[c][i][2 * hh];
        x[i + 8] = acc[c][i][2 * hh + 1];
      }
      pt_store16<E, O>(p + r * rs + c * 64 + t * 16, x, mul);
    }
  }
}

// Rows hh of a query-side dQ accumulator (accumulator layout) made (acc + corr·b) / z, or
// acc / z without CORR: a one-pass query side forms dS from the unnormalised P, and Z (with
// FTB_D_FROM_O=2 the correction by the exact D, the file's header) is a row constant of dQ.
// 0 where no key is visible (z = 0, and the accumulator is 0).
template <int D, bool CORR>
PT_INLINE void ftb_finish_rows(float (*acc)[8][4], const float (*b)[8][4], int hh, float z,
                               float corr) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = acc[c][j][2 * hh + e];
        x = z > 0.f ? (CORR ? x + corr * b[c][j][2 * hh + e] : x) / z : 0.f;
      }
}

template <class E, class O, int D>
PT_INLINE void ftb_bwd_q(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                         const typename E::T* d_o, const float* lse, float* delta, float* rowsum,
                         typename O::T* dq, const int* cu_q, const int* cu_kv, const int* off_q,
                         const int* off_kv, int b, int H, int Hkv, int tiles, float scale,
                         int mask, int wl, int wr, typename E::T* sm) {
  typedef FtbShape<D> S;
  const FtItem it = ft_item(pt_bid(), tiles, b, cu_q, cu_kv);
  const int tile = it.tile, slot = it.slot, h = it.head, lq = it.lq, lk = it.lk;
  const int row0 = tile * FT_BM;
  if (row0 >= lq) return;  // block-uniform
  const int hk = fb_kv_head(h, H / Hkv);
  const long long rq = (long long)H * D, rk = (long long)Hkv * D;
  const long long tq0 = off_q[slot];
  const typename E::T* qb = q + tq0 * rq + (long long)h * D;
  const typename E::T* ob = d_o + tq0 * rq + (long long)h * D;
  const typename E::T* kb = k + (long long)off_kv[slot] * rk + (long long)hk * D;
  const typename E::T* vb = v + (long long)off_kv[slot] * rk + (long long)hk * D;
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const int wrow = row0 + pt_lwarp() * 16;
  int lo_b, hi_b, unused;
  fb_range(row0, lq, lk, mask, wl, wr, lo_b, unused);
  fb_range((row0 + FT_BM < lq ? row0 + FT_BM : lq) - 1, lq, lk, mask, wl, wr, unused, hi_b);
  const float ninf = -pt_inf();
  int lo_r[2], hi_r[2];
  float lr[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = wrow + g + 8 * hh;
    fb_range(r, lq, lk, mask, wl, wr, lo_r[hh], hi_r[hh]);
    lr[hh] = r < lq ? lse[(tq0 + r) * H + h] : ninf;
    if (r >= lq || lr[hh] == ninf) lo_r[hh] = 1, hi_r[hh] = 0;  // nothing visible
  }
  // 0: two passes, exact D. 1: one pass, D_O from fb_bwd_delta. 2: one pass, D_O, with the
  // exact D and B = Σ e·K formed beside dQ (up to D = 128: at 256 B's 128 registers do not fit
  // beside dQ's, and the two passes stay); B's accumulator takes the registers of Q's and dO's
  // fragments, which are re-read.
  constexpr int MODE = FTB_D_FROM_O == 2 && D > 128 ? 0 : FTB_D_FROM_O;
  FtbFrags<D, (D <= 128 && MODE != 2)> xq, xo;
  xq.load(qb, rq, wrow, lq);
  xo.load(ob, rq, wrow, lq);
  typename E::T* ks = sm;
  typename E::T* vs = sm + S::BN * S::S;
  const int kt0 = lo_b <= hi_b ? (lo_b / S::BN) * S::BN : lk;
  float z[2] = {0.f, 0.f}, dd[2] = {0.f, 0.f};
  float acc[D / 64][8][4];
  float bacc[MODE == 2 ? D / 64 : 1][8][4];
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[c][j][e] = 0.f;
        if (MODE == 2) bacc[c][j][e] = 0.f;
      }
  if (MODE != 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = wrow + g + 8 * hh;
      dd[hh] = r < lq ? delta[(tq0 + r) * H + h] : 0.f;
    }
  }
  for (int pass = MODE != 0 ? 1 : 0; pass < 2; ++pass) {
    double dsum[2] = {0.0, 0.0};
    for (int kt = kt0; kt <= hi_b; kt += S::BN) {
      pt_sync();  // every warp done with the previous tile
      ftb_copy<E, D>(ks, kb + kt * rk, rk, lk - kt);
      ftb_copy<E, D>(vs, vb + kt * rk, rk, lk - kt);
      pt_cp_commit();
      pt_cp_wait<0>();
      pt_sync();
      float s[S::NT][4], dp[S::NT][4];
      float ep[MODE == 2 ? S::NT : 1][4];
      ftb_dots<E, D, S::NT>(s, xq, ks);
      ftb_dots<E, D, S::NT>(dp, xo, vs);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = kt + nt * 8 + 2 * t + e;
            const bool vis = key >= lo_r[hh] && key <= hi_r[hh];
            const float ex = vis ? pt_exp(pt_mul_rn(s[nt][2 * hh + e], scale) - lr[hh]) : 0.f;
            const float x = dp[nt][2 * hh + e];
            // Selects, not products with zero: a masked key's dP may be infinite.
            if (pass == 0 || MODE == 2) dsum[hh] += vis ? (double)ex * (double)x : 0.0;
            if (MODE == 2) ep[nt][2 * hh + e] = ex;
            if (pass == 0) {
              z[hh] += ex;
            } else {
              float p = ex;
              if (MODE == 0)
                p = z[hh] > 0.f ? ex / z[hh] : 0.f;
              else
                z[hh] += ex;
              s[nt][2 * hh + e] = vis ? p * (x - dd[hh]) : 0.f;
            }
          }
      if (pass == 1) {
        pt_u32 pa[S::BN / 16][4];
        float inv[S::BN / 16];
        const bool scaled = ftb_ds_scale<E, S::BN>(s, inv);
        ftb_pack<E, S::BN>(pa, s, FtbSat<E>());
        if (scaled)
          ftb_rows_mma<E, D, S::BN, true>(acc, pa, ks, inv);
        else
          ftb_rows_mma<E, D, S::BN>(acc, pa, ks);
        if (MODE == 2) {
          ftb_pack<E, S::BN>(pa, ep, FtbSame());
          ftb_rows_mma<E, D, S::BN>(bacc, pa, ks);
        }
      }
    }
    if (pass == 0 || MODE == 2) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        z[hh] = pt_quad_sum(z[hh]);
        const double ds = pt_quad_sum_d(dsum[hh]);
        const float exact = z[hh] > 0.f ? (float)(ds / (double)z[hh]) : 0.f;
        // dQ = Σ (e / Z)(dP - D) K = (Σ e (dP - D_O) K + (D_O - D) B) / Z (the header).
        if constexpr (MODE == 2) ftb_finish_rows<D, true>(acc, bacc, hh, z[hh], dd[hh] - exact);
        dd[hh] = exact;
        const int r = wrow + g + 8 * hh;
        if (t == 0 && r < lq) {
          delta[(tq0 + r) * H + h] = dd[hh];
          rowsum[(tq0 + r) * H + h] = z[hh];
        }
      }
    }
  }
  if constexpr (MODE == 1) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      z[hh] = pt_quad_sum(z[hh]);
      const int r = wrow + g + 8 * hh;
      if (t == 0 && r < lq) rowsum[(tq0 + r) * H + h] = z[hh];
      ftb_finish_rows<D, false>(acc, bacc, hh, z[hh], 0.f);
    }
  }
  ftb_store<E, O, D>(dq + tq0 * rq + (long long)h * D, rq, wrow, lq, acc, scale);
}

// What a key-side block accumulates: dV (bit 0), dK (bit 1).
#define FTB_DV 1
#define FTB_DK 2
// Key-side blocks per (kv head, slot, key tile): one up to D = 128; at D = 256 the two
// accumulators (128 registers each) cannot share a thread, so one block computes dV and another
// dK, each P again (the dK block dP too): 10 matrix products per (query, key) pair of the
// backward instead of 9.
template <int D>
struct FtbParts {
  static const int N = D > 128 ? 2 : 1;
};

template <class E, class O, int D, int PART>
PT_INLINE void ftb_bwd_kv_part(const FtItem& it, const typename E::T* q, const typename E::T* k,
                               const typename E::T* v, const typename E::T* d_o, const float* lse,
                               const float* delta, const float* rowsum, typename O::T* dk,
                               typename O::T* dv, const int* off_q, const int* off_kv, int H,
                               int Hkv, float scale, int mask, int wl, int wr, typename E::T* sm) {
  typedef FtbShape<D> S;
  const int tile = it.tile, slot = it.slot, hk = it.head, lq = it.lq, lk = it.lk;
  const int key0 = tile * FT_BM;
  const int group = H / Hkv;
  const long long rq = (long long)H * D, rk = (long long)Hkv * D;
  const long long tq0 = off_q[slot], tk0 = off_kv[slot];
  const typename E::T* kb = k + tk0 * rk + (long long)hk * D;
  const typename E::T* vb = v + tk0 * rk + (long long)hk * D;
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const int wkey = key0 + pt_lwarp() * 16;
  int r0, r1;
  fb_rows_seeing(key0, (key0 + FT_BM < lk ? key0 + FT_BM : lk) - 1, lq, lk, mask, wl, wr, r0, r1);
  const int qt0 = (r0 / S::BN) * S::BN;
  typename E::T* qs = sm;
  typename E::T* os = sm + S::BN * S::S;
  float* rowf = (float*)(sm + S::ELEMS);  // lse, D, Z of the tile's rows
  const float ninf = -pt_inf();
  // A part's unused accumulator is one element that nothing reads.
  float ak[(PART & FTB_DK) ? D / 64 : 1][8][4], av[(PART & FTB_DV) ? D / 64 : 1][8][4];
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr ((PART & FTB_DK) != 0) ak[c][j][e] = 0.f;
        if constexpr ((PART & FTB_DV) != 0) av[c][j][e] = 0.f;
      }
  for (int hh0 = 0; hh0 < group; ++hh0) {
    // This kernel walks its own group's heads (the planted head-index bug is in the query-major
    // kernels' decoding, fb_kv_head, so their lse disagrees with this kernel's P).
    const int h = hk * group + hh0;
    const typename E::T* qb = q + tq0 * rq + (long long)h * D;
    const typename E::T* ob = d_o + tq0 * rq + (long long)h * D;
    for (int qt = qt0; qt <= r1; qt += S::BN) {
      pt_sync();  // every warp done with the previous tile
      ftb_copy<E, D>(qs, qb + qt * rq, rq, lq - qt);
      ftb_copy<E, D>(os, ob + qt * rq, rq, lq - qt);
      pt_cp_commit();
      for (int i = pt_tid(); i < S::BN; i += FT_THREADS) {
        const int r = qt + i;
        const long long at = (tq0 + r) * H + h;
        rowf[i] = r < lq ? lse[at] : ninf;
        rowf[S::BN + i] = r < lq ? delta[at] : 0.f;
        rowf[2 * S::BN + i] = r < lq ? rowsum[at] : 0.f;
      }
      pt_cp_wait<0>();
      pt_sync();
      float s[S::NT][4], dp[(PART & FTB_DK) ? S::NT : 1][4];
      {
        FtbFrags<D> xk;
        xk.load(kb, rk, wkey, lk);
        ftb_dots<E, D, S::NT>(s, xk, qs);
      }
      if constexpr ((PART & FTB_DK) != 0) {
        FtbFrags<D> xv;
        xv.load(vb, rk, wkey, lk);
        ftb_dots<E, D, S::NT>(dp, xv, os);
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int c = wkey + g + 8 * hh;
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = nt * 8 + 2 * t + e, r = qt + i;
            int lo, hi;
            fb_range(r, lq, lk, mask, wl, wr, lo, hi);
            const float lr = rowf[i], Z = rowf[2 * S::BN + i];
            const bool vis = r < lq && c < lk && c >= lo && c <= hi && lr != ninf;
            const float ex = vis ? pt_exp(pt_mul_rn(s[nt][2 * hh + e], scale) - lr) : 0.f;
            const float p = Z > 0.f ? ex / Z : 0.f;
            s[nt][2 * hh + e] = vis ? p : 0.f;
            if constexpr ((PART & FTB_DK) != 0)
              dp[nt][2 * hh + e] = vis ? p * (dp[nt][2 * hh + e] - rowf[S::BN + i]) : 0.f;
          }
      }
      pt_u32 pa[S::BN / 16][4];
      if constexpr ((PART & FTB_DV) != 0) {
        ftb_pack<E, S::BN>(pa, s, FtbSame());
        ftb_rows_mma<E, D, S::BN>(av, pa, os);
      }
      if constexpr ((PART & FTB_DK) != 0) {
        float inv[S::BN / 16];
        const bool scaled = ftb_ds_scale<E, S::BN>(dp, inv);
        ftb_pack<E, S::BN>(pa, dp, FtbSat<E>());
        if (scaled)
          ftb_rows_mma<E, D, S::BN, true>(ak, pa, qs, inv);
        else
          ftb_rows_mma<E, D, S::BN>(ak, pa, qs);
      }
    }
  }
  if constexpr ((PART & FTB_DK) != 0)
    ftb_store<E, O, D>(dk + tk0 * rk + (long long)hk * D, rk, wkey, lk, ak, scale);
  if constexpr ((PART & FTB_DV) != 0)
    ftb_store<E, O, D>(dv + tk0 * rk + (long long)hk * D, rk, wkey, lk, av, 1.f);
}

// The key side's grid is (kv head, slot, key tile, part), part fastest (FtbParts).
template <class E, class O, int D>
PT_INLINE void ftb_bwd_kv(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                          const typename E::T* d_o, const float* lse, const float* delta,
                          const float* rowsum, typename O::T* dk, typename O::T* dv,
                          const int* cu_q, const int* cu_kv, const int* off_q, const int* off_kv,
                          int b, int H, int Hkv, int tiles, float scale, int mask, int wl, int wr,
                          typename E::T* sm) {
  const int parts = FtbParts<D>::N;
  const long long bid = pt_bid();
  const FtItem it = ft_item(bid / parts, tiles, b, cu_q, cu_kv);
  if (it.tile * FT_BM >= it.lk) return;  // block-uniform
  if constexpr (FtbParts<D>::N == 1) {
    ftb_bwd_kv_part<E, O, D, FTB_DV | FTB_DK>(it, q, k, v, d_o, lse, delta, rowsum, dk, dv, off_q,
                                              off_kv, H, Hkv, scale, mask, wl, wr, sm);
  } else if (bid % parts == 0) {
    ftb_bwd_kv_part<E, O, D, FTB_DV>(it, q, k, v, d_o, lse, delta, rowsum, dk, dv, off_q, off_kv,
                                     H, Hkv, scale, mask, wl, wr, sm);
  } else {
    ftb_bwd_kv_part<E, O, D, FTB_DK>(it, q, k, v, d_o, lse, delta, rowsum, dk, dv, off_q, off_kv,
                                     H, Hkv, scale, mask, wl, wr, sm);
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
// At D = 256 the P·V accumulator alone takes 128 registers: 2 blocks (255 registers at most).
#if defined(PT_CUDA) && FT_MIN_BLOCKS > 0
#define FT_BOUNDS(D) __launch_bounds__(FT_THREADS, (D) > 128 ? 2 : FT_MIN_BLOCKS)
#else
#define FT_BOUNDS(D)
#endif

#define FT_KERNEL(SUF, E, O, D)                                                                \
  PT_KERNEL FT_BOUNDS(D) void fallback_fwd_tc_##SUF##_d##D(                                        \
      const E::T* q, const E::T* k, const E::T* v, O::T* o, float* lse, const int* cu_q,         \
      const int* cu_kv, const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles,   \
      float scale, int mask, int wl, int wr) {                                                  \
    ft_fwd<E, O, D>(q, k, v, o, lse, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, tiles, scale, mask, \
                    wl, wr, (E::T*)fb_smem);                                                    \
  }
// The backward's blocks per multiprocessor: at D = 128 the query side holds Q and dO fragments,
// dQ and two score tiles (about 180 registers), so 3 blocks would spill. Re-reading the fragments
// instead (as at D = 256) fits the query side in 168 registers for 3 blocks, with 68-80 bytes of
// spill: 12 % slower on 512-token slots (long-scoreboard stalls 0.45 -> 2.04 per issue; H200,
// bench/NOTES.md v14).
#ifndef FTB_MIN_BLOCKS
#define FTB_MIN_BLOCKS 2
#endif
#if defined(PT_CUDA) && FTB_MIN_BLOCKS > 0
#define FTB_BOUNDS __launch_bounds__(FT_THREADS, FTB_MIN_BLOCKS)
#else
#define FTB_BOUNDS
#endif

#define FTB_KERNEL(SUF, E, O, D)                                                               \
  PT_KERNEL FTB_BOUNDS void fallback_bwd_q_tc_##SUF##_d##D(                                     \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      float* delta, float* rowsum, O::T* dq, const int* cu_q, const int* cu_kv,                 \
      const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles, float scale,       \
      int mask, int wl, int wr) {                                                               \
    ftb_bwd_q<E, O, D>(q, k, v, d_o, lse, delta, rowsum, dq, cu_q, cu_kv, off_q, off_kv, b, H,  \
                       Hkv, tiles, scale, mask, wl, wr, (E::T*)fb_smem);                        \
  }                                                                                             \
  PT_KERNEL FTB_BOUNDS void fallback_bwd_kv_tc_##SUF##_d##D(                                    \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      const float* delta, const float* rowsum, O::T* dk, O::T* dv, const int* cu_q,             \
      const int* cu_kv, const int* off_q, const int* off_kv, int b, int H, int Hkv, int tiles,  \
      float scale, int mask, int wl, int wr) {                                                  \
    ftb_bwd_kv<E, O, D>(q, k, v, d_o, lse, delta, rowsum, dk, dv, cu_q, cu_kv, off_q, off_kv,   \
                        b, H, Hkv, tiles, scale, mask, wl, wr, (E::T*)fb_smem);                 \
  }
#define FT_FWD_KERNELS(D)                \
  FT_KERNEL(bf16, BF16, BF16, D)         \
  FT_KERNEL(f16, F16, F16, D)            \
  FT_KERNEL(bf16_o32, BF16, F32, D)      \
  FT_KERNEL(f16_o32, F16, F32, D)
// The tiled backward's kernels are built for CUDA only. On HIP each of their 128 fragment
// products per tile is a MFMA wrapped in ds_bpermute moves (portable.h), and clang -O3 took
// 9 min 44 s on this file with them (52 s without) for gfx942: the HIP backend keeps the scalar
// backward. The host model (tests/hip_model) still runs ftb_bwd_q/ftb_bwd_kv on the MFMA branch.
#if defined(PT_CUDA) || defined(FTB_ON_HIP)
#define FTB_KERNELS(D)                   \
  FTB_KERNEL(bf16, BF16, BF16, D)        \
  FTB_KERNEL(f16, F16, F16, D)           \
  FTB_KERNEL(bf16_o32, BF16, F32, D)     \
  FTB_KERNEL(f16_o32, F16, F32, D)
#else
#define FTB_KERNELS(D)
#endif
#define FT_KERNELS(D)                    \
  FT_FWD_KERNELS(D)                      \
  FTB_KERNELS(D)
FT_KERNELS(64)
FT_KERNELS(128)
// CUDA only, as the tiled backward (above): clang -O3 for gfx942 took two minutes more on it.
#if defined(PT_CUDA) || defined(FTB_ON_HIP)
FT_KERNELS(256)
#endif


// Dropout's arguments by value, in args_of's order (src/backend/launch.rs).
#define FB_DROP_PARAMS \
  unsigned long long drop_seed, unsigned long long drop_offset, long long drop_keep_at, float drop_rescale
#define FB_DROP_ARG FbDrop{drop_seed, drop_offset, drop_keep_at, drop_rescale}
// The bias's tensor (or slopes) and its kind and dims, in args_of's order.
#define FB_BIAS_PARAMS \
  const float *bias, int bias_kind, int bias_b, int bias_h, int bias_sq, int bias_sk
#define FB_BIAS_ARG FbBias{bias, bias_kind, bias_b, bias_h, bias_sq, bias_sk}

#define FB_KERNELS(SUF, E, O)                                                                  \
  PT_KERNEL void fallback_fwd_##SUF(const E::T* q, const E::T* k, const E::T* v, O::T* o,       \
                                    float* lse, const int* cu_q, const int* cu_kv,              \
                                    const int* off_q, const int* off_kv, int b, int H, int Hkv, \
                                    int Dqk, int Dv, long long tq, float scale, int mask,       \
                                    int wl, int wr, FB_DROP_PARAMS, FB_BIAS_PARAMS) {           \
    fb_fwd<E, O>(q, k, v, o, lse, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, Dqk, Dv, tq, scale,    \
                 mask, wl, wr, FB_DROP_ARG, FB_BIAS_ARG, fb_smem);                              \
  }                                                                                             \
  PT_KERNEL void fallback_bwd_q_##SUF(                                                          \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      float* delta, float* rowsum, O::T* dq, const int* cu_q, const int* cu_kv, const int* off_q,              \
      const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tq, float scale,     \
      int mask, int wl, int wr, FB_DROP_PARAMS, FB_BIAS_PARAMS) {                               \
    fb_bwd_q<E, O>(q, k, v, d_o, lse, delta, rowsum, dq, cu_q, cu_kv, off_q, off_kv, b, H, Hkv, Dqk,    \
                   Dv, tq, scale, mask, wl, wr, FB_DROP_ARG, FB_BIAS_ARG, fb_smem);             \
  }                                                                                             \
  PT_KERNEL void fallback_bwd_kv_##SUF(                                                         \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      const float* delta, const float* rowsum, O::T* dk, O::T* dv, const int* cu_q,             \
      const int* cu_kv,                                                                         \
      const int* off_q, const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv, long long tk, \
      float scale, int mask, int wl, int wr, FB_DROP_PARAMS, FB_BIAS_PARAMS) {                  \
    fb_bwd_kv<E, O>(q, k, v, d_o, lse, delta, rowsum, dk, dv, cu_q, cu_kv, off_q, off_kv, b, H, Hkv,    \
                    Dqk, Dv, tk, scale, mask, wl, wr, FB_DROP_ARG, FB_BIAS_ARG, fb_smem);       \
  }                                                                                             \
  PT_KERNEL void fallback_bwd_delta_##SUF(const E::T* o, const E::T* d_o, float* delta,         \
                                         const int* cu_q, const int* cu_kv, const int* off_q,  \
                                         const int* off_kv, int b, int H, int Dv, long long tq) { \
    fb_bwd_delta<E>(o, d_o, delta, cu_q, cu_kv, off_q, off_kv, b, H, Dv, tq);                   \
  }                                                                                             \
  PT_KERNEL void fallback_dbias_##SUF(                                                          \
      const E::T* q, const E::T* k, const E::T* v, const E::T* d_o, const float* lse,           \
      const float* delta, const float* rowsum, O::T* dbias, const int* cu_q, const int* cu_kv,  \
      const int* off_q, const int* off_kv, int b, int H, int Hkv, int Dqk, int Dv,              \
      long long rows, float scale, int mask, int wl, int wr, FB_DROP_PARAMS, FB_BIAS_PARAMS) {  \
    fb_dbias<E, O>(q, k, v, d_o, lse, delta, rowsum, dbias, cu_q, cu_kv, off_q, off_kv, b, H,    \
                   Hkv, Dqk, Dv, rows, scale, mask, wl, wr, FB_DROP_ARG, FB_BIAS_ARG);          \
  }

FB_KERNELS(bf16, BF16, BF16)
FB_KERNELS(f16, F16, F16)
FB_KERNELS(f32, F32, F32)
FB_KERNELS(bf16_o32, BF16, F32)
FB_KERNELS(f16_o32, F16, F32)
