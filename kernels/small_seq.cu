// Small-seq fused attention (docs/semantics.md §1, profile native §3.1): slots of at most 17 query and 17
// key tokens, H == Hkv, D in {64, 128, 256}, bf16/f16, every mask of §1.5, window (-1,-1).
//
// One 32-lane logical warp per (slot, head) work item, 4 per block, a 1-D grid over items (no
// 65,535 cap). Q, K, V, dO are loaded straight from global memory into matrix fragments with
// 16-byte loads: the reduction dimension of Q·Kᵀ is permuted identically for both operands
// (lane t of a quad owns dims 8t..8t+7 of each 32-dim chunk), and the n dimension of P·V is
// permuted so that each lane ends with 16 consecutive output dims. Rows and keys past the slot
// are zero fragments and are never read. No atomics, no shared memory: deterministic.
//
// Numerics (te-smallseq-path.md §4, without its defects): f32 accumulation of exact 16-bit
// products; scale applied once after the dot product and rounded there (pt_mul_rn: contracted
// into exp(fma(dot, scale, -lse)) the backward's P of a one-key row is 1 - O(ulp(s) / 1) instead
// of 1, which on large scores gives its exactly-zero gradients O(dP · 1e-5) garbage); P = exp(s - m) / l in f32, rounded to the
// input type before P·V and dV; D = Σ P·dP from the recomputed f32 P = exp(s - lse); dS rounded
// (saturating at the largest finite value) before dQ/dK; scale applied after accumulation of dQ/dK; outputs rounded at store; lse f32
// natural log; a row with no visible key gets o = 0, lse = -inf and contributes nothing.
#include "portable.h"

#define SS_WPB 4
// Blocks per multiprocessor the register allocation must allow (CUDA): the kernels are
// memory-bound, and more resident warps keep more loads in flight.
#ifndef SS_FWD_BLOCKS
#define SS_FWD_BLOCKS 4
#endif
#ifndef SS_BWD_BLOCKS
#define SS_BWD_BLOCKS 3
#endif
// The same for the kernels of one-query launches (suffix _q1), whose code is the one-query
// path alone (SS_ONE_QUERY bit 2). 6 and 4 with two chunks in flight (SS_Q1_UNROLL) beat 8 and
// 5 with one on W4, forward and backward (bench/NOTES.md v25, v26).
#ifndef SS_Q1_FWD_BLOCKS
#define SS_Q1_FWD_BLOCKS 6
#endif
#ifndef SS_Q1_BWD_BLOCKS
#define SS_Q1_BWD_BLOCKS 4
#endif
// L2 prefetch of the rows later phases read (ss_prefetch), per direction. The backward's is
// on since two campaigns with 0 failures (82,889 cases) and clean sanitizers on the small-seq
// path (bench/NOTES.md v23, v24).
#ifndef SS_PREFETCH_FWD
#define SS_PREFETCH_FWD 1
#endif
#ifndef SS_PREFETCH_BWD
#define SS_PREFETCH_BWD 1
#endif
// Q·Kᵀ chunks of 32 dims unrolled together: the next chunk's loads in flight during the mma.
// 2 costs 4 bytes of spill (fwd d128/d256 within 4 blocks per SM, bwd d64 within 3; ptxas
// 12.9, sm_90) and is still 8-16 % faster than 1 (H200, bench/NOTES.md v5).
#ifndef SS_XYT_UNROLL
#define SS_XYT_UNROLL 2
#endif
// Softmax (forward) and P/dS (backward) only over the tiles the item fills: row tile 1 holds
// query 16 and key tile 2 keys 16-23, dead for slots of at most 16 tokens per side (a
// warp-uniform test). Scores of a dead tile stay the zeros ss_xyt left there, which pack to
// P = 0 and dS = 0, and stay out of the row's max and sum. Bit 0 skips the dead row tile, bit
// 1 the dead key tile; SS_SKIP_DEAD_TILES sets both directions. The backward skips both (faster
// than neither everywhere on the H200, and fuzzed there: bench/NOTES.md v7), the forward the
// row tile alone: 3-7 % faster than both in v7, the key tile's skip spilling 28-36 bytes at
// d128/d256 (fuzzed on the device in v13). Bit 2 skips the softmax (forward) or P and dS
// (backward) of rows 8-15 of the first row tile when the slot has at most 8 queries: those
// rows' Q and dO fragments were zero, so their S and dP are 0 and pack to P = dS = 0, what the
// skipped code gives a row without a visible key, and they are never stored (W2 -2 %, W4's
// backward -3 % on the H200; fuzzed 10 minutes there: bench/NOTES.md v15, v16).
#ifdef SS_SKIP_DEAD_TILES
#define SS_SKIP_DEAD_FWD SS_SKIP_DEAD_TILES
#define SS_SKIP_DEAD_BWD SS_SKIP_DEAD_TILES
#endif
#ifndef SS_SKIP_DEAD_FWD
#define SS_SKIP_DEAD_FWD 5
#endif
#ifndef SS_SKIP_DEAD_BWD
#define SS_SKIP_DEAD_BWD 7
#endif
#define SS_DEAD_IN(bits, it, mt, nt)               \
  ((((bits) & 1) && (mt) == 1 && (it).lq <= 16) || \
   (((bits) & 2) && (nt) == 2 && (it).lk <= 16))
// The 8 rows hh of row tile mt, dead under the skip bits: all of tile 1 (bit 0), or rows 8-15
// of tile 0 for a slot of at most 8 queries (bit 2).
#define SS_DEAD_ROWS(bits, it, mt, hh) \
  (SS_DEAD_IN(bits, it, mt, 0) || (((bits) & 4) && (mt) == 0 && (hh) == 1 && (it).lq <= 8))
#define SS_PRAGMA(x) _Pragma(#x)
#define SS_UNROLL(n) SS_PRAGMA(unroll n)
#ifdef PT_CUDA
#define SS_BOUNDS(N) __launch_bounds__(SS_WPB * PT_LWARP_THREADS, N)
#else
#define SS_BOUNDS(N)
#endif

// Planted bugs of the mutation catalogue (src/mutants.rs), compiled in only when the harness
// asks for one (`SMALLSEQ_MUTANT_*` defines): the same names as the CPU backend's mutants, so
// a GPU campaign's power can be measured with the kernels themselves.
PT_INLINE float ss_scaled(float dot, float scale) {
#ifdef SMALLSEQ_MUTANT_SCALE_TWICE
  return pt_mul_rn(pt_mul_rn(dot, scale), scale);
#else
  return pt_mul_rn(dot, scale);
#endif
}

PT_INLINE float ss_lse(float mx, float sum) {
#ifdef SMALLSEQ_MUTANT_LSE_LOG2
  return (mx + pt_log(sum)) * 1.44269504f;
#else
  return mx + pt_log(sum);
#endif
}

PT_INLINE bool ss_visible(int r, int c, int lq, int lk, int mask) {
  if (r >= lq || c >= lk) return false;
#ifdef SMALLSEQ_MUTANT_CAUSAL_IGNORED
  mask = 0;
#endif
  if (mask == 1) return c <= r;
  if (mask == 2) return c <= r + (lk - lq);
  return true;
}

