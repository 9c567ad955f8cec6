// Host model of a gfx942 wavefront running the HIP branch of kernels/portable.h, so the
// matrix-core lane mapping (which cannot run here: no AMD GPU) is checked on a CPU.
//
// 64 host threads play the 64 lanes of one wavefront in lockstep. The amdgcn builtins that
// portable.h uses are replaced by models: ds_bpermute exchanges a word through a shared array,
// and v_mfma_f32_16x16x16 {bf16_1k, f16} computes D = A*B + C from the operand layout that the
// CDNA3 ISA documents (A[m][k] at lane m + 16*(k/4), element k%4; B[k][n] at lane n + 16*(k/4),
// element k%4; D[m][n] at lane n + 16*(m/4), element m%4). Every cross-lane operation is also a
// uniformity check: all 64 lanes must reach the same operation, as the matrix cores need (a lane
// that skipped it, or returned early, is reported as divergence).
//
// The kernel sources are included unchanged, so what is checked is the code the device
// compiler sees, with the same macro selection (__gfx942__): the fragment moves of pt_mma, the
// one-item-per-wavefront mapping of pt_lwarp(), and the small-seq forward and backward kernels
// end to end against a double-precision reference of semantics.md §1.
//
// Build: clang++ -std=c++20 -O1 -pthread tests/hip_model/model.cpp (clang: ext_vector_type).
// Run: prints "N passed, 0 failed" and exits 0, or names the first failure and exits 1.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define __HIPCC__ 1
#define __gfx942__ 1
#define __global__
#define __device__
#define __shared__
#define PT_HIP_KERNEL_ATTR

typedef short m_s16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 m_h16x4 __attribute__((ext_vector_type(4)));
typedef float m_f32x4 __attribute__((ext_vector_type(4)));

namespace model {
constexpr int W = 64;
thread_local int lane = 0, tid = 0, bid = 0;

enum Op : int { BPERM = 1, MFMA_BF16, MFMA_F16, DONE };

struct Divergence {};

struct Wave {
  std::barrier<> bar{W};
  int op[W];
  uint32_t word[W];
  uint16_t a[W][4], b[W][4];
  float c[W][4];
  std::atomic<int> diverged{0};
  std::string why;
};
Wave* wave = nullptr;

// All lanes arrive with their operation; every lane then sees the same verdict.
inline void arrive(int o) {
  wave->op[lane] = o;
  wave->bar.arrive_and_wait();
  for (int l = 1; l < W; ++l)
    if (wave->op[l] != wave->op[0]) {
      if (lane == 0 && !wave->diverged.exchange(1))
        wave->why = "lane " + std::to_string(l) + " at op " + std::to_string(wave->op[l]) +
                    ", lane 0 at op " + std::to_string(wave->op[0]);
      throw Divergence{};
    }
}

inline int bpermute(int addr, int v) {
  wave->word[lane] = (uint32_t)v;
  arrive(BPERM);
  int r = (int)wave->word[(addr >> 2) & (W - 1)];
  wave->bar.arrive_and_wait();
  return r;
}

inline float bf16f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16f(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}

template <class V>
m_f32x4 mfma(V av, V bv, m_f32x4 cv, int kind) {
  std::memcpy(wave->a[lane], &av, 8);
  std::memcpy(wave->b[lane], &bv, 8);
  for (int e = 0; e < 4; ++e) wave->c[lane][e] = cv[e];
  arrive(kind);
  auto cvt = [&](uint16_t h) { return kind == MFMA_BF16 ? bf16f(h) : f16f(h); };
  m_f32x4 d;
  const int n = lane % 16;
  for (int e = 0; e < 4; ++e) {
    const int m = 4 * (lane / 16) + e;
    double s = wave->c[n + 16 * (m / 4)][m % 4];
    for (int k = 0; k < 16; ++k)
      s += (double)cvt(wave->a[m + 16 * (k / 4)][k % 4]) *
           (double)cvt(wave->b[n + 16 * (k / 4)][k % 4]);
    d[e] = (float)s;
  }
  wave->bar.arrive_and_wait();
  return d;
}
}  // namespace model

