// portable.h: the one place that knows whether kernels are built for CUDA (NVRTC, no host
// headers) or HIP (clang -x hip --cuda-device-only -nogpulib -nogpuinc, no HIP headers).
//
// Kernel bodies use only what is defined here: element load/store as float (bf16, f16, f32),
// packed 16-bit pairs, thread/block ids, barriers, warp shuffles and reductions, and the
// "fragment" primitives of a 32-lane logical warp (an m16n8k16 matrix multiply-accumulate and
// an 8x8 16-bit transpose). On CUDA sm_80+ the fragment primitives are tensor-core
// instructions; on gfx90a/gfx94x/gfx950 the multiply-accumulate runs on the matrix cores
// (v_mfma, see "Matrix cores" below); elsewhere both are emulated with shuffles inside a 32-lane
// logical warp, with the same data layout, so the same kernel body runs on a 64-wide wavefront.
//
// Logical warps and wavefronts: a kernel that uses the fragment primitives takes its work item
// from pt_lwarp(). On CUDA a logical warp is a hardware warp (32 threads). On HIP it is a whole
// 64-lane wavefront whose two 32-lane halves are replicas: both halves run the same work item on
// the same data, so every branch the body takes on per-item values (lengths, empty slots, the
// grid tail) is uniform across the wavefront. The matrix cores need that: an MFMA reads its
// operands from all 64 lanes, and a lane switched off by a divergent branch would feed it stale
// registers. The replicas compute bitwise-identical values, so their duplicate stores are
// harmless. The launch gives such kernels 64 threads per work item on HIP, 32 on CUDA.
#pragma once

#if defined(__HIP__) || defined(__HIPCC__) || defined(__AMDGCN__)
#define PT_HIP 1
#else
#define PT_CUDA 1
#endif

typedef unsigned int pt_u32;
typedef unsigned short pt_u16;
typedef unsigned long long pt_u64;

