// ops::kda_recurrent and ops::kda_chunked: the threaded drivers over the per-ISA kernels of
// attn_kernels.h (heads split across the pool's threads, one head = one kernel call, so results do not
// depend on the thread count), plus the scalar level (fp64 state inside a call), and attn_kernels(),
// the dispatch of every attn_kernels.h kernel on the call's level (Exec::level).
// Must not: change results beyond fp32 rounding versus the fp64 twins in ops/reference.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/thread_pool.h"
#include "ops/cpu/attn_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/scratch.h"
#include "ops/ops.h"

namespace k3::ops {

namespace cpu {
const AttnKernels* attn_kernels(const Exec& x) {
#if defined(K3_HAVE_X86_KERNELS)
  switch (x.level()) {  // Scalar (nullptr) under Numerics::Exact
    case CpuIsa::Amx:  // (the tiles serve the GEMMs only)
    case CpuIsa::Avx512:
      return &avx512::kAttn;
    case CpuIsa::Avx2:
      return &avx2::kAttn;
    case CpuIsa::Scalar:
      return nullptr;
  }
#endif
  return nullptr;
}
}  // namespace cpu

namespace {
// Below this many multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 18;
// SIMD levels: one head of 128x128 state is ~50k multiply-adds per token, worth a thread.
constexpr int64_t kHeadParallelMin = int64_t(1) << 15;

void kda_recurrent_scalar(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                          int64_t H, int64_t Dk, int64_t Dv, float* S, float* o) {
  // The state is held in fp64 within a call (fp32 between calls, as the session stores it), the
  // same internal precision as kda_chunked, so prefill and decode paths agree to fp32 rounding.
  par::parallel_for_each(
      H,
      [&](int64_t h) {
        std::vector<double> s(S + h * Dk * Dv, S + (h + 1) * Dk * Dv), u(static_cast<size_t>(Dv)),
            ot(static_cast<size_t>(Dv));
        for (int64_t t = 0; t < T; ++t) {
          const float* qt = q + (t * H + h) * Dk;
          const float* kt = k + (t * H + h) * Dk;
          const float* vt = v + (t * H + h) * Dv;
          const float* gt = g + (t * H + h) * Dk;
          const double b = beta[t * H + h];
          // decay -> read prediction -> delta write -> read output from the updated state
          std::fill(u.begin(), u.end(), 0.0);
          for (int64_t a = 0; a < Dk; ++a) {
            const double al = std::exp(double(gt[a]));
            double* row = &s[size_t(a * Dv)];
            for (int64_t j = 0; j < Dv; ++j) {
              row[j] *= al;
              u[size_t(j)] += row[j] * kt[a];
            }
          }
          for (int64_t j = 0; j < Dv; ++j) u[size_t(j)] = b * (vt[j] - u[size_t(j)]);
          std::fill(ot.begin(), ot.end(), 0.0);
          for (int64_t a = 0; a < Dk; ++a) {
            double* row = &s[size_t(a * Dv)];
            for (int64_t j = 0; j < Dv; ++j) {
              row[j] += kt[a] * u[size_t(j)];
              ot[size_t(j)] += row[j] * qt[a];
            }
          }
          for (int64_t j = 0; j < Dv; ++j) o[(t * H + h) * Dv + j] = float(ot[size_t(j)]);
        }
        for (int64_t i = 0; i < Dk * Dv; ++i) S[h * Dk * Dv + i] = float(s[size_t(i)]);
      },
      T * H * Dk * Dv > kParallelMin);
}

void kda_chunked_scalar(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                        int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o) {
  // Chunkwise form (spec §3.5), per head and chunk of C tokens, with Γ_i = Σ_{j<=i} g_j in the chunk:
  //   R  = V − (exp(Γ) ⊙ K)·S                      (what the incoming state predicts is removed)
  //   Ṽ  = (I + M)⁻¹ Diag(β) R, M[i,j] = β_i Σ_d k_i k_j exp(Γ_i−Γ_j), j < i   (the UT transform,
  //        applied by forward substitution; equals U − W·S with U = T·V, W = T·(exp(Γ)⊙K))
  //   O  = (Q ⊙ exp(Γ))·S + (A_qk ⊙ causal-incl-diag)·Ṽ
  //   S ← Diag(exp(Γ_C))·S + Σ_i (exp(Γ_C − Γ_i) ⊙ k_i) ṽ_iᵀ
  // Decay factors are always formed from differences Γ_i − Γ_j <= 0 (never exp(Γ_i)·exp(−Γ_j)).
  // Intra-chunk math runs in fp64: the substitution can amplify rounding.
  if (chunk <= 0) chunk = 64;
  par::parallel_for_each(
      H,
      [&](int64_t h) {
        std::vector<double> s(static_cast<size_t>(Dk * Dv));
        for (int64_t i = 0; i < Dk * Dv; ++i) s[size_t(i)] = S[h * Dk * Dv + i];
        std::vector<double> G(static_cast<size_t>(chunk * Dk)), Vt(static_cast<size_t>(chunk * Dv)),
            A(static_cast<size_t>(chunk * chunk));
        for (int64_t t0 = 0; t0 < T; t0 += chunk) {
          const int64_t C = std::min(chunk, T - t0);
          auto K_ = [&](int64_t i, int64_t d) { return double(k[((t0 + i) * H + h) * Dk + d]); };
          auto Q_ = [&](int64_t i, int64_t d) { return double(q[((t0 + i) * H + h) * Dk + d]); };
          for (int64_t d = 0; d < Dk; ++d) {
            double acc = 0;
            for (int64_t i = 0; i < C; ++i) {
              acc += g[((t0 + i) * H + h) * Dk + d];
              G[size_t(i * Dk + d)] = acc;
            }
          }
          // R = V − (exp(Γ) ⊙ K)·S, then forward substitution for Ṽ.
          for (int64_t i = 0; i < C; ++i) {
            const double bi = beta[(t0 + i) * H + h];
            double* vt = &Vt[size_t(i * Dv)];
            for (int64_t j = 0; j < Dv; ++j) vt[j] = v[((t0 + i) * H + h) * Dv + j];
            for (int64_t d = 0; d < Dk; ++d) {
              const double kd = K_(i, d) * std::exp(G[size_t(i * Dk + d)]);
              const double* srow = &s[size_t(d * Dv)];
              for (int64_t j = 0; j < Dv; ++j) vt[j] -= kd * srow[j];
            }
            for (int64_t j = 0; j < Dv; ++j) vt[j] *= bi;
            for (int64_t p = 0; p < i; ++p) {
              double m = 0;
              for (int64_t d = 0; d < Dk; ++d)
                m += K_(i, d) * K_(p, d) * std::exp(G[size_t(i * Dk + d)] - G[size_t(p * Dk + d)]);
              m *= bi;
              const double* vp = &Vt[size_t(p * Dv)];
              for (int64_t j = 0; j < Dv; ++j) vt[j] -= m * vp[j];
            }
          }
          // O = (Q ⊙ exp(Γ))·S + (A_qk ⊙ causal)·Ṽ
          for (int64_t i = 0; i < C; ++i) {
            float* ot = o + ((t0 + i) * H + h) * Dv;
            std::vector<double> acc(size_t(Dv), 0.0);
            for (int64_t d = 0; d < Dk; ++d) {
              const double qd = Q_(i, d) * std::exp(G[size_t(i * Dk + d)]);
              const double* srow = &s[size_t(d * Dv)];
              for (int64_t j = 0; j < Dv; ++j) acc[size_t(j)] += qd * srow[j];
            }
            for (int64_t p = 0; p <= i; ++p) {
              double a = 0;
              for (int64_t d = 0; d < Dk; ++d)
                a += Q_(i, d) * K_(p, d) * std::exp(G[size_t(i * Dk + d)] - G[size_t(p * Dk + d)]);
              const double* vp = &Vt[size_t(p * Dv)];
              for (int64_t j = 0; j < Dv; ++j) acc[size_t(j)] += a * vp[j];
            }
            for (int64_t j = 0; j < Dv; ++j) ot[j] = float(acc[size_t(j)]);
          }
          // S ← Diag(exp(Γ_C))·S + Σ_i (exp(Γ_C − Γ_i) ⊙ k_i) ṽ_iᵀ
          const double* GC = &G[size_t((C - 1) * Dk)];
          for (int64_t d = 0; d < Dk; ++d) {
            double* srow = &s[size_t(d * Dv)];
            const double dec = std::exp(GC[d]);
            for (int64_t j = 0; j < Dv; ++j) srow[j] *= dec;
            for (int64_t i = 0; i < C; ++i) {
              const double kd = K_(i, d) * std::exp(GC[d] - G[size_t(i * Dk + d)]);
              const double* vi = &Vt[size_t(i * Dv)];
              for (int64_t j = 0; j < Dv; ++j) srow[j] += kd * vi[j];
            }
          }
        }
        for (int64_t i = 0; i < Dk * Dv; ++i) S[h * Dk * Dv + i] = float(s[size_t(i)]);
      },
      T * H * Dk * Dv * 4 > kParallelMin);
}

}  // namespace

void kda_recurrent(Exec ex, const float* q, const float* k, const float* v, const float* g, const float* beta,
                   int64_t T, int64_t H, int64_t Dk, int64_t Dv, float* S, float* o) {
  const cpu::AttnKernels* K = cpu::attn_kernels(ex);
  if (!K) return kda_recurrent_scalar(q, k, v, g, beta, T, H, Dk, Dv, S, o);
  // fp32 state updated in place, two passes over it per token (see attn_kernels.inc).
  par::parallel_for_setup(
      H, par::balanced_grain(H), [&] { cpu::scratch<float>(cpu::ScratchId::KdaHead, K3_KDA_REC_SCRATCH(Dk, Dv)); },
      [&](int64_t h0, int64_t h1) {
        float* const scratch = cpu::scratch_zeroed<float>(cpu::ScratchId::KdaHead, K3_KDA_REC_SCRATCH(Dk, Dv));
        for (int64_t h = h0; h < h1; ++h)
          K->kda_recurrent_head(q, k, v, g, beta, T, H, Dk, Dv, h, S + h * Dk * Dv, o, scratch);
      },
      H > 1 && T * H * Dk * Dv >= kHeadParallelMin);
}

void kda_chunked(Exec ex, const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o) {
  const cpu::AttnKernels* K = cpu::attn_kernels(ex);
  if (!K) return kda_chunked_scalar(q, k, v, g, beta, T, H, Dk, Dv, chunk, S, o);
  // `chunk` is a hint: the kernel caps it at K3_KDA_MAX_CHUNK and cuts a chunk earlier where the
  // cumulative log-decay would leave the fp32-safe range (factored decays, see attn_kernels.inc).
  const int64_t cmax = chunk <= 0 ? K3_KDA_MAX_CHUNK : std::min<int64_t>(chunk, K3_KDA_MAX_CHUNK);
  par::parallel_for_setup(
      H, par::balanced_grain(H), [&] { cpu::scratch<float>(cpu::ScratchId::KdaHead, K3_KDA_CHUNK_SCRATCH(Dk, Dv)); },
      [&](int64_t h0, int64_t h1) {
        float* const scratch = cpu::scratch_zeroed<float>(cpu::ScratchId::KdaHead, K3_KDA_CHUNK_SCRATCH(Dk, Dv));
        for (int64_t h = h0; h < h1; ++h)
          K->kda_chunked_head(q, k, v, g, beta, T, H, Dk, Dv, h, cmax, S + h * Dk * Dv, o, scratch);
      },
      H > 1 && T * H * Dk * Dv >= kHeadParallelMin);
}

}  // namespace k3::ops