// Planted faults for the worker-process tests: a kernel that writes far outside any
// allocation, traps, or never returns, on a 7-token query (the cases the CPU worker's
// SMALLSEQ_MUTANT_FAULT picks). A campaign must give that case a crash or hang verdict and
// judge every other case.
template <class T>
PT_INLINE void ss_planted_fault(int lq, T* o) {
#if defined(SMALLSEQ_MUTANT_OOB_WRITE)
  if (lq == 7) o[-(1LL << 40)] = o[0];
#elif defined(SMALLSEQ_MUTANT_TRAP)
  if (lq == 7) {
#if defined(PT_CUDA)
    __trap();
#else
    __builtin_trap();
#endif
  }
#elif defined(SMALLSEQ_MUTANT_HANG)
  // A sleep the compiler must keep: an empty spin loop may be assumed to terminate.
  if (lq == 7) {
    for (;;) {
#if defined(PT_CUDA)
      __nanosleep(1000000);
#else
      __builtin_amdgcn_s_sleep(127);
#endif
    }
  }
#else
  (void)lq;
  (void)o;
#endif
}

// dQ's store multiplier: the scale, or (planted bug, issue 21) the scale biased by 1.5 ulps
// of E (3 unit roundoffs: bf16 3·2^-8, f16 3·2^-11).
template <class E>
PT_INLINE float ss_dq_mul(float scale) {
#ifdef SMALLSEQ_MUTANT_DQ_ULP_BIAS
  return scale * (E::KIND == 0 ? 1.01171875f : E::KIND == 1 ? 1.00146484375f : 1.f);
#else
  return scale;
#endif
}

// The head whose K and V rows query head h reads (H == Hkv on this path): h itself, or
// (planted bug, issue 18) h through a 4-bit head field, so heads 16 and above read heads 0-15.
// Only K and V are read through it: Q, dO, the outputs and lse keep the item's own head, as the
// CPU mutant's kv head does.
PT_INLINE int ss_kv_head(int h) {
#ifdef SMALLSEQ_MUTANT_HEAD_INDEX_ABOVE_16
  return h & 15;
#else
  return h;
#endif
}

// Whether key tile nt takes part in the forward's row maximum: every tile, or (planted bug,
// issue 18) the first 16 keys only, as if the max were taken before the third 8-key tile
// (keys 16-23) was loaded. Harmless until key 17's logit exceeds the first tile's maximum by
// enough (about 88) to overflow exp.
PT_INLINE bool ss_in_row_max(int nt) {
#ifdef SMALLSEQ_MUTANT_SOFTMAX_FIRST_TILE_MAX
  return nt < 2;
#else
  (void)nt;
  return true;
#endif
}

// dS of an item brought into E's range before it is rounded to E as a matrix operand
// (reference/src/ds_scale.rs, issue 33), once the item's vote says some dS lies past it (the
// rare path; an item in range computes exactly what the unscaled design did): each 16 x 16
// block (row tile mt, keys 16kt..16kt+15, that is nt = 2kt and 2kt + 1) whose largest finite
// |dS| lies past E's largest finite value is multiplied by the least power of two that brings
// it under, and inv[mt][kt] (its inverse) scales the block's f32 products back, exactly. Then
// saturated, for an infinite dS: one key's +inf with another's -inf made the row's dQ NaN
// (fuzz seed 2027, case 1923). Saturated alone, an f16 dS of 91,248 lost the cancellation of
// dQ = dS·K and stored +inf for -0.045 (H200 seed 2102, case 37242).
template <class E>
PT_INLINE void ss_ds_scale(float (&ds)[2][3][4], float (&inv)[2][2]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      float mb = 0.f;
#pragma unroll
      for (int nt = 2 * kt; nt < 3 && nt < 2 * kt + 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mb = pt_fmax(mb, pt_finite_abs(ds[mt][nt][e]));
      const float sc = pt_range_scale<E>(pt_lwarp_max(mb));
      inv[mt][kt] = 1.f / sc;
#pragma unroll
      for (int nt = 2 * kt; nt < 3 && nt < 2 * kt + 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[mt][nt][e] = pt_sat<E>(ds[mt][nt][e] * sc);
    }
}

#ifndef SS_SCALED_SPLIT
#ifdef PT_HIP
#define SS_SCALED_SPLIT 0
#else
#define SS_SCALED_SPLIT 1
#endif
#endif

// Whether dS past E's range must go through ss_ds_scale: a |dS| past 65,504 or +-inf. Planted
// bug (issue 18): for f16 never, so such a dS rounds to +-inf.
template <class E>
PT_INLINE bool ss_ds_past_range(float ds) {
#ifdef SMALLSEQ_MUTANT_F16_DS_UNCLAMPED
  if (E::KIND == 1) return false;
#endif
  return pt_past_range<E>(ds);
}

// An output value about to be stored: unchanged (the store rounds it to nearest-even), or
// (planted bug, issue 18) already rounded to E toward zero, which the store then keeps (the
// value is representable). Overflow gives E's largest finite value instead of ±inf.
template <class E>
PT_INLINE float ss_out_round(float x) {
#ifdef SMALLSEQ_MUTANT_ROUND_TOWARD_ZERO
  const pt_u16 h = E::from_f(x);
  const float r = E::to_f(h);
  // Nearest-even went away from zero: one step back (both types are sign-magnitude, so the
  // magnitude's bit pattern less one is the next value toward zero; inf becomes the largest).
  const bool away = (r < 0.f ? -r : r) > (x < 0.f ? -x : x);
  return away ? E::to_f((pt_u16)(h - 1)) : r;
#else
  return x;
#endif
}

struct SsItem {
  int lq, lk, h;
  long long oq, ok;
};

// SS_ITEM32=1 decodes items with a 32-bit division where b·H fits 32 bits (every launch but a
// grid of over 4e9 items): the 64-bit one is a called routine of tens of instructions per item,
// on kernels bound by the instructions they issue (no time measured beyond noise, no register
// added: bench/NOTES.md v15; fuzzed 10 minutes on the H200 with the other defaults, v16).
#ifndef SS_ITEM32
#define SS_ITEM32 1
#endif

// Decodes the warp's work item; false when there is nothing to do (warp-uniform).
PT_INLINE bool ss_item(SsItem& it, const int* cu_q, const int* cu_kv, const int* off_q,
                       const int* off_kv, int b, int H) {
  long long item = pt_bid() * SS_WPB + pt_lwarp();
  if (item >= (long long)b * H) return false;
  int slot;
  if (SS_ITEM32 && (long long)b * H <= 0xffffffffLL) {  // uniform over the grid
    const unsigned u = (unsigned)item, uh = (unsigned)H;
    slot = (int)(u / uh);
    it.h = (int)(u - (unsigned)slot * uh);
  } else {
    slot = (int)(item / H);
    it.h = (int)(item % H);
  }
  it.lq = cu_q[slot + 1] - cu_q[slot];
  it.lk = cu_kv[slot + 1] - cu_kv[slot];
  it.oq = off_q[slot];
  it.ok = off_kv[slot];
  return true;
}

// Asks L2 for the first n rows of Y (row stride rs): a later phase of the item reads them, and
// without the hint its loads wait for memory a second time after the first phase's did.
template <class E, int D>
PT_INLINE void ss_prefetch(const typename E::T* y, long long rs, int n) {
  const int LINES = D * (int)sizeof(typename E::T) / 128;  // 128-byte lines per row
  for (int i = pt_llane(); i < n * LINES; i += 32) pt_prefetch(y + (i / LINES) * rs + (i % LINES) * 64);
}

// The K and V rows of an item, asked of L2 where `on` (SS_PREFETCH_FWD / _BWD).
template <class E, int D>
PT_INLINE void ss_prefetch_kv(bool on, const typename E::T* k, const typename E::T* v,
                              long long rs, int lk) {
  if (!on) return;
  ss_prefetch<E, D>(k, rs, lk);
  ss_prefetch<E, D>(v, rs, lk);
}

// Accumulates S = X·Yᵀ over D for rows of X (up to 32) and rows of Y (up to 24) into
// acc[mt][nt][4]; X rows past nx and Y rows past ny are zero and not read.
template <class E, int D>
PT_INLINE void ss_xyt(float (&acc)[2][3][4], const typename E::T* x, const typename E::T* y,
                      long long rs, int nx, int ny) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const bool m1 = nx > 16, n2 = ny > 16;
  SS_UNROLL(SS_XYT_UNROLL)
  for (int ch = 0; ch < D / 32; ++ch) {
    pt_v4 xa[2][2], yb[3];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        int row = mt * 16 + hh * 8 + g;
        xa[mt][hh] = row < nx ? pt_ld16(x + row * rs + ch * 32 + t * 8) : pt_zero4();
      }
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
      int key = nt * 8 + g;
      yb[nt] = key < ny ? pt_ld16(y + key * rs + ch * 32 + t * 8) : pt_zero4();
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if (mt == 1 && !m1) continue;
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) {
          if (nt == 2 && !n2) continue;
          // Each 16-product step starts from zero and is added with an f32 round-to-nearest add:
          // chained through the tensor core's accumulator (not round-to-nearest) the score
          // drifted 4 ulp from the f64 value at D = 256 (fuzz seed 11, case 1477).
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          pt_mma<E>(part, pt_word(xa[mt][0], 2 * j), pt_word(xa[mt][1], 2 * j),
                    pt_word(xa[mt][0], 2 * j + 1), pt_word(xa[mt][1], 2 * j + 1),
                    pt_word(yb[nt], 2 * j), pt_word(yb[nt], 2 * j + 1));
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += part[e];
        }
      }
  }
}