#define __builtin_amdgcn_ds_bpermute(addr, v) model::bpermute((addr), (v))
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, x, y, z) \
  model::mfma<m_s16x4>((a), (b), (c), model::MFMA_BF16)
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, x, y, z) \
  model::mfma<m_h16x4>((a), (b), (c), model::MFMA_F16)
#define __builtin_amdgcn_workitem_id_x() model::tid
#define __builtin_amdgcn_workgroup_id_x() model::bid
// Barriers: the small-seq kernels have none, and a wavefront in this model is in lockstep at
// every exchange anyway.
#define __builtin_amdgcn_fence(order, scope) ((void)0)
#define __builtin_amdgcn_s_barrier() ((void)0)
#define __builtin_amdgcn_wave_barrier() ((void)0)

#include "../../kernels/small_seq.cu"

#ifndef PT_MFMA
#error "the model must see the matrix-core branch of portable.h"
#endif

namespace model {
// Runs `body(wave_index)` on every wavefront of a grid of `waves` waves, 64 lanes in lockstep.
// Returns false (with the reason) on divergence.
bool run_waves(long long waves, const std::function<void(long long)>& body, std::string& why) {
  Wave w;
  wave = &w;
  std::vector<std::thread> th;
  for (int l = 0; l < W; ++l)
    th.emplace_back([&, l] {
      lane = l;
      try {
        for (long long i = 0; i < waves; ++i) {
          // SS_WPB wavefronts per block: wavefront i is block i / SS_WPB, warp i % SS_WPB.
          bid = (int)(i / SS_WPB);
          tid = (int)(i % SS_WPB) * W + l;
          body(i);
          arrive(DONE);
          // No lane may start the next wavefront's exchanges before all have checked this one.
          wave->bar.arrive_and_wait();
        }
      } catch (Divergence&) {
      }
    });
  for (auto& t : th) t.join();
  wave = nullptr;
  if (w.diverged) why = w.why;
  return !w.diverged;
}

uint16_t to_bf16(float f) { return pt_f_to_bf16(f); }
}  // namespace model

static int passed = 0, failed = 0;
static void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// pt_mma against the exact product, for random fragments, both element types; pt_trans8.
template <class E>
static void test_mma(std::mt19937& rng, const char* name) {
  std::uniform_int_distribution<int> small(-8, 8);
  float A[16][16], B[16][8], C[16][8];
  for (auto& r : A)
    for (auto& x : r) x = small(rng) * 0.25f;
  for (auto& r : B)
    for (auto& x : r) x = small(rng) * 0.5f;
  for (auto& r : C)
    for (auto& x : r) x = (float)small(rng);
  float out[64][4];
  uint32_t tr[64], trin[64];
  std::string why;
  bool uniform = model::run_waves(1, [&](long long) {
    const int l = model::lane & 31, g = l >> 2, t = l & 3;
    auto pk = [&](float x, float y) { return E::pack2(x, y); };
    pt_u32 a0 = pk(A[g][2 * t], A[g][2 * t + 1]), a1 = pk(A[g + 8][2 * t], A[g + 8][2 * t + 1]);
    pt_u32 a2 = pk(A[g][2 * t + 8], A[g][2 * t + 9]);
    pt_u32 a3 = pk(A[g + 8][2 * t + 8], A[g + 8][2 * t + 9]);
    pt_u32 b0 = pk(B[2 * t][g], B[2 * t + 1][g]), b1 = pk(B[2 * t + 8][g], B[2 * t + 9][g]);
    float c[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
    pt_mma<E>(c, a0, a1, a2, a3, b0, b1);
    for (int e = 0; e < 4; ++e) out[model::lane][e] = c[e];
    trin[model::lane] = a0;
    tr[model::lane] = pt_trans8(a0);
  }, why);
  check(uniform, std::string("pt_mma<") + name + "> uniform: " + why);
  int bad = 0;
  for (int L = 0; L < 64; ++L) {
    const int l = L & 31, g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; ++e) {
      const int m = g + 8 * (e >> 1), n = 2 * t + (e & 1);
      double s = C[m][n];
      for (int k = 0; k < 16; ++k) s += (double)A[m][k] * B[k][n];
      if (out[L][e] != (float)s) ++bad;
    }
    // trans8: out(g, 2t+j) = in(2t+j, g), element (r, c) of the 8x8 in lane 4r + c/2, half c%2.
    for (int j = 0; j < 2; ++j) {
      const int r = 2 * t + j, cc = g;
      const uint32_t src = trin[(L & 32) + 4 * r + cc / 2];
      const uint16_t want = (uint16_t)((cc & 1) ? src >> 16 : src & 0xffff);
      const uint16_t got = (uint16_t)(j ? tr[L] >> 16 : tr[L] & 0xffff);
      if (want != got) ++bad;
    }
  }
  check(bad == 0, std::string("pt_mma<") + name + "> and pt_trans8: " + std::to_string(bad) +
                      " wrong elements");
}