#ifdef PT_HIP
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
// 64-lane wavefronts (gfx9 / CDNA). A wave32 target (RDNA's default) would break every
// cross-lane index here, so it is refused at compile time.
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "portable.h needs 64-lane wavefronts (gfx90a, gfx942, gfx950; or -mwavefrontsize64)"
#endif
#define PT_WARP 64
#define PT_LWARP_THREADS 64
#define PT_INLINE __device__ inline __attribute__((always_inline))
// 256 threads: four 64-lane logical warps (small-seq) or wavefronts (fallback) per block. A host
// model of the kernels (tests/hip_model) predefines it empty: the attribute needs a GPU target.
#ifndef PT_HIP_KERNEL_ATTR
#define PT_HIP_KERNEL_ATTR __attribute__((amdgpu_flat_work_group_size(1, 256)))
#endif
#define PT_KERNEL extern "C" __global__ PT_HIP_KERNEL_ATTR
PT_INLINE int pt_tid() { return (int)__builtin_amdgcn_workitem_id_x(); }
PT_INLINE long long pt_bid() { return (long long)__builtin_amdgcn_workgroup_id_x(); }
PT_INLINE void pt_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
PT_INLINE void pt_syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
PT_INLINE float pt_u2f(pt_u32 u) { return __builtin_bit_cast(float, u); }
PT_INLINE pt_u32 pt_f2u(float f) { return __builtin_bit_cast(pt_u32, f); }
PT_INLINE float pt_exp(float x) { return __builtin_expf(x); }
PT_INLINE float pt_log(float x) { return __builtin_logf(x); }
PT_INLINE float pt_inf() { return __builtin_inff(); }
PT_INLINE float pt_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
PT_INLINE float pt_fmin(float a, float b) { return __builtin_fminf(a, b); }
// a * b rounded to f32 and never fused into a neighbouring add: the empty asm makes the product
// opaque, whatever -ffp-contract says.
PT_INLINE float pt_mul_rn(float a, float b) {
  float r = a * b;
  __asm__ volatile("" : "+v"(r));
  return r;
}
PT_INLINE int pt_lane() { return pt_tid() & (PT_WARP - 1); }
// Value of `v` held by lane `src` of this wavefront.
PT_INLINE pt_u32 pt_shfl_u(pt_u32 v, int src) {
  return (pt_u32)__builtin_amdgcn_ds_bpermute(src << 2, (int)v);
}
PT_INLINE double pt_shfl_d(double v, int src) {
  pt_u64 b = __builtin_bit_cast(pt_u64, v);
  pt_u32 lo = pt_shfl_u((pt_u32)b, src), hi = pt_shfl_u((pt_u32)(b >> 32), src);
  return __builtin_bit_cast(double, (pt_u64)lo | ((pt_u64)hi << 32));
}
PT_INLINE float pt_f16_to_f(pt_u16 h) {
  _Float16 x = __builtin_bit_cast(_Float16, h);
  return (float)x;
}
PT_INLINE pt_u16 pt_f_to_f16(float f) {
  _Float16 x = (_Float16)f;  // round to nearest even
  return __builtin_bit_cast(pt_u16, x);
}
#else  // CUDA / NVRTC
#define PT_WARP 32
#define PT_LWARP_THREADS 32
#define PT_INLINE __device__ __forceinline__
#define PT_KERNEL extern "C" __global__
PT_INLINE int pt_tid() { return (int)threadIdx.x; }
PT_INLINE long long pt_bid() { return (long long)blockIdx.x; }
PT_INLINE void pt_sync() { __syncthreads(); }
PT_INLINE void pt_syncwarp() { __syncwarp(); }
PT_INLINE float pt_u2f(pt_u32 u) { return __uint_as_float(u); }
PT_INLINE pt_u32 pt_f2u(float f) { return __float_as_uint(f); }
PT_INLINE float pt_exp(float x) { return expf(x); }
PT_INLINE float pt_log(float x) { return logf(x); }
PT_INLINE float pt_inf() { return __uint_as_float(0x7f800000u); }
PT_INLINE float pt_fmax(float a, float b) { return fmaxf(a, b); }
PT_INLINE float pt_fmin(float a, float b) { return fminf(a, b); }
// a * b rounded to f32 and never contracted into an FMA with a following add.
PT_INLINE float pt_mul_rn(float a, float b) { return __fmul_rn(a, b); }
PT_INLINE int pt_lane() { return (int)(threadIdx.x & 31); }
PT_INLINE pt_u32 pt_shfl_u(pt_u32 v, int src) { return __shfl_sync(0xffffffffu, v, src); }
PT_INLINE double pt_shfl_d(double v, int src) {
  long long b = __double_as_longlong(v);
  pt_u32 lo = pt_shfl_u((pt_u32)b, src), hi = pt_shfl_u((pt_u32)((pt_u64)b >> 32), src);
  return __longlong_as_double((long long)((pt_u64)lo | ((pt_u64)hi << 32)));
}
PT_INLINE float pt_f16_to_f(pt_u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
PT_INLINE pt_u16 pt_f_to_f16(float f) {
  pt_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

// Index of this thread's logical warp in the block (see the header).
PT_INLINE int pt_lwarp() { return pt_tid() / PT_LWARP_THREADS; }

PT_INLINE float pt_shfl(float v, int src) { return pt_u2f(pt_shfl_u(pt_f2u(v), src)); }
PT_INLINE float pt_shfl_xor(float v, int m) { return pt_shfl(v, pt_lane() ^ m); }

// Reductions over the whole hardware warp / wavefront.
PT_INLINE float pt_warp_sum(float v) {
  for (int m = PT_WARP / 2; m > 0; m >>= 1) v += pt_shfl_xor(v, m);
  return v;
}
PT_INLINE double pt_warp_sum_d(double v) {
  for (int m = PT_WARP / 2; m > 0; m >>= 1) v += pt_shfl_d(v, pt_lane() ^ m);
  return v;
}
PT_INLINE float pt_warp_max(float v) {
  for (int m = PT_WARP / 2; m > 0; m >>= 1) v = pt_fmax(v, pt_shfl_xor(v, m));
  return v;
}
// The largest value over this thread's logical warp (its 32 lanes; on HIP half a wavefront).
PT_INLINE float pt_lwarp_max(float v) {
  for (int m = PT_LWARP_THREADS / 2; m > 0; m >>= 1) v = pt_fmax(v, pt_shfl_xor(v, m));
  return v;
}
// Reductions over the 4 lanes of a quad (the lanes sharing a fragment row).
PT_INLINE float pt_quad_max(float x) {
  x = pt_fmax(x, pt_shfl_xor(x, 1));
  return pt_fmax(x, pt_shfl_xor(x, 2));
}
PT_INLINE float pt_quad_sum(float x) {
  x += pt_shfl_xor(x, 1);
  return x + pt_shfl_xor(x, 2);
}

// ---------------------------------------------------------------------------------------------
// Element types. Every kernel is a template over an element type E with
//   E::T           storage type, E::load(p, i) -> float, E::store(p, i, float) (round to E)
//   E::round(x)    x rounded to E, returned as float
//   E::pack2(a, b) two values rounded to a 16-bit pair (a in the low half), for fragments
//   E::IS16        whether fragment (16-bit) primitives apply
// and an output type O (the element type itself, or F32 holding values already rounded).

PT_INLINE pt_u16 pt_f_to_bf16(float f) {
  pt_u32 u = pt_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (pt_u16)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (pt_u16)(u >> 16);
}
PT_INLINE float pt_bf16_to_f(pt_u16 h) { return pt_u2f(((pt_u32)h) << 16); }

struct BF16 {
  typedef pt_u16 T;
  static const bool IS16 = true;
  static const int KIND = 0;
  PT_INLINE static float to_f(pt_u16 h) { return pt_bf16_to_f(h); }
#ifdef SMALLSEQ_MUTANT_NAN_ON_OVERFLOW  // planted bug (issue 21): NaN where ±inf is owed
  PT_INLINE static pt_u16 from_f(float f) {
    const pt_u16 h = pt_f_to_bf16(f);
    return (h & 0x7fffu) == 0x7f80u ? (pt_u16)0x7fc0u : h;
  }
#else
  PT_INLINE static pt_u16 from_f(float f) { return pt_f_to_bf16(f); }
#endif
  PT_INLINE static float load(const T* p, long long i) { return to_f(p[i]); }
  PT_INLINE static void store(T* p, long long i, float x) { p[i] = from_f(x); }
  PT_INLINE static float round(float x) { return to_f(from_f(x)); }
  PT_INLINE static pt_u32 pack2(float a, float b) {
    return (pt_u32)from_f(a) | ((pt_u32)from_f(b) << 16);
  }
  static constexpr float MAXF = 3.38953139e38f;
};

struct F16 {
  typedef pt_u16 T;
  static const bool IS16 = true;
  static const int KIND = 1;
  PT_INLINE static float to_f(pt_u16 h) { return pt_f16_to_f(h); }
#ifdef SMALLSEQ_MUTANT_NAN_ON_OVERFLOW
  PT_INLINE static pt_u16 from_f(float f) {
    const pt_u16 h = pt_f_to_f16(f);
    return (h & 0x7fffu) == 0x7c00u ? (pt_u16)0x7e00u : h;
  }
#else
  PT_INLINE static pt_u16 from_f(float f) { return pt_f_to_f16(f); }
#endif
  PT_INLINE static float load(const T* p, long long i) { return to_f(p[i]); }
  PT_INLINE static void store(T* p, long long i, float x) { p[i] = from_f(x); }
  PT_INLINE static float round(float x) { return to_f(from_f(x)); }
  PT_INLINE static pt_u32 pack2(float a, float b) {
    return (pt_u32)from_f(a) | ((pt_u32)from_f(b) << 16);
  }
  static constexpr float MAXF = 65504.f;
};

// x clamped to E's finite range (NaN stays NaN), so that rounding it to E cannot overflow.
template <class E>
PT_INLINE float pt_sat(float x) {
  return x != x ? x : pt_fmin(pt_fmax(x, -E::MAXF), E::MAXF);
}

// The least power of two 2^-k (k >= 0) that brings a finite m to at most E's largest finite
// value; 1 when m already is or is not finite (reference/src/ds_scale.rs: range_scale). The
// product m * s is exact, so the loop agrees with the emulation's bit for bit.
template <class E>
PT_INLINE float pt_range_scale(float m) {
  float s = 1.f;
  if (m < pt_inf())
    while (m * s > E::MAXF) s *= 0.5f;
  return s;
}
// |x| where finite, else 0: what a block's range scale is taken over.
PT_INLINE float pt_finite_abs(float x) {
  const float a = x < 0.f ? -x : x;
  return a < pt_inf() ? a : 0.f;
}

struct F32 {
  typedef float T;
  static const bool IS16 = false;
  static const int KIND = 2;
  PT_INLINE static float load(const T* p, long long i) { return p[i]; }
  PT_INLINE static void store(T* p, long long i, float x) { p[i] = x; }
  PT_INLINE static float round(float x) { return x; }
};

// Unpack element j (0 or 1) of a 16-bit pair.
template <class E>
PT_INLINE float pt_lo(pt_u32 w) { return E::to_f((pt_u16)(w & 0xffffu)); }
template <class E>
PT_INLINE float pt_hi(pt_u32 w) { return E::to_f((pt_u16)(w >> 16)); }

// 16-byte vector of four words. Aligned to 16: with the 4-byte alignment of its members alone,
// pt_ld16/pt_st16 compiled to four 32-bit accesses each (ld.global.u32), a quarter of a sector
// per lane per instruction; 73 % of the small-seq kernels' L2 sectors were excess (ncu, v5).
struct alignas(16) pt_v4 {
  pt_u32 x, y, z, w;
};
PT_INLINE pt_v4 pt_zero4() {
  pt_v4 r;
  r.x = r.y = r.z = r.w = 0u;
  return r;
}
PT_INLINE pt_v4 pt_ld16(const void* p) {
  const pt_v4* q = (const pt_v4*)p;
  return *q;
}
PT_INLINE void pt_st16(void* p, pt_v4 v) { *(pt_v4*)p = v; }
PT_INLINE pt_u32 pt_word(const pt_v4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// A hint that the 128-byte line at p will be read soon: fetched into L2 without a register or a
// wait (CUDA); nothing on HIP.
#if defined(PT_CUDA)
PT_INLINE void pt_prefetch(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
PT_INLINE void pt_prefetch(const void*) {}
#endif

// Asynchronous 16-byte copies from global to shared memory, zero-filled where `valid` is false
// (nothing is read then). On CUDA sm_80+ they are cp.async (the copy runs while the thread
// computes; pt_cp_commit closes a group, pt_cp_wait<N> waits until at most N groups are in
// flight, and a block barrier must follow before other threads read the data). On HIP they are
// plain loads and stores, complete when the call returns.
#if defined(PT_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
PT_INLINE void pt_cp_async16(void* dst, const void* src, bool valid) {
  pt_u32 d;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
               : "=r"(d)
               : "l"(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
               "r"(valid ? 16u : 0u)
               : "memory");
}
PT_INLINE void pt_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
PT_INLINE void pt_cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
PT_INLINE void pt_cp_async16(void* dst, const void* src, bool valid) {
  pt_st16(dst, valid ? pt_ld16(src) : pt_zero4());
}
PT_INLINE void pt_cp_commit() {}
template <int N>
PT_INLINE void pt_cp_wait() {}
#endif

// B-operand word for n-tile j from two rows A (k even) and B (k odd), each 8 consecutive dims.
PT_INLINE pt_u32 pt_bsel(const pt_v4& a, const pt_v4& b, int j) {
  pt_u32 wa = pt_word(a, j >> 1), wb = pt_word(b, j >> 1);
  return (j & 1) ? ((wa >> 16) | (wb & 0xffff0000u)) : ((wa & 0xffffu) | (wb << 16));
}

// Stores 16 consecutive values (rounded to E) of one row.
template <class E, class O>
PT_INLINE void pt_store16(typename O::T* p, const float* x, float mul) {
  if (O::IS16) {
    pt_v4 a, b;
    a.x = E::pack2(x[0] * mul, x[1] * mul);
    a.y = E::pack2(x[2] * mul, x[3] * mul);
    a.z = E::pack2(x[4] * mul, x[5] * mul);
    a.w = E::pack2(x[6] * mul, x[7] * mul);
    b.x = E::pack2(x[8] * mul, x[9] * mul);
    b.y = E::pack2(x[10] * mul, x[11] * mul);
    b.z = E::pack2(x[12] * mul, x[13] * mul);
    b.w = E::pack2(x[14] * mul, x[15] * mul);
    pt_st16((void*)p, a);
    pt_st16((void*)(p + 8), b);
  } else {
#pragma unroll
    for (int i = 0; i < 16; i += 4) {
      pt_v4 a;
      a.x = pt_f2u(E::round(x[i] * mul));
      a.y = pt_f2u(E::round(x[i + 1] * mul));
      a.z = pt_f2u(E::round(x[i + 2] * mul));
      a.w = pt_f2u(E::round(x[i + 3] * mul));
      pt_st16((void*)(p + i), a);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fragment primitives of a 32-lane logical warp (lane l = 4*g + t, g = l/4, t = l%4), with the
// layouts of PTX mma.m16n8k16 (row.col): A (16x16): a0=(g, 2t..2t+1) a1=(g+8, 2t..) a2=(g, 2t+8..)
// a3=(g+8, 2t+8..); B (16x8): b0=(k=2t..2t+1, n=g) b1=(k=2t+8.., n=g); C (16x8, f32):
// c0,c1=(g, 2t..2t+1) c2,c3=(g+8, 2t..2t+1).

PT_INLINE int pt_llane() { return pt_tid() & 31; }

#if defined(PT_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
#define PT_MMA_NATIVE 1
template <class E>
PT_INLINE void pt_mma(float* c, pt_u32 a0, pt_u32 a1, pt_u32 a2, pt_u32 a3, pt_u32 b0,
                      pt_u32 b1) {
  if (E::KIND == 0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
// Transpose of an 8x8 16-bit matrix held as one word per lane (row g, cols 2t..2t+1).
PT_INLINE pt_u32 pt_trans8(pt_u32 x) {
  pt_u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
#else
// Shuffle inside a 32-lane logical warp (on HIP: inside this lane's half of the wavefront).
PT_INLINE pt_u32 pt_lshfl(pt_u32 v, int src_llane) {
  return pt_shfl_u(v, (pt_lane() & ~31) | src_llane);
}
#if defined(PT_HIP) && (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
                        defined(__gfx942__) || defined(__gfx950__))
// -------------------------------------------------------------------------------------------
// Matrix cores. One m16n8k16 product of the logical warp is one v_mfma_f32_16x16x16 (bf16_1k or
// f16) of the wavefront, with the fragments moved between the two layouts by ds_bpermute.
//
// MFMA 16x16x16 layout (lane L of 64, element e of the 4 per lane; the CDNA3 ISA's matrix
// instructions, as AMD's matrix instruction calculator prints them):
//   A[m][k]: L = m + 16*(k/4), e = k%4      B[k][n]: L = n + 16*(k/4), e = k%4
//   D[m][n]: L = n + 16*(m/4), e = m%4
// 16-bit operands are two words per lane, word w holding elements 2w (low half) and 2w+1.
// The fragment layout (above) holds one 16-bit pair (k even, k+1) per word, so a MFMA operand
// word is one fragment word: only whole words move. Both halves of the wavefront hold the same
// fragments (replicas, see the header), which gives every word two sources:
//
// A, 2 rounds. Destination L (m = L%16, q = L/16) needs word w from fragment register
//   a[u + 2v] (u = m/8, v = q/2) of half-lane 4*(m%8) + 2*(q%2) + w. It reads word w in round
//   w^u from the replica in half v. So in round r a source lane S serves exactly the
//   destinations with v = S/32 and u = r ^ (S%2), all wanting register a[(r ^ (S%2)) + 2*(S/32)],
//   which S selects before the shuffle. Each round every destination gets one word: 2 rounds.
// B, 2 rounds. Destination L (n = L%16, q = L/16) needs word w = B[4q+2w..][n] from register
//   b[q/2] of half-lane 4*(n%8) + 2*(q%2) + w; it reads it in round w from half q/2, where
//   every lane offers b[S/32]. Columns n >= 8 of the MFMA's B repeat columns n-8: the MFMA's
//   output columns 8..15 are never read back, so they only need to be something harmless.
// D, 4 rounds. Fragment lane (g, t) (half-lane 4g+t; both replicas) needs c_j = D[g + 8*(j/2)]
//   [2t + j%2], found at MFMA lane S = 2t + j%2 + 16*(g/4) + 32*(j/2), element g%4. It reads
//   c_j in round (g%4 + j) % 4. A source S is read for one c index only, j(S) = S%2 + 2*(S/32),
//   so in round r all its readers want element (r - j(S)) % 4, which it selects.
// The MFMA accumulates into zero and the product is added to c afterwards: c never has to move
// into the MFMA layout (4 more rounds), at the cost of one f32 rounding of the partial sum,
// which is of the order of the accumulation error of any ordering of the sum.
// tests/hip_model/model.cpp runs this code on the host, with a model of the MFMA and of
// ds_bpermute, and checks every output element (tests/hip_lane_model.rs).
typedef short pt_s16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 pt_h16x4 __attribute__((ext_vector_type(4)));
typedef float pt_f32x4 __attribute__((ext_vector_type(4)));
typedef pt_u32 pt_u32x2 __attribute__((ext_vector_type(2)));
#define PT_MFMA 1

PT_INLINE pt_u32 pt_pick4(int i, pt_u32 x0, pt_u32 x1, pt_u32 x2, pt_u32 x3) {
  return i == 0 ? x0 : (i == 1 ? x1 : (i == 2 ? x2 : x3));
}

template <class E>
PT_INLINE pt_f32x4 pt_mfma16(pt_u32 a_lo, pt_u32 a_hi, pt_u32 b_lo, pt_u32 b_hi) {
  pt_u32x2 a = {a_lo, a_hi}, b = {b_lo, b_hi};
  const pt_f32x4 zero = {0.f, 0.f, 0.f, 0.f};
  if (E::KIND == 0)
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(pt_s16x4, a),
                                                     __builtin_bit_cast(pt_s16x4, b), zero, 0,
                                                     0, 0);
  return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(pt_h16x4, a),
                                               __builtin_bit_cast(pt_h16x4, b), zero, 0, 0, 0);
}

template <class E>
PT_INLINE void pt_mma(float* c, pt_u32 a0, pt_u32 a1, pt_u32 a2, pt_u32 a3, pt_u32 b0,
                      pt_u32 b1) {
  const int L = pt_lane(), half = L >> 5, odd = L & 1;
  // A operand.
  const int m = L & 15, q = L >> 4, u = m >> 3, v = q >> 1;
  const int sa = 32 * v + 4 * (m & 7) + 2 * (q & 1);
  const pt_u32 ar0 = pt_shfl_u(pt_pick4(odd + 2 * half, a0, a1, a2, a3), sa + u);
  const pt_u32 ar1 = pt_shfl_u(pt_pick4((1 ^ odd) + 2 * half, a0, a1, a2, a3), sa + (1 ^ u));
  const pt_u32 aw0 = u ? ar1 : ar0, aw1 = u ? ar0 : ar1;
  // B operand.
  const int sb = 32 * v + 4 * (L & 7) + 2 * (q & 1);
  const pt_u32 boff = half ? b1 : b0;
  const pt_u32 bw0 = pt_shfl_u(boff, sb), bw1 = pt_shfl_u(boff, sb + 1);
  const pt_f32x4 d = pt_mfma16<E>(aw0, aw1, bw0, bw1);
  // Back to the fragment layout.
  const int l = pt_llane(), g = l >> 2, t = l & 3, i = g & 3;
  const int js = odd + 2 * half;
  pt_u32 z[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = (r - i) & 3;
    const int src = 2 * t + (j & 1) + 16 * (g >> 2) + 32 * (j >> 1);
    const int e = (r - js) & 3;
    const pt_u32 mine = pt_f2u(e == 0 ? d[0] : (e == 1 ? d[1] : (e == 2 ? d[2] : d[3])));
    z[r] = pt_shfl_u(mine, src);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = (i + j) & 3;
    c[j] += pt_u2f(pt_pick4(r, z[0], z[1], z[2], z[3]));
  }
}
#else
// Emulation inside a 32-lane logical warp.
template <class E>
PT_INLINE void pt_mma(float* c, pt_u32 a0, pt_u32 a1, pt_u32 a2, pt_u32 a3, pt_u32 b0,
                      pt_u32 b1) {
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  for (int kp = 0; kp < 4; ++kp) {
    pt_u32 A0 = pt_lshfl(a0, g * 4 + kp), A1 = pt_lshfl(a1, g * 4 + kp);
    pt_u32 A2 = pt_lshfl(a2, g * 4 + kp), A3 = pt_lshfl(a3, g * 4 + kp);
    pt_u32 B00 = pt_lshfl(b0, (2 * t) * 4 + kp), B01 = pt_lshfl(b1, (2 * t) * 4 + kp);
    pt_u32 B10 = pt_lshfl(b0, (2 * t + 1) * 4 + kp), B11 = pt_lshfl(b1, (2 * t + 1) * 4 + kp);
    // k = 2kp, 2kp+1 (from a0/a1, b0) and 2kp+8, 2kp+9 (from a2/a3, b1)
    c[0] += pt_lo<E>(A0) * pt_lo<E>(B00) + pt_hi<E>(A0) * pt_hi<E>(B00) +
            pt_lo<E>(A2) * pt_lo<E>(B01) + pt_hi<E>(A2) * pt_hi<E>(B01);
    c[1] += pt_lo<E>(A0) * pt_lo<E>(B10) + pt_hi<E>(A0) * pt_hi<E>(B10) +
            pt_lo<E>(A2) * pt_lo<E>(B11) + pt_hi<E>(A2) * pt_hi<E>(B11);
    c[2] += pt_lo<E>(A1) * pt_lo<E>(B00) + pt_hi<E>(A1) * pt_hi<E>(B00) +
            pt_lo<E>(A3) * pt_lo<E>(B01) + pt_hi<E>(A3) * pt_hi<E>(B01);
    c[3] += pt_lo<E>(A1) * pt_lo<E>(B10) + pt_hi<E>(A1) * pt_hi<E>(B10) +
            pt_lo<E>(A3) * pt_lo<E>(B11) + pt_hi<E>(A3) * pt_hi<E>(B11);
  }
}
#endif  // matrix cores / emulated mma
PT_INLINE pt_u32 pt_trans8(pt_u32 x) {
  // out(g, 2t+j) = in(2t+j, g): element (r, c) lives in lane 4r + c/2, half c%2.
  const int l = pt_llane(), g = l >> 2, t = l & 3;
  pt_u32 w0 = pt_lshfl(x, (2 * t) * 4 + (g >> 1));
  pt_u32 w1 = pt_lshfl(x, (2 * t + 1) * 4 + (g >> 1));
  pt_u32 h0 = (g & 1) ? (w0 >> 16) : (w0 & 0xffffu);
  pt_u32 h1 = (g & 1) ? (w1 >> 16) : (w1 & 0xffffu);
  return h0 | (h1 << 16);
}
#endif