// A fragments (rows x keys, two 16-key steps) of a C-layout matrix p[mt][nt][4].
template <class E>
PT_INLINE void ss_afrag(pt_u32 (&a)[2][2][4], const float (&p)[2][3][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    a[mt][0][0] = E::pack2(p[mt][0][0], p[mt][0][1]);
    a[mt][0][1] = E::pack2(p[mt][0][2], p[mt][0][3]);
    a[mt][0][2] = E::pack2(p[mt][1][0], p[mt][1][1]);
    a[mt][0][3] = E::pack2(p[mt][1][2], p[mt][1][3]);
    a[mt][1][0] = E::pack2(p[mt][2][0], p[mt][2][1]);
    a[mt][1][1] = E::pack2(p[mt][2][2], p[mt][2][3]);
    a[mt][1][2] = 0u;
    a[mt][1][3] = 0u;
  }
}

// out[o][D] = F[o][r] · Y[r][D] for F held as A fragments f[ot][rt] (16-row output tile ot,
// 16-wide reduction tile rt); Y rows past ny are zero and not read; stored (times mul) for
// output rows < nout. The output tiles run one after the other: tile 1 holds only row 16 of a
// 17-token side, and holding both accumulators at once cost 32 registers per lane (occupancy)
// for that one row; tile 1 re-reads Y from cache instead.
// SCALED: f holds dS blocks scaled into E's range, inv[ot][rt] their inverse scales
// (ss_ds_scale); a separate instantiation, so the unscaled path is the code it always was.
template <class E, class O, int D, bool SCALED = false>
PT_INLINE void ss_fy(const pt_u32 (&f)[2][2][4], const typename E::T* y, long long rs, int ny,
                     int nout, typename O::T* out, float mul, const float (&inv)[2][2]) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
#pragma unroll 1
  for (int c64 = 0; c64 < D / 64; ++c64)
#pragma unroll
    for (int ot = 0; ot < 2; ++ot) {
      if (ot == 1 && nout <= 16) continue;
      float acc[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
      for (int rt = 0; rt < 2; ++rt) {
        if (rt == 1 && ny <= 16) continue;
        const typename E::T* yb = y + c64 * 64 + g * 8;
        const int r0 = rt * 16 + 2 * t;
        pt_v4 v0 = r0 < ny ? pt_ld16(yb + r0 * rs) : pt_zero4();
        pt_v4 v1 = r0 + 1 < ny ? pt_ld16(yb + (r0 + 1) * rs) : pt_zero4();
        pt_v4 v8 = r0 + 8 < ny ? pt_ld16(yb + (r0 + 8) * rs) : pt_zero4();
        pt_v4 v9 = r0 + 9 < ny ? pt_ld16(yb + (r0 + 9) * rs) : pt_zero4();
        // A block scaled into E's range (ss_ds_scale): the accumulator joins its scale for
        // the block's products and leaves it after; powers of two, so both steps are exact.
        const float bi = SCALED ? inv[ot][rt] : 1.f;
        if (SCALED && bi != 1.f) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] *= 1.f / bi;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
          pt_mma<E>(acc[j], f[ot][rt][0], f[ot][rt][1], f[ot][rt][2], f[ot][rt][3],
                    pt_bsel(v0, v1, j), pt_bsel(v8, v9, j));
        if (SCALED && bi != 1.f) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] *= bi;
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = ot * 16 + hh * 8 + g;
        if (row < nout) {
          float x[16];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            x[i] = acc[i][hh * 2];
            x[i + 8] = acc[i][hh * 2 + 1];
          }
#ifdef SMALLSEQ_MUTANT_ROUND_TOWARD_ZERO
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] = ss_out_round<E>(x[i] * mul);
          pt_store16<E, O>(out + row * rs + c64 * 64 + t * 16, x, 1.f);
#else
          pt_store16<E, O>(out + row * rs + c64 * 64 + t * 16, x, mul);
#endif
        }
      }
    }
}