// One small-seq case: b slots, H heads, head dim D, mask code; bf16 in and out.
struct Case {
  int b, H, D, mask;
  std::vector<int> cu_q, cu_kv, off_q, off_kv;
  long long tq, tk;
};

static float bf(float x) { return model::bf16f(model::to_bf16(x)); }

template <int D>
static void test_case(std::mt19937& rng, int b, int H, int mask, bool empty_slots) {
  std::uniform_int_distribution<int> len(empty_slots ? 0 : 1, 17), gap(0, 2);
  Case cs{b, H, D, mask, {0}, {0}, {0}, {0}, 0, 0};
  for (int i = 0; i < b; ++i) {
    int lq = len(rng), lk = len(rng);
    if (lk == 0 && lq > 0) lk = 1;  // an empty key side with queries is outside the small-seq path
    cs.cu_q.push_back(cs.cu_q.back() + lq);
    cs.cu_kv.push_back(cs.cu_kv.back() + lk);
    cs.off_q.push_back(cs.off_q.back() + lq + gap(rng));
    cs.off_kv.push_back(cs.off_kv.back() + lk + gap(rng));
  }
  cs.tq = cs.off_q.back();
  cs.tk = cs.off_kv.back();
  const long long rs = (long long)H * D;
  std::normal_distribution<float> nd(0.f, 1.f);
  auto fill = [&](long long n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = model::to_bf16(nd(rng));
    return v;
  };
  std::vector<uint16_t> q = fill(cs.tq * rs), k = fill(cs.tk * rs), v = fill(cs.tk * rs),
                        d_o = fill(cs.tq * rs);
  const uint16_t sentinel = 0x7fc1;
  std::vector<uint16_t> o(cs.tq * rs, sentinel), dq(cs.tq * rs, sentinel),
      dk(cs.tk * rs, sentinel), dv(cs.tk * rs, sentinel);
  std::vector<float> lse(cs.tq * H, NAN);
  const float scale = 1.0f / std::sqrt((float)D);
  const long long items = (long long)b * H;
  const long long waves = (items + SS_WPB - 1) / SS_WPB * SS_WPB;
  auto fwd = [&](long long) {
    if (D == 64)
      small_seq_fwd_bf16_d64(q.data(), k.data(), v.data(), o.data(), lse.data(), cs.cu_q.data(),
                             cs.cu_kv.data(), cs.off_q.data(), cs.off_kv.data(), b, H, scale,
                             mask);
    else if (D == 128)
      small_seq_fwd_bf16_d128(q.data(), k.data(), v.data(), o.data(), lse.data(),
                              cs.cu_q.data(), cs.cu_kv.data(), cs.off_q.data(), cs.off_kv.data(),
                              b, H, scale, mask);
    else
      small_seq_fwd_bf16_d256(q.data(), k.data(), v.data(), o.data(), lse.data(),
                              cs.cu_q.data(), cs.cu_kv.data(), cs.off_q.data(), cs.off_kv.data(),
                              b, H, scale, mask);
  };
  std::string why;
  const std::string tag = "D=" + std::to_string(D) + " b=" + std::to_string(b) +
                          " H=" + std::to_string(H) + " mask=" + std::to_string(mask);
  check(model::run_waves(waves, fwd, why), "fwd " + tag + " uniform: " + why);
  auto bwd = [&](long long) {
    if (D == 64)
      small_seq_bwd_bf16_d64(q.data(), k.data(), v.data(), d_o.data(), lse.data(), dq.data(),
                             dk.data(), dv.data(), cs.cu_q.data(), cs.cu_kv.data(),
                             cs.off_q.data(), cs.off_kv.data(), b, H, scale, mask);
    else if (D == 128)
      small_seq_bwd_bf16_d128(q.data(), k.data(), v.data(), d_o.data(), lse.data(), dq.data(),
                              dk.data(), dv.data(), cs.cu_q.data(), cs.cu_kv.data(),
                              cs.off_q.data(), cs.off_kv.data(), b, H, scale, mask);
    else
      small_seq_bwd_bf16_d256(q.data(), k.data(), v.data(), d_o.data(), lse.data(), dq.data(),
                              dk.data(), dv.data(), cs.cu_q.data(), cs.cu_kv.data(),
                              cs.off_q.data(), cs.off_kv.data(), b, H, scale, mask);
  };
  check(model::run_waves(waves, bwd, why), "bwd " + tag + " uniform: " + why);

  // Double reference (semantics.md §1) on the bf16 inputs; errors of a wrong lane mapping are
  // of the order of the values, the kernel's own roundings (bf16 P, dS and outputs) of 2^-8.
  auto at = [](const std::vector<uint16_t>& x, long long i) { return (double)model::bf16f(x[i]); };
  double err_o = 0, max_o = 0, err_l = 0, err_g[3] = {0, 0, 0}, max_g[3] = {0, 0, 0};
  long long wrong_dont_care = 0;
  std::vector<double> rdq(cs.tq * rs, 0.0), rdk(cs.tk * rs, 0.0), rdv(cs.tk * rs, 0.0);
  std::vector<char> valid_q(cs.tq, 0), valid_k(cs.tk, 0);
  for (int i = 0; i < b; ++i) {
    const int lq = cs.cu_q[i + 1] - cs.cu_q[i], lk = cs.cu_kv[i + 1] - cs.cu_kv[i];
    for (int r = 0; r < lq; ++r) valid_q[cs.off_q[i] + r] = 1;
    for (int c = 0; c < lk; ++c) valid_k[cs.off_kv[i] + c] = 1;
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < lq; ++r) {
        const long long tqi = cs.off_q[i] + r;
        std::vector<double> s(lk), p(lk), dp(lk);
        double m = -INFINITY;
        for (int c = 0; c < lk; ++c) {
          bool vis = mask == 0 || (mask == 1 ? c <= r : c <= r + (lk - lq));
          double x = 0;
          for (int d = 0; d < D; ++d)
            x += at(q, tqi * rs + h * D + d) * at(k, (cs.off_kv[i] + c) * rs + h * D + d);
          s[c] = vis ? x * scale : -INFINITY;
          m = std::max(m, s[c]);
        }
        double l = 0;
        for (int c = 0; c < lk; ++c) l += s[c] == -INFINITY ? 0 : std::exp(s[c] - m);
        const double rl = l > 0 ? m + std::log(l) : -INFINITY;
        const float kl = lse[tqi * H + h];
        err_l = std::max(err_l, rl == -INFINITY ? (kl == -INFINITY ? 0.0 : 1e9)
                                                : std::fabs(kl - rl) / std::max(1.0, std::fabs(rl)));
        for (int c = 0; c < lk; ++c) p[c] = l > 0 && s[c] != -INFINITY ? std::exp(s[c] - m) / l : 0;
        double dsum = 0;
        for (int c = 0; c < lk; ++c) {
          double x = 0;
          for (int d = 0; d < D; ++d)
            x += at(d_o, tqi * rs + h * D + d) * at(v, (cs.off_kv[i] + c) * rs + h * D + d);
          dp[c] = x;
          dsum += p[c] * x;
        }
        for (int d = 0; d < D; ++d) {
          double acc = 0, aq = 0;
          for (int c = 0; c < lk; ++c) {
            const long long kr = (cs.off_kv[i] + c) * rs + h * D + d;
            acc += p[c] * at(v, kr);
            const double ds = p[c] * (dp[c] - dsum);
            aq += ds * at(k, kr);
            rdk[kr] += scale * ds * at(q, tqi * rs + h * D + d);
            rdv[kr] += p[c] * at(d_o, tqi * rs + h * D + d);
          }
          rdq[tqi * rs + h * D + d] = scale * aq;
          const double got = model::bf16f(o[tqi * rs + h * D + d]);
          err_o = std::max(err_o, std::fabs(got - acc));
          max_o = std::max(max_o, std::fabs(acc));
        }
      }
  }
  const std::vector<uint16_t>* gk[3] = {&dq, &dk, &dv};
  const std::vector<double>* gr[3] = {&rdq, &rdk, &rdv};
  for (int t = 0; t < 3; ++t) {
    const auto& vq = t == 0 ? valid_q : valid_k;
    for (long long i = 0; i < (long long)gk[t]->size(); ++i) {
      const long long tok = i / rs;
      if (!vq[tok]) {
        if ((*gk[t])[i] != sentinel) ++wrong_dont_care;
        continue;
      }
      err_g[t] = std::max(err_g[t], std::fabs(model::bf16f((*gk[t])[i]) - (*gr[t])[i]));
      max_g[t] = std::max(max_g[t], std::fabs((*gr[t])[i]));
    }
  }
  for (long long i = 0; i < (long long)o.size(); ++i)
    if (!valid_q[i / rs] && o[i] != sentinel) ++wrong_dont_care;
  const double tol = 1.0 / 32;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s: o err %.3g (max %.3g), lse rel err %.3g, dq %.3g/%.3g dk %.3g/%.3g "
                "dv %.3g/%.3g, %lld don't-care writes",
                tag.c_str(), err_o, max_o, err_l, err_g[0], max_g[0], err_g[1], max_g[1],
                err_g[2], max_g[2], wrong_dont_care);
  bool ok = err_o <= tol * std::max(1.0, max_o) && err_l <= 1e-5 && wrong_dont_care == 0;
  for (int t = 0; t < 3; ++t) ok = ok && err_g[t] <= tol * std::max(1.0, max_g[t]);
  check(ok, buf);
  if (std::getenv("HIP_MODEL_VERBOSE")) std::printf("%s\n", buf);
}

int main() {
  std::mt19937 rng(7);
  for (int rep = 0; rep < 4; ++rep) {
    test_mma<BF16>(rng, "bf16");
    test_mma<F16>(rng, "f16");
  }
  // Every head dim, every mask, full-length (17) and empty slots, a grid tail (b*H not a
  // multiple of the 4 items of a block).
  test_case<64>(rng, 3, 2, 0, false);
  test_case<64>(rng, 5, 1, 1, true);
  test_case<128>(rng, 2, 3, 2, true);
  test_case<256>(rng, 2, 1, 0, false);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