// out[keys][D] = Aᵀ[keys][rows] · Y[rows][D], where a holds A (rows x keys) as A fragments.
// inv[mt][kk]: the blocks' inverse scales as ss_ds_scale gives them (A's layout), read where
// SCALED (ss_fy).
template <class E, class O, int D, bool SCALED = false>
PT_INLINE void ss_aty(const pt_u32 (&a)[2][2][4], const typename E::T* y, long long rs, int ny,
                      int nkeys, typename O::T* out, float mul, const float (&inv)[2][2]) {
  pt_u32 at[2][2][4];
  const float invt[2][2] = {{inv[0][0], inv[1][0]}, {inv[0][1], inv[1][1]}};
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      at[kk][mt][0] = pt_trans8(a[mt][kk][0]);
      at[kk][mt][1] = pt_trans8(a[mt][kk][2]);
      at[kk][mt][2] = pt_trans8(a[mt][kk][1]);
      at[kk][mt][3] = pt_trans8(a[mt][kk][3]);
    }
  ss_fy<E, O, D, SCALED>(at, y, rs, ny, nkeys, out, mul, invt);
}

// o = P·V from P in the C layout (ss_afrag), for output rows < nout.
template <class E, class O, int D>
PT_INLINE void ss_pv_tiled(const float (&s)[2][3][4], const typename E::T* vr, long long rs,
                           int lk, int nout, typename O::T* orow) {
  pt_u32 pa[2][2][4];
  ss_afrag<E>(pa, s);
  const float unscaled[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // P needs no block scale
  ss_fy<E, O, D>(pa, vr, rs, lk, nout, orow, 1.f, unscaled);
}

// dQ = dS·K·scale, dK = dSᵀ·Q·scale and dV = Pᵀ·dO from P (s) and dS (ds) in the C layout, dS's
// blocks scaled by the inverses inv where `scaled` (ss_ds_scale). Both instantiations
// (SS_SCALED_SPLIT) or the scaled one alone, which computes the same for blocks of scale 1 with
// a test per block: clang's gfx942 build of small_seq.cu took 180 s with both against 104 s
// before them, so HIP keeps one.
template <class E, class O, int D>
PT_INLINE void ss_grads_tiled(const float (&s)[2][3][4], const float (&ds)[2][3][4],
                              const float (&inv)[2][2], bool scaled, const typename E::T* qrow,
                              const typename E::T* dorow, const typename E::T* kr, long long rs,
                              int lq, int lk, typename O::T* dq, typename O::T* dk,
                              typename O::T* dv, float scale) {
  pt_u32 pa[2][2][4], da[2][2][4];
  ss_afrag<E>(pa, s);
  ss_afrag<E>(da, ds);
  if (!SS_SCALED_SPLIT || scaled) {
    ss_fy<E, O, D, true>(da, kr, rs, lk, lq, dq, ss_dq_mul<E>(scale), inv);
    ss_aty<E, O, D, true>(da, qrow, rs, lq, lk, dk, scale, inv);
  } else {
    ss_fy<E, O, D>(da, kr, rs, lk, lq, dq, ss_dq_mul<E>(scale), inv);
    ss_aty<E, O, D>(da, qrow, rs, lq, lk, dk, scale, inv);
  }
  const float unscaled[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // P needs no block scale
  ss_aty<E, O, D>(pa, dorow, rs, lq, lk, dv, 1.f, unscaled);
}


// Items of one query. Bit 0 (since bench/NOTES.md v16: W4's forward 1,622 -> 1,195 µs on the
// H200): W4's forward (one query per slot) issued 1,772 warp instructions per item,
// instruction-bound at 39 % of copy (ncu, v14), the tiles leaving 15 of their 16 rows empty; o =
// Σ_j P_j·V_j is formed lane-parallel instead: lane l owns dims l*DL..l*DL+DL-1 (DL = D/32) of
// every V row and of o, takes each P from the lane that holds it, rounds it to E, and adds the
// exact products in f32 in key order. Bit 1 does the same for the backward's gradients
// (ss_bwd_one) at D <= 128. Bit 2 takes a one-query item's scores with the keys as the matrix
// product's rows (ss_q1_dots: a third of the tiled layout's products at D = 128) in both
// directions, and launches whose slots all hold one query run the _q1 kernels, which hold that
// code alone (bench/NOTES.md v25: W4's forward 1,224 -> 997 µs, its backward 3,576 -> 2,131 µs on
// an H100). Without bit 2 the item keeps the tiled scores and softmax of its one row. At
// D = 256 the general kernels load the rows of P·V one key at a time (batches spill, see
// ss_each_key_row), the _q1 kernels SS_Q1_KB / 2 at a time.
#ifndef SS_ONE_QUERY
#define SS_ONE_QUERY 7
#endif
// 8 aligned bytes (a lane's 4 dims at D = 128).
struct alignas(8) SsW2 {
  pt_u32 x, y;
};

// The D/64 words (2 values each) of a lane's dims of one row.
template <int D>
PT_INLINE void ss_lane_dims(pt_u32 (&w)[D / 64], const pt_u16* row) {
  const pt_u16* p = row + pt_llane() * (D / 32);
  if constexpr (D == 64) {
    w[0] = *(const pt_u32*)p;
  } else if constexpr (D == 128) {
    const SsW2 x = *(const SsW2*)p;
    w[0] = x.x, w[1] = x.y;
  } else {
    const pt_v4 x = pt_ld16(p);
#pragma unroll
    for (int i = 0; i < D / 64; ++i) w[i] = pt_word(x, i);
  }
}

// Keys per batch of ss_each_key_row: in the kernels for any launch, every key at D <= 128 and
// one at D = 256 (see below); in the _q1 kernels, whose registers allow more warps,
// SS_Q1_KB at D <= 128 and half that at D = 256.
#define SS_KEY_BATCH(D) ((D) <= 128 ? 17 : 1)
#ifndef SS_Q1_KB
#define SS_Q1_KB 8
#endif
#define SS_Q1_KEY_BATCH(D) ((D) <= 128 ? SS_Q1_KB : (SS_Q1_KB > 1 ? SS_Q1_KB / 2 : 1))
// The batch of a kernel for any launch (Q1 false) or of a _q1 kernel.
#define SS_KEY_BATCH_OF(D, Q1) ((Q1) ? SS_Q1_KEY_BATCH(D) : SS_KEY_BATCH(D))
// Calls f(j, w) for each key j < lk of a one-query item (lk <= 17), w being the lane's D/64
// words of row j of `rows`; f takes key j's P or dS from ss_row0_key. The rows of a batch are
// all loaded before f sees the first: a loop that loaded key j after the products of key j - 1
// waited one global-load latency per key (ncu, bench/NOTES.md v15: 30 % of the W4 forward's
// stall samples). A batch holds every key at D <= 128 (2 words a row); at D = 256 a batch of
// even 2 keys made ptxas spill 40 bytes in the f16 forward, so there each key is loaded alone.
template <int D, int KB, class F>
PT_INLINE void ss_each_key_row(const pt_u16* rows, long long rs, int lk, F&& f) {
  // Warp-uniform exits. clang for gfx942 left the D = 256 loop (17 trips) rolled when they were
  // breaks, and s[j / 8][j % 2] with a run-time j went to scratch (112 bytes in the forward,
  // 208 in the backward); with guards it unrolls and uses none. NVRTC is the other way round:
  // guards made ptxas spill 40-44 bytes at D = 128 and 256, breaks 4.
#ifdef PT_HIP
#define SS_KEY_EXIT(c) if (c) continue
#else
#define SS_KEY_EXIT(c) if (c) break
#endif
#pragma unroll
  for (int j0 = 0; j0 < 17; j0 += KB) {
    SS_KEY_EXIT(j0 >= lk);
    pt_u32 w[KB][D / 64];
#pragma unroll
    for (int jj = 0; jj < KB; ++jj)
      if (j0 + jj < lk) ss_lane_dims<D>(w[jj], rows + (j0 + jj) * rs);
#pragma unroll
    for (int jj = 0; jj < KB; ++jj) {
      SS_KEY_EXIT(j0 + jj >= lk);
      f(j0 + jj, w[jj]);
    }
  }
#undef SS_KEY_EXIT
}

// Key j's value in row 0 of s (C layout: quad 0's lane t holds keys nt*8 + 2t + e in
// s[0][nt][e]), rounded to E as the tiled path's operand fragments round it.
template <class E>
PT_INLINE float ss_row0_key(const float (&s)[2][3][4], int j) {
  const int half = pt_lane() & ~31;  // this logical warp's lanes in the hardware warp (HIP: 64)
  return E::round(pt_shfl(s[0][j / 8][j % 2], half | ((j % 8) / 2)));
}

// Value i (of 2 per word) of a lane's words.
template <class E, int N>
PT_INLINE float ss_word_val(const pt_u32 (&w)[N], int i) {
  return i % 2 ? pt_hi<E>(w[i / 2]) : pt_lo<E>(w[i / 2]);
}

// Stores a lane's N consecutive values of a row (rounded to E) in one vector access where the
// output type allows: as N element stores they were N 2-byte accesses per lane and row, the
// one-query backward's dK and dV rows 17 times over. p lies on N elements' bytes (rows on 16).
template <class E, class O, int N>
PT_INLINE void ss_store_dims(typename O::T* p, const float (&x)[N]) {
  constexpr int W = O::IS16 ? N / 2 : N;  // 32-bit words
  pt_u32 w[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if constexpr (O::IS16)
      w[i] = E::pack2(x[2 * i], x[2 * i + 1]);
    else
      w[i] = pt_f2u(E::round(x[i]));
  }
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int c = 0; c < W / 4; ++c) {
      pt_v4 v;
      v.x = w[4 * c], v.y = w[4 * c + 1], v.z = w[4 * c + 2], v.w = w[4 * c + 3];
      pt_st16((pt_u32*)p + 4 * c, v);
    }
  } else if constexpr (W == 2) {
    SsW2 v;
    v.x = w[0], v.y = w[1];
    *(SsW2*)p = v;
  } else {
    *(pt_u32*)p = w[0];
  }
}

// o (one row) = Σ_j P_j·V_j with key j's P from pj(j) (rounded to E); V rows past lk are not
// read.
template <class E, class O, int D, int KB, class PJ>
PT_INLINE void ss_pv_one(PJ&& pj, const typename E::T* vr, long long rs, int lk,
                         typename O::T* orow) {
  float acc[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = 0.f;
  ss_each_key_row<D, KB>((const pt_u16*)vr, rs, lk, [&](int j, const pt_u32 (&w)[D / 64]) {
    const float p = pj(j);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] += pt_mul_rn(p, ss_word_val<E>(w, i));
  });
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = ss_out_round<E>(acc[i]);
  ss_store_dims<E, O, D / 32>(orow + pt_llane() * (D / 32), acc);
}

// The gradients of a one-query item from its P and dS (pj(j), gj(j): key j's, rounded to E as
// an operand, gj's times its block's inverse scale where dS was scaled): dV_j = P_j·dO and
// dK_j = dS_j·q·scale are one exact product per element, which is what the tiled path's
// 16-row products give when 15 rows are zero (the leading 0 + keeps a zero's sign as theirs:
// +0); dQ = Σ_j dS_j·K_j·scale adds the exact products in f32 in key order, as ss_pv_one does.
template <class E, class O, int D, int KB, class PJ, class GJ>
PT_INLINE void ss_bwd_one(PJ&& pj, GJ&& gj, const typename E::T* qrow,
                          const typename E::T* dorow, const typename E::T* kr, long long rs,
                          int lk, typename O::T* dq, typename O::T* dk, typename O::T* dv,
                          float scale) {
  const int d0 = pt_llane() * (D / 32);
  pt_u32 qw[D / 64], ow[D / 64];
  ss_lane_dims<D>(qw, (const pt_u16*)qrow);
  ss_lane_dims<D>(ow, (const pt_u16*)dorow);
  float acc[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = 0.f;
  ss_each_key_row<D, KB>((const pt_u16*)kr, rs, lk, [&](int j, const pt_u32 (&w)[D / 64]) {
    // dS as its block's operand is worth (ss_ds_scale): the 16-bit value times a power of
    // two, exact in f32, and so is its product with a 16-bit K or Q value.
    const float p = pj(j), g = gj(j);
    float dki[D / 32], dvi[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      acc[i] += pt_mul_rn(g, ss_word_val<E>(w, i));
      dki[i] = ss_out_round<E>((0.f + pt_mul_rn(g, ss_word_val<E>(qw, i))) * scale);
      dvi[i] = ss_out_round<E>(0.f + pt_mul_rn(p, ss_word_val<E>(ow, i)));
    }
    ss_store_dims<E, O, D / 32>(dk + j * rs + d0, dki);
    ss_store_dims<E, O, D / 32>(dv + j * rs + d0, dvi);
  });
  const float mul = ss_dq_mul<E>(scale);
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = ss_out_round<E>(acc[i] * mul);
  ss_store_dims<E, O, D / 32>(dq + d0, acc);
}

// Scores of one-query items with the keys as the matrix product's rows (SS_ONE_QUERY bit 2):
// the A operand is 16 key rows, B the query as column 0 of 8 (the other columns zero), so one
// m16n8k16 covers 16 keys where the tiled layout (one live query row of 16) needed two, and
// key 16 takes a second product only in a 17-key slot. The reduction dimension is permuted
// and summed in 16-product steps exactly as ss_xyt does. Column 0 of C lands in the lanes of
// t = 0: lane 4g holds key g in x[0] and key g + 8 in x[1], lane 0 key 16 in x[2] (other lanes
// hold their zero columns). Both directions take a one-query item's S here, so the backward's
// P = exp(s - lse) of a one-key row is exactly 1 (the forward's lse came from the same bits).
// Chunks of 32 dims whose loads are in flight together: 2 made ptxas spill 28 bytes in the
// _q1 forward at 8 blocks per SM (64 registers), none at 6 (64-76 of the 80 allowed). gfx942
// keeps 1: the gain is CUDA's (v26), unmeasured on AMD, and 2 added 10 s to the code object's
// compile, which is on CI's critical path.
#ifndef SS_Q1_UNROLL
#ifdef PT_HIP
#define SS_Q1_UNROLL 1
#else
#define SS_Q1_UNROLL 2
#endif
#endif
template <class E, int D>
PT_INLINE void ss_q1_dots(float (&x)[3], const typename E::T* qrow, const typename E::T* y,
                          long long rs, int ny) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const bool k16 = ny > 16;  // warp-uniform
  x[0] = x[1] = x[2] = 0.f;
  SS_UNROLL(SS_Q1_UNROLL)
  for (int ch = 0; ch < D / 32; ++ch) {
    const int off = ch * 32 + t * 8;
    const pt_v4 ka = g < ny ? pt_ld16(y + g * rs + off) : pt_zero4();
    const pt_v4 kb = g + 8 < ny ? pt_ld16(y + (g + 8) * rs + off) : pt_zero4();
    const pt_v4 kc = k16 && g == 0 ? pt_ld16(y + 16 * rs + off) : pt_zero4();
    const pt_v4 qb = g == 0 ? pt_ld16(qrow + off) : pt_zero4();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // Each 16-product step from zero, added with an f32 round-to-nearest add (ss_xyt).
      float part[4] = {0.f, 0.f, 0.f, 0.f};
      pt_mma<E>(part, pt_word(ka, 2 * j), pt_word(kb, 2 * j), pt_word(ka, 2 * j + 1),
                pt_word(kb, 2 * j + 1), pt_word(qb, 2 * j), pt_word(qb, 2 * j + 1));
      x[0] += part[0];
      x[1] += part[2];
      if (k16) {
        float p16[4] = {0.f, 0.f, 0.f, 0.f};
        pt_mma<E>(p16, pt_word(kc, 2 * j), 0u, pt_word(kc, 2 * j + 1), 0u, pt_word(qb, 2 * j),
                  pt_word(qb, 2 * j + 1));
        x[2] += p16[0];
      }
    }
  }
}

// Key j's value in the layout of ss_q1_dots, rounded to E as an operand.
template <class E>
PT_INLINE float ss_q1_key(const float (&x)[3], int j) {
  const int half = pt_lane() & ~31;
  return E::round(pt_shfl(x[j / 8], half | 4 * (j % 8)));
}

// Key i of the lane's three in the layout of ss_q1_dots (keys of lanes t != 0 lie past 17).
PT_INLINE int ss_q1_key_of(int i) {
  const int l = pt_llane();
  return (l & 3) ? 32 : 8 * i + (l >> 2);
}

// A one-query row in ss_q1_dots' layout moved into the tiled C layout (row 0: quad 0's lane t
// holds keys nt*8 + 2t + e in c[0][nt][e]; every other row zero), for the tiled P·V and
// gradient products.
PT_INLINE void ss_q1_to_tiled(float (&c)[2][3][4], const float (&x)[3]) {
  const int half = pt_lane() & ~31, l = pt_llane(), g = l >> 2, t = l & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = mt == 0 && e < 2 ? pt_shfl(x[nt], half | 4 * (2 * t + e)) : 0.f;
        c[mt][nt][e] = g == 0 ? v : 0.f;
      }
}

// The forward of a one-query item (rows at qrow, kr, vr, orow; lse at lse_at) from the scores
// of ss_q1_dots: the row's softmax over the 8 lanes of t = 0, then P·V lane-parallel
// (SS_ONE_QUERY bit 0) or through the tiled products.
template <class E, class O, int D, int KB>
PT_INLINE void ss_fwd_q1(const typename E::T* qrow, const typename E::T* kr,
                         const typename E::T* vr, typename O::T* orow, float* lse_at,
                         long long rs, int lk, float scale, int mask) {
  float x[3];
  ss_q1_dots<E, D>(x, qrow, kr, rs, lk);
  const float ninf = -pt_inf();
  float mx = ninf;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const int key = ss_q1_key_of(i);
    x[i] = ss_visible(0, key, 1, lk, mask) ? ss_scaled(x[i], scale) : ninf;
    if (ss_in_row_max(i)) mx = pt_fmax(mx, x[i]);
  }
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) mx = pt_fmax(mx, pt_shfl_xor(mx, m));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    x[i] = x[i] == ninf ? 0.f : pt_exp(x[i] - mx);
    sum += x[i];
  }
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) sum += pt_shfl_xor(sum, m);
  const float rcp = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int i = 0; i < 3; ++i) x[i] = sum > 0.f ? x[i] * rcp : 0.f;
  if (pt_llane() == 0) *lse_at = sum > 0.f ? ss_lse(mx, sum) : ninf;
  if (SS_ONE_QUERY & 1) {
    ss_pv_one<E, O, D, KB>([&](int j) { return ss_q1_key<E>(x, j); }, vr, rs, lk, orow);
    return;
  }
  float s[2][3][4];
  ss_q1_to_tiled(s, x);
  ss_pv_tiled<E, O, D>(s, vr, rs, lk, 1, orow);
}

// The backward of a one-query item: S and dP from ss_q1_dots, P and dS over the 8 lanes of
// t = 0 (dS brought into E's range per 16-key block as ss_ds_scale does, where the item's vote
// says some dS lies past it), then the gradients lane-parallel (SS_ONE_QUERY bit 1, D <= 128)
// or through the tiled products.
template <class E, class O, int D, int KB>
PT_INLINE void ss_bwd_q1(const typename E::T* qrow, const typename E::T* kr,
                         const typename E::T* vr, const typename E::T* dorow, float lr,
                         typename O::T* dq, typename O::T* dk, typename O::T* dv, long long rs,
                         int lk, float scale, int mask) {
  float p[3], ds[3];
  ss_q1_dots<E, D>(p, qrow, kr, rs, lk);
  ss_q1_dots<E, D>(ds, dorow, vr, rs, lk);
  const float ninf = -pt_inf();
  float dsum = 0.f;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const bool vis = ss_visible(0, ss_q1_key_of(i), 1, lk, mask) && lr != ninf;
    p[i] = vis ? pt_exp(ss_scaled(p[i], scale) - lr) : 0.f;
    dsum += p[i] * ds[i];
  }
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) dsum += pt_shfl_xor(dsum, m);
  bool past = false;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    ds[i] = p[i] * (ds[i] - dsum);
    past |= ss_ds_past_range<E>(ds[i]);
  }
  float inv[2] = {1.f, 1.f};
  const bool scaled = pt_lwarp_any(past);  // warp-uniform
  if (scaled) {
    // The blocks of ss_ds_scale: keys 0-15, and key 16.
    const float sc0 = pt_range_scale<E>(
        pt_lwarp_max(pt_fmax(pt_finite_abs(ds[0]), pt_finite_abs(ds[1]))));
    const float sc1 = pt_range_scale<E>(pt_lwarp_max(pt_finite_abs(ds[2])));
    inv[0] = 1.f / sc0, inv[1] = 1.f / sc1;
    ds[0] = pt_sat<E>(ds[0] * sc0), ds[1] = pt_sat<E>(ds[1] * sc0);
    ds[2] = pt_sat<E>(ds[2] * sc1);
  }
  if ((SS_ONE_QUERY & 2) && D <= 128) {
    const auto pj = [&](int j) { return ss_q1_key<E>(p, j); };
    ss_bwd_one<E, O, D, KB>(
        pj, [&](int j) { return ss_q1_key<E>(ds, j) * inv[j / 16]; }, qrow, dorow, kr, rs, lk,
        dq, dk, dv, scale);
    return;
  }
  float s[2][3][4], dp[2][3][4];
  ss_q1_to_tiled(s, p);
  ss_q1_to_tiled(dp, ds);
  const float invt[2][2] = {{inv[0], inv[1]}, {1.f, 1.f}};
  ss_grads_tiled<E, O, D>(s, dp, invt, scaled, qrow, dorow, kr, rs, 1, lk, dq, dk, dv, scale);
}

// The forward of an item of more than one query (or of one, without SS_ONE_QUERY bit 2): the
// tiled scores, softmax and P·V.
template <class E, class O, int D>
PT_INLINE void ss_fwd_rows(const SsItem& it, const typename E::T* q, const typename E::T* k,
                           const typename E::T* v, typename O::T* o, float* lse, int H,
                           long long hq, long long hk, float scale, int mask) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const long long rs = (long long)H * D;
  float s[2][3][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
  ss_prefetch_kv<E, D>(SS_PREFETCH_FWD, k + hk, v + hk, rs, it.lk);
  ss_xyt<E, D>(s, q + hq, k + hk, rs, it.lq, it.lk);
  const bool one = (SS_ONE_QUERY & 1) && it.lq == 1;  // warp-uniform
  const float ninf = -pt_inf();
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (SS_DEAD_ROWS(SS_SKIP_DEAD_FWD, it, mt, hh) || (one && (mt | hh))) continue;
      const int row = mt * 16 + hh * 8 + g;
      float mx = ninf;
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (SS_DEAD_IN(SS_SKIP_DEAD_FWD, it, mt, nt)) continue;
          const int key = nt * 8 + 2 * t + e;
          float x = ss_scaled(s[mt][nt][hh * 2 + e], scale);
          x = ss_visible(row, key, it.lq, it.lk, mask) ? x : ninf;
          s[mt][nt][hh * 2 + e] = x;
          if (ss_in_row_max(nt)) mx = pt_fmax(mx, x);
        }
      mx = pt_quad_max(mx);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (SS_DEAD_IN(SS_SKIP_DEAD_FWD, it, mt, nt)) continue;
          float x = s[mt][nt][hh * 2 + e];
          float ex = x == ninf ? 0.f : pt_exp(x - mx);
          s[mt][nt][hh * 2 + e] = ex;
          sum += ex;
        }
      sum = pt_quad_sum(sum);
      const float rcp = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (SS_DEAD_IN(SS_SKIP_DEAD_FWD, it, mt, nt)) continue;
          float ex = s[mt][nt][hh * 2 + e];
          s[mt][nt][hh * 2 + e] = sum > 0.f ? ex * rcp : 0.f;
        }
      if (t == 0 && row < it.lq)
        lse[(it.oq + row) * H + it.h] = sum > 0.f ? ss_lse(mx, sum) : ninf;
    }
  if (one) {
    ss_pv_one<E, O, D, SS_KEY_BATCH(D)>([&](int j) { return ss_row0_key<E>(s, j); }, v + hk, rs,
                                        it.lk, o + hq);
    return;
  }
  ss_pv_tiled<E, O, D>(s, v + hk, rs, it.lk, it.lq, o + hq);
}

// Q1: the kernel of launches whose slots all hold at most one query (small_seq_*_q1): with
// SS_ONE_QUERY bit 2 it holds the one-query code alone, so its registers allow more warps.
template <class E, class O, int D, bool Q1 = false>
PT_INLINE void ss_fwd(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                      typename O::T* o, float* lse, const int* cu_q, const int* cu_kv,
                      const int* off_q, const int* off_kv, int b, int H, float scale, int mask) {
  SsItem it;
  if (!ss_item(it, cu_q, cu_kv, off_q, off_kv, b, H) || it.lq <= 0) return;
  ss_planted_fault(it.lq, o);
  const long long rs = (long long)H * D;
  const long long hq = it.oq * rs + (long long)it.h * D;
  const long long hk = it.ok * rs + (long long)ss_kv_head(it.h) * D;
  if ((SS_ONE_QUERY & 4) && it.lq == 1) {  // warp-uniform
    ss_prefetch_kv<E, D>(SS_PREFETCH_FWD, k + hk, v + hk, rs, it.lk);
    ss_fwd_q1<E, O, D, SS_KEY_BATCH_OF(D, Q1)>(q + hq, k + hk, v + hk, o + hq,
                                              lse + it.oq * H + it.h, rs, it.lk, scale, mask);
    return;
  }
  // The _q1 kernels leave the other items out (the launch's max_lq said there are none).
  if constexpr (!(Q1 && (SS_ONE_QUERY & 4)))
    ss_fwd_rows<E, O, D>(it, q, k, v, o, lse, H, hq, hk, scale, mask);
}

// Planted bug (issue 21): dK of the slot's last key left zero in the last head.
template <class O, int D>
PT_INLINE void ss_planted_zeroed_row(const SsItem& it, int H, typename O::T* dk, long long rs) {
#ifdef SMALLSEQ_MUTANT_ZEROED_SMALL_ROW
  pt_syncwarp();
  if (it.h == H - 1 && it.lk >= 2)
    for (int d = pt_llane(); d < D; d += 32) O::store(dk + (it.lk - 1) * rs, d, 0.f);
#else
  (void)it, (void)H, (void)dk, (void)rs;
#endif
}

// The backward of an item of more than one query (or of one, without SS_ONE_QUERY bit 2): the
// tiled scores, P, dS and gradients.
template <class E, class O, int D>
PT_INLINE void ss_bwd_rows(const SsItem& it, const typename E::T* q, const typename E::T* k,
                           const typename E::T* v, const typename E::T* d_o, const float* lse,
                           typename O::T* dq, typename O::T* dk, typename O::T* dv, int H,
                           long long hq, long long hk, long long hkr, float scale, int mask) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  const long long rs = (long long)H * D;
  float s[2][3][4], dp[2][3][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.f;
#if SS_PREFETCH_BWD
  ss_prefetch<E, D>(d_o + hq, rs, it.lq);
  ss_prefetch<E, D>(v + hkr, rs, it.lk);
#endif
  ss_xyt<E, D>(s, q + hq, k + hkr, rs, it.lq, it.lk);
  ss_xyt<E, D>(dp, d_o + hq, v + hkr, rs, it.lq, it.lk);
  const bool one = (SS_ONE_QUERY & 2) && D <= 128 && it.lq == 1;  // warp-uniform
  const float ninf = -pt_inf();
  bool past = false;  // a dS of this lane past E's range (ss_ds_past_range)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (SS_DEAD_ROWS(SS_SKIP_DEAD_BWD, it, mt, hh) || (one && (mt | hh))) continue;
      const int row = mt * 16 + hh * 8 + g;
      const float lr = row < it.lq ? lse[(it.oq + row) * H + it.h] : ninf;
      float dsum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (SS_DEAD_IN(SS_SKIP_DEAD_BWD, it, mt, nt)) continue;
          const int key = nt * 8 + 2 * t + e;
          const bool vis = ss_visible(row, key, it.lq, it.lk, mask) && lr != ninf;
          float p = vis ? pt_exp(ss_scaled(s[mt][nt][hh * 2 + e], scale) - lr) : 0.f;
          s[mt][nt][hh * 2 + e] = p;
          dsum += p * dp[mt][nt][hh * 2 + e];
        }
      dsum = pt_quad_sum(dsum);
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (SS_DEAD_IN(SS_SKIP_DEAD_BWD, it, mt, nt)) continue;
          float p = s[mt][nt][hh * 2 + e];
          const float ds = p * (dp[mt][nt][hh * 2 + e] - dsum);
          past |= ss_ds_past_range<E>(ds);
          dp[mt][nt][hh * 2 + e] = ds;
        }
    }
  float inv[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
  const bool scaled = pt_lwarp_any(past);  // warp-uniform
  if (scaled) ss_ds_scale<E>(dp, inv);
  if (one) {
    // As ss_grads_tiled: the scaled instantiation where dS was scaled or the split is off.
    const auto pj = [&](int j) { return ss_row0_key<E>(s, j); };
    if (!SS_SCALED_SPLIT || scaled)
      ss_bwd_one<E, O, D, SS_KEY_BATCH(D)>(
          pj, [&](int j) { return ss_row0_key<E>(dp, j) * inv[0][j / 16]; }, q + hq, d_o + hq,
          k + hkr, rs, it.lk, dq + hq, dk + hk, dv + hk, scale);
    else
      ss_bwd_one<E, O, D, SS_KEY_BATCH(D)>(
          pj, [&](int j) { return ss_row0_key<E>(dp, j); }, q + hq, d_o + hq, k + hkr, rs, it.lk,
          dq + hq, dk + hk, dv + hk, scale);
  } else {
    ss_grads_tiled<E, O, D>(s, dp, inv, scaled, q + hq, d_o + hq, k + hkr, rs, it.lq, it.lk,
                            dq + hq, dk + hk, dv + hk, scale);
  }
}

template <class E, class O, int D, bool Q1 = false>
PT_INLINE void ss_bwd(const typename E::T* q, const typename E::T* k, const typename E::T* v,
                      const typename E::T* d_o, const float* lse, typename O::T* dq,
                      typename O::T* dk, typename O::T* dv, const int* cu_q, const int* cu_kv,
                      const int* off_q, const int* off_kv, int b, int H, float scale, int mask) {
  SsItem it;
  if (!ss_item(it, cu_q, cu_kv, off_q, off_kv, b, H)) return;
  const int l = pt_llane();
  const long long rs = (long long)H * D;
  // hk: where this head's dK and dV rows go; hkr: the K and V rows it reads.
  const long long hq = it.oq * rs + (long long)it.h * D, hk = it.ok * rs + (long long)it.h * D;
  const long long hkr = it.ok * rs + (long long)ss_kv_head(it.h) * D;
  if (it.lq <= 0) {
    // Keys of a slot without queries get zero gradients (written, so no row is left unset).
    for (int key = 0; key < it.lk; ++key)
      for (int d = l; d < D; d += 32) {
        O::store(dk + hk + key * rs, d, 0.f);
        O::store(dv + hk + key * rs, d, 0.f);
      }
    return;
  }
  if ((SS_ONE_QUERY & 4) && it.lq == 1) {  // warp-uniform
    ss_prefetch_kv<E, D>(SS_PREFETCH_BWD, k + hkr, v + hkr, rs, it.lk);
    ss_bwd_q1<E, O, D, SS_KEY_BATCH_OF(D, Q1)>(q + hq, k + hkr, v + hkr, d_o + hq,
                                              lse[it.oq * H + it.h], dq + hq, dk + hk, dv + hk,
                                              rs, it.lk, scale, mask);
  } else if constexpr (!(Q1 && (SS_ONE_QUERY & 4))) {
    // The _q1 kernels leave the other items out (the launch's max_lq said there are none).
    ss_bwd_rows<E, O, D>(it, q, k, v, d_o, lse, dq, dk, dv, H, hq, hk, hkr, scale, mask);
  }
  ss_planted_zeroed_row<O, D>(it, H, dk + hk, rs);
}

#define SS_FWD(NAME, E, O, D, Q1, BLOCKS)                                                      \
  PT_KERNEL SS_BOUNDS(BLOCKS) void NAME(const E::T* q, const E::T* k, const E::T* v, O::T* o,   \
                                        float* lse, const int* cu_q, const int* cu_kv,          \
                                        const int* off_q, const int* off_kv, int b, int H,      \
                                        float scale, int mask) {                                \
    ss_fwd<E, O, D, Q1>(q, k, v, o, lse, cu_q, cu_kv, off_q, off_kv, b, H, scale, mask);        \
  }
#define SS_BWD(NAME, E, O, D, Q1, BLOCKS)                                                      \
  PT_KERNEL SS_BOUNDS(BLOCKS) void NAME(const E::T* q, const E::T* k, const E::T* v,            \
                                        const E::T* d_o, const float* lse, O::T* dq, O::T* dk,  \
                                        O::T* dv, const int* cu_q, const int* cu_kv,            \
                                        const int* off_q, const int* off_kv, int b, int H,      \
                                        float scale, int mask) {                                \
    ss_bwd<E, O, D, Q1>(q, k, v, d_o, lse, dq, dk, dv, cu_q, cu_kv, off_q, off_kv, b, H, scale, \
                        mask);                                                                  \
  }
// Each kernel twice: for any launch, and (suffix _q1) for a launch whose slots all hold at
// most one query (W4's shape: TE's cross-attention of one query token per sequence).
#define SS_PAIR(NAME, E, O, D)                                 \
  SS_FWD(small_seq_fwd_##NAME, E, O, D, false, SS_FWD_BLOCKS)  \
  SS_FWD(small_seq_fwd_##NAME##_q1, E, O, D, true, SS_Q1_FWD_BLOCKS) \
  SS_BWD(small_seq_bwd_##NAME, E, O, D, false, SS_BWD_BLOCKS)  \
  SS_BWD(small_seq_bwd_##NAME##_q1, E, O, D, true, SS_Q1_BWD_BLOCKS)
#define SS_ALL(D)                             \
  SS_PAIR(bf16_d##D, BF16, BF16, D)           \
  SS_PAIR(f16_d##D, F16, F16, D)              \
  SS_PAIR(bf16_d##D##_o32, BF16, F32, D)      \
  SS_PAIR(f16_d##D##_o32, F16, F32, D)

SS_ALL(64)
SS_ALL(128)
SS_ALL(256)
