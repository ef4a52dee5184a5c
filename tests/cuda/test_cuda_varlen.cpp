// Device tests of the varlen (continuous-batching) ops of cuda_ops.h: KDA recurrent/chunked and the
// short conv over state slots, the paged MLA append and absorbed attention. Each against the fp64
// twins in k3::ref run per sequence on the same data (and, for KDA/conv, bit for bit against the
// single-sequence CUDA kernels), NaN-prefilled outputs, untouched slots and pages checked; a
// decode step captured once as a graph and replayed while slots, positions and block tables move;
// bad arguments; and the decode-shape timings (N = 32, ~4k contexts) against N single-sequence calls.
// Owns: nothing the engine uses (tolerances: tests/common/op_tolerances.h). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/cuda_util.h"
#include "common/error_util.h"
#include "common/kda_inputs.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/error.h"
#include "model/dims.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/ops.h"

namespace {

namespace cu = k3::cuda;
using k3test::count_nan;
using k3test::kTolConv;
using k3test::kTolElementwise;
using k3test::kTolKda;
using k3test::kTolMla;
using k3test::nan_vec;
using k3test::rand_vec;
using k3test::rel_l2;

template <class T>
cu::DevBuf up(const std::vector<T>& v) {
  return k3test::to_dev(v);
}
std::vector<float> down(const cu::DevBuf& b, size_t n) { return k3test::from_dev<float>(b, n); }
std::vector<uint32_t> bits(const cu::DevBuf& b, size_t n) { return k3test::from_dev<uint32_t>(b, n); }
std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> u(v.size());
  std::memcpy(u.data(), v.data(), v.size() * 4);
  return u;
}

// A slice [a, a + n) of a host vector.
std::vector<float> part(const std::vector<float>& v, int64_t a, int64_t n) {
  return std::vector<float>(v.begin() + a, v.begin() + a + n);
}

// ================================================================ batches
// Rows per sequence, packed in batch order, and each sequence's slot: distinct slots drawn in a
// shuffled order from a pool with `spare` slots that no sequence uses (checked untouched).
struct Batch {
  std::vector<int64_t> len;
  std::vector<int32_t> cu, slots;
  int64_t rows = 0, n_slots = 0;
  int64_t n() const { return int64_t(len.size()); }
};

Batch make_batch(std::mt19937& rng, std::vector<int64_t> len, int64_t spare) {
  Batch b;
  b.len = std::move(len);
  b.cu.push_back(0);
  for (int64_t l : b.len) b.cu.push_back(int32_t(b.cu.back() + l));
  b.rows = b.cu.back();
  b.n_slots = b.n() + spare;
  std::vector<int32_t> perm(size_t(b.n_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  b.slots.assign(perm.begin(), perm.begin() + b.n());
  return b;
}

// Mixed lengths for n sequences: mostly 1-row decode rows, every fourth a chunk of up to max_chunk
// rows, some of 2..5 rows, and (n >= 8) one sequence with no rows this step.
std::vector<int64_t> mixed_lengths(std::mt19937& rng, int64_t n, int64_t max_chunk) {
  std::vector<int64_t> len(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (i % 4) {
      case 0:
        len[size_t(i)] = std::uniform_int_distribution<int64_t>(2, std::max<int64_t>(2, max_chunk))(rng);
        break;
      case 3:
        len[size_t(i)] = std::uniform_int_distribution<int64_t>(2, 5)(rng);
        break;
      default:
        len[size_t(i)] = 1;
    }
  }
  if (n >= 8) len[5] = 0;
  std::shuffle(len.begin(), len.end(), rng);
  return len;
}

struct DevBatch {
  cu::DevBuf cu, slots;
  cu::VarlenDev v;
};
DevBatch upload(const Batch& b) {
  DevBatch d;
  d.cu = up(b.cu);
  d.slots = up(b.slots);
  d.v.n_seqs = b.n();
  d.v.rows = b.rows;
  d.v.cu_rows = d.cu.as<int32_t>();
  d.v.slots = d.slots.as<int32_t>();
  d.v.n_slots = b.n_slots;
  return d;
}

std::string batch_name(const Batch& b) {
  std::string s = "N=" + std::to_string(b.n()) + " rows=" + std::to_string(b.rows) + " len=";
  for (int64_t l : b.len) s += std::to_string(l) + ",";
  return s;
}

// The fp64-twin reference of a KDA call per sequence, each from its own slot of pool0: the final
// pool and the outputs (NaN where no sequence writes).
struct KdaRef {
  std::vector<float> pool, o;
};
KdaRef kda_reference(const k3test::KdaInputs& in, const Batch& b, int64_t H, int64_t Dk, int64_t Dv,
                     const std::vector<float>& pool0) {
  KdaRef r{pool0, nan_vec(size_t(b.rows * H * Dv))};
  const int64_t nS = H * Dk * Dv;
  for (int64_t i = 0; i < b.n(); ++i) {
    const int64_t r0 = b.cu[size_t(i)], T = b.len[size_t(i)];
    if (T == 0) continue;
    k3::ref::kda_recurrent(in.q.data() + r0 * H * Dk, in.k.data() + r0 * H * Dk, in.v.data() + r0 * H * Dv,
                           in.g.data() + r0 * H * Dk, in.beta.data() + r0 * H, T, H, Dk, Dv,
                           r.pool.data() + b.slots[size_t(i)] * nS, r.o.data() + r0 * H * Dv);
  }
  return r;
}

// Each sequence's outputs and state from a KDA call against the reference (rel-L2 below tol; a
// sequence of no rows and every slot of no sequence keep pool0's state exactly). The worst errors.
std::pair<double, double> expect_per_sequence(const Batch& b, const std::vector<float>& oh, const std::vector<float>& ph,
                                              const KdaRef& ref, const std::vector<float>& pool0, int64_t H, int64_t Dv,
                                              int64_t nS, double tol) {
  double worst_o = 0, worst_s = 0;
  for (int64_t i = 0; i < b.n(); ++i) {
    const int64_t r0 = b.cu[size_t(i)], T = b.len[size_t(i)], sl = b.slots[size_t(i)];
    SCOPED_TRACE("sequence " + std::to_string(i) + " T=" + std::to_string(T));
    if (T > 0) {
      const double eo = rel_l2(part(oh, r0 * H * Dv, T * H * Dv), part(ref.o, r0 * H * Dv, T * H * Dv));
      const double es = rel_l2(part(ph, sl * nS, nS), part(ref.pool, sl * nS, nS));
      worst_o = std::max(worst_o, eo);
      worst_s = std::max(worst_s, es);
      EXPECT_LT(eo, tol);
      EXPECT_LT(es, tol);
    } else {
      EXPECT_EQ(part(ph, sl * nS, nS), part(pool0, sl * nS, nS));  // no rows: state as it was
    }
  }
  for (int64_t sl = 0; sl < b.n_slots; ++sl) {
    if (std::find(b.slots.begin(), b.slots.end(), int32_t(sl)) == b.slots.end()) {
      EXPECT_EQ(part(ph, sl * nS, nS), part(pool0, sl * nS, nS)) << "slot " << sl << " is in no sequence";
    }
  }
  return {worst_o, worst_s};
}

// ================================================================ KDA
TEST(CudaVarlen, KdaRecurrentAndChunkedPerSequence) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(401);
  struct Shape {
    int64_t H, Dk, Dv, max_chunk;
  };
  // Odd head dims over several 32-column blocks, chunks past one 64-token chunk; the K3 head shape.
  for (const Shape sh : {Shape{2, 32, 40, 70}, Shape{3, 16, 70, 9}, Shape{96, 128, 128, 6}}) {
    for (int64_t N : {1, 3, 8, 32}) {
      const int64_t H = sh.H, Dk = sh.Dk, Dv = sh.Dv, nS = H * Dk * Dv;
      const Batch b = make_batch(rng, mixed_lengths(rng, N, sh.max_chunk), 3);
      SCOPED_TRACE(batch_name(b) + " H=" + std::to_string(H) + " Dk=" + std::to_string(Dk) +
                   " Dv=" + std::to_string(Dv));
      const auto in = k3test::make_kda(rng, b.rows, H, Dk, Dv);
      const auto pool0 = rand_vec(rng, size_t(b.n_slots * nS), 0.01f, 0.5f);
      // Reference, per sequence, from its own slot.
      const KdaRef ref = kda_reference(in, b, H, Dk, Dv, pool0);
      const DevBatch db = upload(b);
      auto dq = up(in.q), dk = up(in.k), dv = up(in.v), dg = up(in.g), dbeta = up(in.beta);
      const size_t nO = size_t(b.rows * H * Dv);
      for (int64_t chunk : {0, 16}) {  // 0: recurrent, else chunked with that chunk
        SCOPED_TRACE(chunk ? "chunked" : "recurrent");
        auto pool = up(pool0), o = k3test::dev_nan(nO);
        if (chunk)
          cu::kda_chunked_varlen(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), dbeta.as<float>(),
                                 db.v, H, Dk, Dv, chunk, pool.as<float>(), o.as<float>(), nullptr);
        else
          cu::kda_recurrent_varlen(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), dbeta.as<float>(),
                                   db.v, H, Dk, Dv, pool.as<float>(), o.as<float>(), nullptr);
        const auto oh = down(o, nO), ph = down(pool, pool0.size());
        ASSERT_EQ(count_nan(oh), 0u);
        expect_per_sequence(b, oh, ph, ref, pool0, H, Dv, nS, kTolKda);
        // The single-sequence kernel on each sequence alone: the same bits.
        auto pool1 = up(pool0), o1 = k3test::dev_nan(nO);
        for (int64_t i = 0; i < N; ++i) {
          const int64_t r0 = b.cu[size_t(i)], T = b.len[size_t(i)];
          float* S = pool1.as<float>() + b.slots[size_t(i)] * nS;
          const float *q = dq.as<float>() + r0 * H * Dk, *k = dk.as<float>() + r0 * H * Dk,
                      *g = dg.as<float>() + r0 * H * Dk, *v = dv.as<float>() + r0 * H * Dv,
                      *beta = dbeta.as<float>() + r0 * H;
          if (chunk)
            cu::kda_chunked(q, k, v, g, beta, T, H, Dk, Dv, chunk, S, o1.as<float>() + r0 * H * Dv, nullptr);
          else
            cu::kda_recurrent(q, k, v, g, beta, T, H, Dk, Dv, S, o1.as<float>() + r0 * H * Dv, nullptr);
        }
        EXPECT_EQ(bits(o1, nO), bits(o, nO));
        EXPECT_EQ(bits(pool1, pool0.size()), bits(pool, pool0.size()));
      }
    }
  }
}

// The tensor-core chunked KDA (fast numerics' prefill) against the fp64 twin per sequence: head dims
// 16..128, sequences across several 64-token chunks and of every small length, windows of 1..3
// chunks (a sequence split over calls of the kernels, its state carried), strong decay (the
// diagonal blocks computed directly) and untouched slots. The measured errors print.
TEST(CudaVarlen, KdaTensorCoreChunkedPerSequence) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(405);
  struct Shape {
    int64_t H, D, max_chunk;
    float gate_scale;  // g multiplied by this (3: up to -15 per token, sub-chunk spans past e^80)
  };
  double worst_o = 0, worst_s = 0;
  for (const Shape sh : {Shape{3, 16, 150, 1.0f}, Shape{2, 32, 70, 1.0f}, Shape{5, 64, 200, 1.0f},
                         Shape{4, 128, 300, 1.0f}, Shape{4, 128, 140, 3.0f}, Shape{2, 64, 90, 3.0f}}) {
    for (int64_t N : {1, 3, 8}) {
      const int64_t H = sh.H, D = sh.D, nS = H * D * D;
      const Batch b = make_batch(rng, mixed_lengths(rng, N, sh.max_chunk), 2);
      SCOPED_TRACE(batch_name(b) + " H=" + std::to_string(H) + " D=" + std::to_string(D) +
                   " gate x" + std::to_string(sh.gate_scale));
      auto in = k3test::make_kda(rng, b.rows, H, D, D);
      for (float& g : in.g) g *= sh.gate_scale;
      const auto pool0 = rand_vec(rng, size_t(b.n_slots * nS), 0.01f, 0.5f);
      const KdaRef ref = kda_reference(in, b, H, D, D, pool0);
      const DevBatch db = upload(b);
      auto dq = up(in.q), dk = up(in.k), dv = up(in.v), dg = up(in.g), dbeta = up(in.beta);
      const size_t nO = size_t(b.rows * H * D);
      const int64_t all = cu::kda_tc_chunks(b.cu.data(), b.n());
      for (int64_t cap : {all, int64_t(1), int64_t(3)}) {
        SCOPED_TRACE("workspace of " + std::to_string(cap) + " chunks (the call has " + std::to_string(all) + ")");
        cu::DevBuf work(cu::kda_tc_work_bytes(cap, H, D), "kda tc work");
        auto pool = up(pool0), o = k3test::dev_nan(nO);
        cu::kda_chunked_tc_varlen(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), dbeta.as<float>(),
                                  db.v, b.cu.data(), H, D, D, pool.as<float>(), o.as<float>(), work.get(), cap,
                                  nullptr);
        const auto oh = down(o, nO), ph = down(pool, pool0.size());
        ASSERT_EQ(count_nan(oh), 0u);
        const auto [eo, es] = expect_per_sequence(b, oh, ph, ref, pool0, H, D, nS, k3test::kTolKdaBf16);
        worst_o = std::max(worst_o, eo);
        worst_s = std::max(worst_s, es);
        // Batched == alone, bitwise: each sequence run as a call of its own (its rows at offset 0,
        // the same slot) gives the same outputs and state (no row of another sequence, no batch-
        // dependent grid shape, enters a sequence's numbers).
        if (cap != all || N == 1) continue;
        for (int64_t i = 0; i < N; ++i) {
          const int64_t r0 = b.cu[size_t(i)], T = b.len[size_t(i)], sl = b.slots[size_t(i)];
          if (T == 0) continue;
          SCOPED_TRACE("sequence " + std::to_string(i) + " alone, T=" + std::to_string(T));
          Batch one;
          one.len = {T};
          one.cu = {0, int32_t(T)};
          one.slots = {int32_t(sl)};
          one.rows = T;
          one.n_slots = b.n_slots;
          const DevBatch d1 = upload(one);
          const int64_t n1 = T * H * D;
          auto q1 = up(part(in.q, r0 * H * D, n1)), k1 = up(part(in.k, r0 * H * D, n1)),
               v1 = up(part(in.v, r0 * H * D, n1)), g1 = up(part(in.g, r0 * H * D, n1)),
               b1 = up(part(in.beta, r0 * H, T * H));
          auto pool1 = up(pool0), o1 = k3test::dev_nan(size_t(n1));
          cu::DevBuf w1(cu::kda_tc_work_bytes(cu::kda_tc_chunks(one.cu.data(), 1), H, D), "kda tc work");
          cu::kda_chunked_tc_varlen(q1.as<float>(), k1.as<float>(), v1.as<float>(), g1.as<float>(), b1.as<float>(),
                                    d1.v, one.cu.data(), H, D, D, pool1.as<float>(), o1.as<float>(), w1.get(),
                                    cu::kda_tc_chunks(one.cu.data(), 1), nullptr);
          EXPECT_EQ(down(o1, size_t(n1)), part(oh, r0 * H * D, n1)) << "outputs: batched != alone";
          EXPECT_EQ(part(down(pool1, pool0.size()), sl * nS, nS), part(ph, sl * nS, nS)) << "state: batched != alone";
        }
      }
    }
  }
  std::printf("[kda tc] worst rel-L2 vs fp64 twin: outputs %.3g, states %.3g (tolerance %.3g)\n", worst_o, worst_s,
              k3test::kTolKdaBf16);
}

TEST(CudaVarlen, KdaTensorCoreBadArgumentsAndSizes) {
  // The workspace formula the memory plan uses (model/dims.h) is the kernel's own (no GPU needed).
  for (int64_t D : {16, 32, 64, 128}) {
    k3::KdaDims kd;
    kd.heads = 3;
    kd.head_dim = D;
    EXPECT_EQ(cu::kda_tc_work_bytes(5, 3, D), size_t(5 * 3 * kd.tc_record_bytes()));
    EXPECT_TRUE(cu::kda_tc_supported(D, D));
  }
  EXPECT_FALSE(cu::kda_tc_supported(64, 32));
  EXPECT_FALSE(cu::kda_tc_supported(48, 48));
  const int32_t cu_host[2] = {0, 4};
  cu::VarlenDev b{1, 4, cu_host, cu_host, 1};  // never dereferenced: the checks fail first
  float* f = reinterpret_cast<float*>(16);
  const auto msg = [&](auto&& fn) {
    try {
      fn();
    } catch (const k3::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string dims = msg([&] {
    cu::kda_chunked_tc_varlen(f, f, f, f, f, b, cu_host, 2, 48, 48, f, f, f, 4, nullptr);
  });
  EXPECT_NE(dims.find("head dims Dk=48"), std::string::npos) << dims;
  EXPECT_EQ(dims.find('\n'), std::string::npos) << dims;
  const std::string work = msg([&] {
    cu::kda_chunked_tc_varlen(f, f, f, f, f, b, cu_host, 2, 64, 64, f, f, nullptr, 4, nullptr);
  });
  EXPECT_NE(work.find("no workspace"), std::string::npos) << work;
  const std::string host = msg([&] {
    cu::kda_chunked_tc_varlen(f, f, f, f, f, b, nullptr, 2, 64, 64, f, f, f, 4, nullptr);
  });
  EXPECT_NE(host.find("host copy"), std::string::npos) << host;
  float* odd = reinterpret_cast<float*>(20);  // 4-byte aligned, not 16: the float4 loads refuse it
  const std::string align = msg([&] {
    cu::kda_chunked_tc_varlen(f, odd, f, f, f, b, cu_host, 2, 64, 64, f, f, f, 4, nullptr);
  });
  EXPECT_NE(align.find("16-byte aligned"), std::string::npos) << align;
  EXPECT_EQ(align.find('\n'), std::string::npos) << align;
}

// ================================================================ short conv
TEST(CudaVarlen, ShortConvSiluPerSequence) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(402);
  struct Shape {
    int64_t C, K, max_chunk;
  };
  // Chunks across 32-row tiles; K = 1 (no state), a generic width (7), the K3 channel count.
  for (const Shape sh : {Shape{37, 4, 70}, Shape{20, 7, 40}, Shape{33, 1, 5}, Shape{16, 3, 33}, Shape{12288, 4, 40}}) {
    for (int64_t N : {1, 3, 8, 32}) {
      const int64_t C = sh.C, K = sh.K, P = K - 1, nS = C * P;
      const Batch b = make_batch(rng, mixed_lengths(rng, N, sh.max_chunk), 2);
      SCOPED_TRACE(batch_name(b) + " C=" + std::to_string(C) + " K=" + std::to_string(K));
      const auto x = rand_vec(rng, size_t(b.rows * C), 0.05f, 2.0f), w = rand_vec(rng, size_t(C * K), 0.05f, 1.0f);
      const auto pool0 = rand_vec(rng, size_t(std::max<int64_t>(1, b.n_slots * nS)), 0.05f, 1.0f);
      auto pool_ref = pool0;
      auto o_ref = nan_vec(size_t(b.rows * C));
      for (int64_t i = 0; i < N; ++i) {
        const int64_t r0 = b.cu[size_t(i)];
        k3::ref::short_conv_silu(x.data() + r0 * C, b.len[size_t(i)], C, w.data(), K,
                                 pool_ref.data() + b.slots[size_t(i)] * nS, o_ref.data() + r0 * C);
      }
      const DevBatch db = upload(b);
      auto dx = up(x), dw = up(w), pool = up(pool0), o = k3test::dev_nan(size_t(b.rows * C));
      cu::short_conv_silu_varlen(dx.as<float>(), db.v, C, dw.as<float>(), K, pool.as<float>(), o.as<float>(), nullptr);
      const auto oh = down(o, size_t(b.rows * C));
      ASSERT_EQ(count_nan(oh), 0u);
      for (int64_t i = 0; i < N; ++i) {
        const int64_t r0 = b.cu[size_t(i)], T = b.len[size_t(i)];
        if (T > 0) {
          EXPECT_LT(rel_l2(part(oh, r0 * C, T * C), part(o_ref, r0 * C, T * C)), kTolConv) << "sequence " << i;
        }
      }
      // The carried inputs are exact copies (untouched slots and empty sequences included).
      EXPECT_EQ(down(pool, pool0.size()), pool_ref);
      // The single-sequence kernel on each sequence alone: the same bits.
      auto pool1 = up(pool0), o1 = k3test::dev_nan(size_t(b.rows * C));
      for (int64_t i = 0; i < N; ++i) {
        const int64_t r0 = b.cu[size_t(i)];
        cu::short_conv_silu(dx.as<float>() + r0 * C, b.len[size_t(i)], C, dw.as<float>(), K,
                            pool1.as<float>() + b.slots[size_t(i)] * nS, o1.as<float>() + r0 * C, nullptr);
      }
      EXPECT_EQ(bits(o1, size_t(b.rows * C)), bits(o, size_t(b.rows * C)));
      EXPECT_EQ(bits(pool1, pool0.size()), bits(pool, pool0.size()));
    }
  }
}

// The fused KDA decode inputs (kda_prepare_decode) against the seven separate kernels they replace
// (short_conv_silu_varlen x 3, l2norm_scale x 2, kda_gate, sigmoid_inplace), bit for bit: head widths
// of 1, 2 and 4 float4 per lane, conv widths 4 and 3 (and 1: no state), both gate forms (K3's lower
// bound, Kimi Linear's unbounded), a bad slot (NaN rows, no state touched), on a created stream.
TEST(CudaVarlen, KdaPrepareDecodeEqualsSeparateKernelsBitwise) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(405);
  const cu::Stream st = cu::stream_create();
  struct Shape {
    int64_t H, D, K;
    float lb;
  };
  for (const Shape sh : {Shape{3, 128, 4, -5.0f}, Shape{2, 256, 3, 0.0f}, Shape{5, 64, 1, -5.0f}, Shape{1, 512, 4, 0.0f}})
    for (int64_t N : {1, 7}) {
      const int64_t H = sh.H, D = sh.D, C = H * D, K = sh.K, nS = C * (K - 1);
      Batch b = make_batch(rng, std::vector<int64_t>(size_t(N), 1), 2);
      if (N > 1) b.slots[3] = int32_t(b.n_slots + 5);  // out of range: that row is NaN, nothing else moves
      SCOPED_TRACE(batch_name(b) + " H=" + std::to_string(H) + " D=" + std::to_string(D) + " K=" + std::to_string(K));
      const DevBatch db = upload(b);
      std::vector<cu::DevBuf> in, w, pool_a, pool_b;
      std::vector<std::vector<float>> pool0;
      for (int m = 0; m < 3; ++m) {
        in.push_back(up(rand_vec(rng, size_t(N * C), 0.05f, 2.0f)));
        w.push_back(up(rand_vec(rng, size_t(C * K), 0.05f, 1.0f)));
        pool0.push_back(rand_vec(rng, size_t(std::max<int64_t>(1, b.n_slots * nS)), 0.05f, 1.0f));
        pool_a.push_back(up(pool0.back()));
        pool_b.push_back(up(pool0.back()));
      }
      const auto f = up(rand_vec(rng, size_t(N * C), 0.01f, 6.0f)), A_log = up(rand_vec(rng, size_t(H), 0.05f, 0.7f)),
                 dt_bias = up(rand_vec(rng, size_t(C), 0.05f, 1.0f));
      const auto beta0 = rand_vec(rng, size_t(N * H), 0.05f, 3.0f);
      const float q_scale = float(1.0 / std::sqrt(double(D)));
      // Fused.
      std::vector<cu::DevBuf> out_a;
      for (int m = 0; m < 3; ++m) out_a.push_back(k3test::dev_nan(size_t(N * C)));
      auto g_a = k3test::dev_nan(size_t(N * C)), beta_a = up(beta0);
      cu::KdaPrepDev a;
      for (int m = 0; m < 3; ++m) {
        a.in[m] = in[size_t(m)].as<float>();
        a.out[m] = out_a[size_t(m)].as<float>();
        a.w[m] = w[size_t(m)].as<float>();
        a.state[m] = pool_a[size_t(m)].as<float>();
      }
      a.C = C, a.H = H, a.D = D, a.K = int(K), a.q_scale = q_scale, a.eps = 1e-6f;
      a.f = f.as<float>(), a.A_log = A_log.as<float>(), a.dt_bias = dt_bias.as<float>(), a.lb = sh.lb;
      a.g = g_a.as<float>(), a.beta = beta_a.as<float>();
      ASSERT_TRUE(cu::kda_prepare_decode_ok(a));
      cu::kda_prepare_decode(a, db.v, st);
      // Separate.
      std::vector<cu::DevBuf> out_b;
      for (int m = 0; m < 3; ++m) out_b.push_back(k3test::dev_nan(size_t(N * C)));
      auto g_b = k3test::dev_nan(size_t(N * C)), beta_b = up(beta0);
      for (int m = 0; m < 3; ++m)
        cu::short_conv_silu_varlen(in[size_t(m)].as<float>(), db.v, C, w[size_t(m)].as<float>(), K,
                                   pool_b[size_t(m)].as<float>(), out_b[size_t(m)].as<float>(), st);
      cu::l2norm_scale(out_b[0].as<float>(), N * H, D, 1e-6f, q_scale, st);
      cu::l2norm_scale(out_b[1].as<float>(), N * H, D, 1e-6f, 1.0f, st);
      cu::kda_gate(f.as<float>(), N, H, D, A_log.as<float>(), dt_bias.as<float>(), sh.lb, g_b.as<float>(), st);
      cu::sigmoid_inplace(beta_b.as<float>(), N * H, st);
      cu::sync(st);
      for (int m = 0; m < 3; ++m) {
        const auto got = down(out_a[size_t(m)], size_t(N * C)), want = down(out_b[size_t(m)], size_t(N * C));
        EXPECT_EQ(bits(got), bits(want)) << "output " << m;
        EXPECT_EQ(count_nan(got), N > 1 ? size_t(C) : 0u) << "output " << m << ": only the bad slot's row is NaN";
        EXPECT_EQ(bits(pool_a[size_t(m)], pool0[size_t(m)].size()), bits(pool_b[size_t(m)], pool0[size_t(m)].size()));
      }
      EXPECT_EQ(bits(g_a, size_t(N * C)), bits(g_b, size_t(N * C)));
      EXPECT_EQ(bits(beta_a, size_t(N * H)), bits(beta_b, size_t(N * H)));
    }
  // Prefill rows (a sequence of 2) are refused: the caller runs the separate kernels then.
  {
    const Batch b = make_batch(rng, {2, 1}, 0);
    const DevBatch db = upload(b);
    cu::KdaPrepDev a;
    a.C = 128, a.H = 1, a.D = 128, a.K = 4;
    EXPECT_NE(k3test::error_of_call([&] { cu::kda_prepare_decode(a, db.v, st); }).find("decode rows only"),
              std::string::npos);
  }
  cu::stream_destroy(st);
}

// ================================================================ paged MLA
struct MlaShape {
  int64_t heads, nope, rope, v, kv_lora;
  k3::WFormat fmt;
};
k3::MlaAttnDims dims_of(const MlaShape& m) {
  return k3::MlaAttnDims{m.heads, m.nope, m.rope, m.v, m.kv_lora, 1.0f / std::sqrt(float(m.nope + m.rope))};
}

// A paged pool on the host: every sequence's pages drawn from a shuffled list of page ids (so they
// are neither contiguous nor in order), a few spare pages no one owns, capacity for `cap[i]`
// tokens per sequence; unset entries of the table are -1 and every float starts as NaN (a read of
// a page or row no sequence owns shows up in the results).
struct HostPool {
  int64_t pt = 0, width = 0, max_pages = 0, n_pages = 0;
  std::vector<int32_t> table;  // [N, max_pages]
  std::vector<float> pages;    // [n_pages, pt, width]
  float* row(int64_t seq, int64_t pos) {
    const int32_t pg = table[size_t(seq * max_pages + pos / pt)];
    return pages.data() + (int64_t(pg) * pt + pos % pt) * width;
  }
};

HostPool make_pool(std::mt19937& rng, const std::vector<int64_t>& cap, int64_t pt, int64_t width, int64_t spare_pages) {
  HostPool p;
  p.pt = pt;
  p.width = width;
  int64_t total = 0;
  for (int64_t c : cap) {
    p.max_pages = std::max(p.max_pages, (c + pt - 1) / pt + 1);  // one more than needed: capacity
    total += (c + pt - 1) / pt;
  }
  p.n_pages = total + spare_pages;
  std::vector<int32_t> ids(size_t(p.n_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.table.assign(size_t(int64_t(cap.size()) * p.max_pages), -1);
  size_t next = 0;
  for (size_t i = 0; i < cap.size(); ++i)
    for (int64_t j = 0; j < (cap[i] + pt - 1) / pt; ++j) p.table[i * size_t(p.max_pages) + size_t(j)] = ids[next++];
  p.pages.assign(size_t(p.n_pages * pt * width), k3test::qnan());
  return p;
}

// The device side of a pool plus pos0, as PagedCacheDev.
struct DevPool {
  cu::DevBuf pages, table, pos0;
  cu::PagedCacheDev c;
};
DevPool upload(const HostPool& p, const std::vector<int32_t>& pos0) {
  DevPool d;
  d.pages = up(p.pages);
  d.table = up(p.table);
  d.pos0 = up(pos0);
  d.c.pages = d.pages.as<float>();
  d.c.page_tokens = p.pt;
  d.c.block_table = d.table.as<int32_t>();
  d.c.max_pages = p.max_pages;
  d.c.pos0 = d.pos0.as<int32_t>();
  d.c.n_pages = p.n_pages;
  return d;
}

// Cached tokens before the step: a mix of empty, short and long (up to 3000) prior contexts.
std::vector<int64_t> prior_contexts(std::mt19937& rng, int64_t n, int64_t longest) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (i % 3) {
      case 0:
        p[size_t(i)] = std::uniform_int_distribution<int64_t>(longest / 3, longest)(rng);
        break;
      case 1:
        p[size_t(i)] = std::uniform_int_distribution<int64_t>(1, 50)(rng);
        break;
      default:
        p[size_t(i)] = i % 2 ? 0 : std::uniform_int_distribution<int64_t>(1, 9)(rng);
    }
  }
  std::shuffle(p.begin(), p.end(), rng);
  return p;
}

// ref twin of one step for sequence i: the pool's rows 0..S-1 gathered into a contiguous cache.
std::vector<float> ref_attend(HostPool& p, int64_t i, int64_t pos0, int64_t T, const float* q, const k3::WeightMat& kvb,
                              const k3::MlaAttnDims& d) {
  const int64_t S = pos0 + T, L = d.kv_lora, R = d.rope;
  std::vector<float> c(size_t(S * L)), kr(size_t(S * R));
  for (int64_t s = 0; s < S; ++s) {
    const float* row = p.row(i, s);
    std::copy_n(row, L, c.data() + s * L);
    std::copy_n(row + L, R, kr.data() + s * R);
  }
  auto out = nan_vec(size_t(T * d.heads * d.v));
  k3::ref::mla_attend_absorbed(q, T, c.data(), kr.data(), S, pos0, kvb, d, out.data());
  return out;
}

TEST(CudaVarlen, PagedMlaAppendAndAttendPerSequence) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(403);
  struct Case {
    MlaShape m;
    int64_t N, pt, longest, max_chunk;
  };
  const MlaShape small{5, 16, 8, 12, 64, k3::WFormat::BF16}, odd{3, 10, 6, 7, 30, k3::WFormat::F16},
      k3{96, 128, 64, 128, 512, k3::WFormat::BF16};
  // Small heads for every batch size and both page sizes with long contexts; widths off the
  // 16-byte paths (kv_lora 30, rope 6); the K3 shape with long contexts at N = 8 and many
  // sequences at N = 32 (contexts kept short there: the fp64 twin is the slow part).
  const Case cases[] = {
      {small, 1, 64, 3000, 40},  {small, 3, 5, 3000, 40}, {small, 8, 64, 3000, 20}, {small, 32, 5, 3000, 12},
      {small, 32, 64, 1500, 70}, {odd, 8, 5, 700, 9},     {odd, 3, 64, 200, 40},    {k3, 8, 64, 3000, 4},
      {k3, 32, 5, 300, 6},       {k3, 1, 5, 2000, 3},
  };
  for (const Case& cs : cases) {
    const k3::MlaAttnDims d = dims_of(cs.m);
    const int64_t N = cs.N, L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope;
    const Batch b = make_batch(rng, mixed_lengths(rng, N, cs.max_chunk), 0);
    const auto prior = prior_contexts(rng, N, cs.longest);
    std::vector<int64_t> cap(static_cast<size_t>(N));
    std::vector<int32_t> pos0(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) {
      cap[size_t(i)] = prior[size_t(i)] + b.len[size_t(i)];
      pos0[size_t(i)] = int32_t(prior[size_t(i)]);
    }
    SCOPED_TRACE(batch_name(b) + " pt=" + std::to_string(cs.pt) + " heads=" + std::to_string(d.heads) +
                 " L=" + std::to_string(L) + " R=" + std::to_string(R));
    HostPool hp = make_pool(rng, cap, cs.pt, X, 3);
    for (int64_t i = 0; i < N; ++i)  // the prior context: normalised-looking latents and rope keys
      for (int64_t s = 0; s < prior[size_t(i)]; ++s) {
        const auto r = rand_vec(rng, size_t(X), 0.05f, 1.5f);
        std::copy(r.begin(), r.end(), hp.row(i, s));
      }
    const auto ckv = rand_vec(rng, size_t(b.rows * X), 0.05f, 3.0f), norm_w = rand_vec(rng, size_t(L), 0.5f, 1.5f);
    const auto q = rand_vec(rng, size_t(b.rows * d.heads * dq));
    k3test::OwnedW kvb = k3test::make_weight(rng, cs.m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
    const DevBatch db = upload(b);
    DevPool dp = upload(hp, pos0);
    auto dckv = up(ckv), dnw = up(norm_w), dqv = up(q);
    k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
    // 1. Append, against the host pool with the twin's rows written in.
    cu::mla_cache_append_paged(dckv.as<float>(), db.v, dp.c, L, R, dnw.as<float>(), 1e-6f, nullptr);
    const auto got_pages = down(dp.pages, hp.pages.size());
    HostPool want = hp;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < b.len[size_t(i)]; ++j) {
        const float* x = ckv.data() + (b.cu[size_t(i)] + j) * X;
        float* row = want.row(i, prior[size_t(i)] + j);
        k3::ref::rmsnorm(x, 1, L, norm_w.data(), 1e-6f, row);
        std::copy_n(x + L, R, row + L);
      }
    size_t appended_bad = 0, other_bad = 0;
    double worst = 0;
    for (int64_t r = 0; r < hp.n_pages * hp.pt; ++r) {
      const float *g = got_pages.data() + r * X, *w = want.pages.data() + r * X, *h = hp.pages.data() + r * X;
      const bool appended = !std::isnan(w[0]) && std::isnan(h[0]);
      if (!appended) {  // untouched: the prior context, or NaN where no sequence has a token
        for (int64_t x = 0; x < X; ++x) other_bad += !(g[x] == w[x] || (std::isnan(g[x]) && std::isnan(w[x])));
        continue;
      }
      const double e = rel_l2(g, w, size_t(L));
      worst = std::max(worst, e);
      appended_bad += e >= kTolElementwise;
      for (int64_t x = L; x < X; ++x) appended_bad += g[x] != w[x];  // k_r: a raw copy
    }
    EXPECT_EQ(appended_bad, 0u) << "appended rows off (worst latent rel-L2 " << worst << ")";
    EXPECT_EQ(other_bad, 0u) << "floats changed outside the appended rows";
    // 2. Attention over the device pool (the twin reads the same pool, gathered per sequence).
    hp.pages = got_pages;
    std::vector<std::vector<float>> refs(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i)
      if (b.len[size_t(i)] > 0)
        refs[size_t(i)] =
            ref_attend(hp, i, prior[size_t(i)], b.len[size_t(i)], q.data() + b.cu[size_t(i)] * d.heads * dq, kvb.w, d);
    const size_t nO = size_t(b.rows * d.heads * d.v);
    auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(b.rows, N, d)));
    for (cu::Precision p : {cu::Precision::F32, cu::Precision::BF16}) {
      SCOPED_TRACE(cu::precision_name(p));
      auto dout = k3test::dev_nan(nO);
      cu::mla_attend_absorbed_paged(dqv.as<float>(), db.v, dp.c, dkvb.view, d, work.as<float>(), dout.as<float>(), p,
                                    nullptr);
      const auto got = down(dout, nO);
      ASSERT_EQ(count_nan(got), 0u);
      double max_err = 0;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t T = b.len[size_t(i)], n = T * d.heads * d.v;
        if (T == 0) continue;
        const double e = rel_l2(part(got, b.cu[size_t(i)] * d.heads * d.v, n), refs[size_t(i)]);
        max_err = std::max(max_err, e);
        EXPECT_LT(e, kTolMla) << "sequence " << i << " T=" << T << " pos0=" << prior[size_t(i)];
      }
      std::printf("[paged-mla] N=%lld pt=%lld heads=%lld L=%lld %s: max rel-L2 %.3g (tol %.0e)\n", (long long)N,
                  (long long)cs.pt, (long long)d.heads, (long long)L, cu::precision_name(p), max_err, kTolMla);
    }
    EXPECT_EQ(bits(dp.pages, hp.pages.size()), bits(hp.pages)) << "attention wrote into the pool";
  }
}

// The tensor-core prefill form (mla_attend_tc_paged) as the backend runs it: the absorbed kernel
// first, skipping the sequences the tensor-core kernel takes (prefill pieces of >= kMlaTcMinRows rows),
// then that kernel. Every sequence against the fp64 twin (tensor-core ones at kTolMlaTc, the rest at
// kTolMla); chunks of 64 and 192 keys carry the softmax over many chunks, the default chunk runs
// whole; page sizes 64 and 5; K3's head widths and the two smaller compiled ones (K3-nano's 48 + 64).
// A sequence's result is the same bits in the batch and alone, and the pool is never written.
TEST(CudaVarlen, MlaTensorCorePrefillPerSequence) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(407);
  struct Case {
    MlaShape m;
    int64_t pt;
    std::vector<int64_t> len, prior;
    int64_t chunk;  // 0: mla_tc_key_chunk
  };
  const MlaShape k3s{4, 128, 64, 128, 512, k3::WFormat::BF16}, mid{3, 64, 32, 64, 256, k3::WFormat::BF16},
      nano{5, 32, 16, 64, 128, k3::WFormat::BF16};
  const Case cases[] = {
      {k3s, 64, {300, 1, 70, 16, 0}, {200, 900, 0, 333, 7}, 64},
      {k3s, 5, {129, 3, 64}, {1000, 40, 0}, 192},
      {k3s, 64, {513, 1}, {1500, 2000}, 0},
      {mid, 5, {100, 17, 2}, {0, 250, 9}, 64},
      {nano, 64, {48, 15, 200}, {0, 3, 100}, 128},
      {nano, 5, {47}, {1}, 0},
  };
  for (const Case& cs : cases) {
    const k3::MlaAttnDims d = dims_of(cs.m);
    ASSERT_TRUE(k3::mla_tc_supported(d));
    const int64_t N = int64_t(cs.len.size()), L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope;
    const int64_t chunk = cs.chunk ? cs.chunk : k3::mla_tc_key_chunk(d);
    Batch b;
    b.len = cs.len;
    b.cu.push_back(0);
    for (int64_t l : b.len) b.cu.push_back(int32_t(b.cu.back() + l));
    b.rows = b.cu.back();
    b.n_slots = N;
    b.slots.resize(static_cast<size_t>(N));
    std::iota(b.slots.begin(), b.slots.end(), 0);
    const size_t n_seqs = static_cast<size_t>(N);
    std::vector<int64_t> cap(n_seqs), pos0l(cs.prior);
    std::vector<int32_t> pos0(n_seqs), skip(n_seqs);
    std::vector<uint8_t> use(n_seqs);
    for (int64_t i = 0; i < N; ++i) {
      cap[size_t(i)] = cs.prior[size_t(i)] + cs.len[size_t(i)];
      pos0[size_t(i)] = int32_t(cs.prior[size_t(i)]);
      use[size_t(i)] = skip[size_t(i)] = cs.len[size_t(i)] >= k3::kMlaTcMinRows;
    }
    SCOPED_TRACE(batch_name(b) + " pt=" + std::to_string(cs.pt) + " heads=" + std::to_string(d.heads) +
                 " dq=" + std::to_string(dq) + " chunk=" + std::to_string(chunk));
    HostPool hp = make_pool(rng, cap, cs.pt, X, 2);
    for (int64_t i = 0; i < N; ++i)  // the whole context, the step's own tokens included (already appended)
      for (int64_t s = 0; s < cap[size_t(i)]; ++s) {
        const auto r = rand_vec(rng, size_t(X), 0.05f, 1.5f);
        std::copy(r.begin(), r.end(), hp.row(i, s));
      }
    const auto q = rand_vec(rng, size_t(b.rows * d.heads * dq));
    k3test::OwnedW kvb = k3test::make_weight(rng, cs.m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
    const DevBatch db = upload(b);
    DevPool dp = upload(hp, pos0);
    auto dqv = up(q), dskip = up(skip);
    k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
    auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(b.rows, N, d)));
    cu::DevBuf tcw(size_t(k3::mla_tc_work_bytes(chunk, b.rows, d)), "test MLA tc workspace");
    const size_t nO = size_t(b.rows * d.heads * d.v);
    auto dout = k3test::dev_nan(nO);
    cu::mla_attend_absorbed_paged(dqv.as<float>(), db.v, dp.c, dkvb.view, d, work.as<float>(), dout.as<float>(),
                                  cu::Precision::BF16, nullptr, dskip.as<int32_t>());
    cu::mla_attend_tc_paged(dqv.as<float>(), db.v, dp.c, b.cu.data(), pos0l.data(), use.data(), dkvb.view, d, chunk,
                            tcw.get(), dout.as<float>(), nullptr);
    const auto got = down(dout, nO);
    ASSERT_EQ(count_nan(got), 0u);
    double worst_tc = 0, worst_abs = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t T = b.len[size_t(i)], n = T * d.heads * d.v, o0 = b.cu[size_t(i)] * d.heads * d.v;
      if (T == 0) continue;
      const auto ref = ref_attend(hp, i, cs.prior[size_t(i)], T, q.data() + b.cu[size_t(i)] * d.heads * dq, kvb.w, d);
      const double e = rel_l2(part(got, o0, n), ref);
      const double tol = use[size_t(i)] ? k3test::kTolMlaTc : kTolMla;
      (use[size_t(i)] ? worst_tc : worst_abs) = std::max(use[size_t(i)] ? worst_tc : worst_abs, e);
      EXPECT_LT(e, tol) << "sequence " << i << " T=" << T << " pos0=" << cs.prior[size_t(i)];
      if (!use[size_t(i)]) continue;
      // Alone: a one-sequence batch of the same rows and pages gives the same bits.
      const std::vector<int32_t> cu1{0, int32_t(T)}, sl1{0}, p1{pos0[size_t(i)]};
      const std::vector<int64_t> p1l{cs.prior[size_t(i)]};
      auto dcu1 = up(cu1), dsl1 = up(sl1), dp1 = up(p1);
      auto dtab1 = up(std::vector<int32_t>(hp.table.begin() + i * hp.max_pages, hp.table.begin() + (i + 1) * hp.max_pages));
      cu::VarlenDev v1{1, T, dcu1.as<int32_t>(), dsl1.as<int32_t>(), 1};
      cu::PagedCacheDev c1 = dp.c;
      c1.block_table = dtab1.as<int32_t>();
      c1.pos0 = dp1.as<int32_t>();
      auto dq1 = up(part(q, b.cu[size_t(i)] * d.heads * dq, T * d.heads * dq));
      auto dout1 = k3test::dev_nan(size_t(n));
      cu::mla_attend_tc_paged(dq1.as<float>(), v1, c1, cu1.data(), p1l.data(), nullptr, dkvb.view, d, chunk, tcw.get(),
                              dout1.as<float>(), nullptr);
      EXPECT_EQ(bits(dout1, size_t(n)), bits(part(got, o0, n))) << "sequence " << i << ": batched != alone";
    }
    std::printf("[mla tc] heads=%lld dq=%lld v=%lld L=%lld pt=%lld chunk=%lld N=%lld: tensor-core max rel-L2 %.3g "
                "(tol %.0e), absorbed %.3g (tol %.0e)\n",
                (long long)d.heads, (long long)dq, (long long)d.v, (long long)L, (long long)cs.pt, (long long)chunk,
                (long long)N, worst_tc, k3test::kTolMlaTc, worst_abs, kTolMla);
    EXPECT_EQ(bits(dp.pages, hp.pages.size()), bits(hp.pages)) << "attention wrote into the pool";
  }
}

// Its refusals: unsupported widths, a non-BF16 kv_b, a bad chunk: one line each, nothing launched.
TEST(CudaVarlen, MlaTensorCoreBadArguments) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(408);
  const MlaShape ok{2, 128, 64, 128, 64, k3::WFormat::BF16};
  const k3::MlaAttnDims d = dims_of(ok);
  HostPool hp = make_pool(rng, {40}, 64, d.kv_lora + d.rope, 0);
  DevPool dp = upload(hp, {0});
  Batch b = make_batch(rng, {40}, 0);
  const DevBatch db = upload(b);
  const std::vector<int64_t> p0{0};
  auto q = k3test::dev_nan(size_t(40 * d.heads * (d.nope + d.rope))), out = k3test::dev_nan(size_t(40 * d.heads * d.v));
  cu::DevBuf w(size_t(k3::mla_tc_work_bytes(64, 40, d)), "test");
  k3test::OwnedW bf = k3test::make_weight(rng, k3::WFormat::BF16, d.heads * (d.nope + d.v), d.kv_lora, 0.5f);
  k3test::OwnedW f16 = k3test::make_weight(rng, k3::WFormat::F16, d.heads * (d.nope + d.v), d.kv_lora, 0.5f);
  k3test::DevWeight dbf = k3test::upload_weight(bf.w), df16 = k3test::upload_weight(f16.w);
  const auto call = [&](const k3::WeightMat& kv, const k3::MlaAttnDims& dd, int64_t chunk) {
    cu::mla_attend_tc_paged(q.as<float>(), db.v, dp.c, b.cu.data(), p0.data(), nullptr, kv, dd, chunk, w.get(),
                            out.as<float>(), nullptr);
  };
  const auto expect_error = [](auto&& f, const char* op, const char* arg) {
    const std::string msg = k3test::error_of_call(f);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_NE(msg.find(arg), std::string::npos) << msg;
  };
  expect_error([&] { call(df16.view, d, 64); }, "mla_attend_tc_paged", "BF16");
  expect_error([&] { call(dbf.view, d, 100); }, "mla_attend_tc_paged", "key_chunk");
  k3::MlaAttnDims odd = d;
  odd.v = 96;
  expect_error([&] { call(dbf.view, odd, 64); }, "mla_attend_tc_paged", "not compiled");
  EXPECT_FALSE(k3::mla_tc_supported(dims_of({5, 16, 8, 12, 64, k3::WFormat::BF16})));
  EXPECT_TRUE(k3::mla_tc_supported(dims_of({96, 128, 64, 128, 512, k3::WFormat::BF16})));
}

// A block table pointing outside the pool (or a position past the table) must not turn into a
// stray write or read: append skips the row, attention gives that sequence NaN, others unharmed.
TEST(CudaVarlen, PagedBadTableIsLoudNotAStrayAccess) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(404);
  const MlaShape m{4, 8, 4, 8, 16, k3::WFormat::F32};
  const k3::MlaAttnDims d = dims_of(m);
  const int64_t L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope;
  const Batch b = make_batch(rng, {1, 1}, 0);
  HostPool hp = make_pool(rng, {6, 6}, 4, X, 0);  // 2 pages each (max_pages 3)
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t s = 0; s < 5; ++s) {
      const auto r = rand_vec(rng, size_t(X));
      std::copy(r.begin(), r.end(), hp.row(i, s));
    }
  hp.table[size_t(hp.max_pages + 1)] = int32_t(hp.n_pages);  // sequence 1's second page: outside the pool
  const auto ckv = rand_vec(rng, size_t(2 * X)), nw = rand_vec(rng, size_t(L), 0.5f, 1.5f);
  const auto q = rand_vec(rng, size_t(2 * d.heads * dq));
  k3test::OwnedW kvb = k3test::make_weight(rng, m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
  k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
  const DevBatch db = upload(b);
  DevPool dp = upload(hp, {5, 5});
  const auto pages_before = bits(hp.pages);
  auto dckv = up(ckv), dnw = up(nw), dqv = up(q), dout = k3test::dev_nan(size_t(2 * d.heads * d.v));
  auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(2, 2, d)));
  cu::mla_cache_append_paged(dckv.as<float>(), db.v, dp.c, L, R, dnw.as<float>(), 1e-6f, nullptr);
  cu::mla_attend_absorbed_paged(dqv.as<float>(), db.v, dp.c, dkvb.view, d, work.as<float>(), dout.as<float>(),
                                cu::Precision::F32, nullptr);
  const auto got = down(dout, size_t(2 * d.heads * d.v)), pages = down(dp.pages, hp.pages.size());
  const int64_t n = d.heads * d.v;
  // Sequence 0 is fine and matches the twin; sequence 1's row is NaN.
  hp.pages = pages;
  EXPECT_LT(rel_l2(part(got, 0, n), ref_attend(hp, 0, 5, 1, q.data(), kvb.w, d)), kTolMla);
  EXPECT_EQ(count_nan(part(got, n, n)), size_t(n));
  // Only sequence 0's new row changed in the pool.
  const int64_t new_row = (hp.row(0, 5) - hp.pages.data()) / X;
  EXPECT_EQ(count_nan(part(pages, new_row * X, X)), 0u);
  auto pages_bits = bits(pages);
  std::copy_n(pages_before.begin() + new_row * X, X, pages_bits.begin() + new_row * X);
  EXPECT_EQ(pages_bits, pages_before);
}

// ================================================================ a decode step as a graph
// KDA + MLA append + attention for N = 8 sequences, captured once; between replays the device
// arrays change as a scheduler changes them: every sequence grows by one token (pos0), pages are
// added from a shuffled free list when a sequence crosses a page (block table), and the batch
// order is reshuffled (slots, pos0 and table rows all move). Each step against the twins.
TEST(CudaVarlen, DecodeStepGraphReplaysAsSlotsPagesAndPositionsMove) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(405);
  const int64_t N = 8, H = 8, Dk = 128, Dv = 128, nS = H * Dk * Dv, steps = 5, pt = 5, n_slots = N + 4;
  const MlaShape m{32, 128, 64, 128, 512, k3::WFormat::BF16};
  const k3::MlaAttnDims d = dims_of(m);
  const int64_t L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope;
  const float eps = 1e-6f;
  // Logical sequences: slot, length, pages (a host mirror of the pool).
  std::vector<int32_t> slot_of(static_cast<size_t>(N));
  {
    std::vector<int32_t> s(static_cast<size_t>(n_slots));
    std::iota(s.begin(), s.end(), 0);
    std::shuffle(s.begin(), s.end(), rng);
    slot_of.assign(s.begin(), s.begin() + N);
  }
  std::vector<int64_t> len(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) len[size_t(i)] = std::uniform_int_distribution<int64_t>(1, 300)(rng);
  len[3] = pt * 7 - 1;  // crosses a page boundary at the first step
  const int64_t max_pages = (*std::max_element(len.begin(), len.end()) + steps) / pt + 2;
  const int64_t n_pages = N * max_pages + 5;
  std::vector<int32_t> free_pages(static_cast<size_t>(n_pages));
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(), rng);
  std::vector<std::vector<int32_t>> pages_of(static_cast<size_t>(N));
  std::vector<float> pool_h(size_t(n_pages * pt * X), k3test::qnan());
  const auto page_row = [&](int64_t lseq, int64_t pos) {
    return pool_h.data() + (int64_t(pages_of[size_t(lseq)][size_t(pos / pt)]) * pt + pos % pt) * X;
  };
  const auto ensure_pages = [&](int64_t lseq, int64_t tokens) {
    while (int64_t(pages_of[size_t(lseq)].size()) * pt < tokens) {
      pages_of[size_t(lseq)].push_back(free_pages.back());
      free_pages.pop_back();
    }
  };
  for (int64_t i = 0; i < N; ++i) {
    ensure_pages(i, len[size_t(i)]);
    for (int64_t s = 0; s < len[size_t(i)]; ++s) {
      const auto r = rand_vec(rng, size_t(X), 0.05f, 1.5f);
      std::copy(r.begin(), r.end(), page_row(i, s));
    }
  }
  auto kda_pool_h = rand_vec(rng, size_t(n_slots * nS), 0.01f, 0.5f);
  const auto kda_pool0 = kda_pool_h;
  const auto norm_w = rand_vec(rng, size_t(L), 0.5f, 1.5f);
  k3test::OwnedW kvb = k3test::make_weight(rng, m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
  k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
  // Device buffers, fixed for the graph.
  std::vector<int32_t> cu_rows(size_t(N + 1));
  std::iota(cu_rows.begin(), cu_rows.end(), 0);
  auto dcu = up(cu_rows), dslots = up(std::vector<int32_t>(size_t(N), 0)),
       dpos0 = up(std::vector<int32_t>(size_t(N), 0));
  auto dtable = up(std::vector<int32_t>(size_t(N * max_pages), -1)), dpool = up(pool_h), dkda = up(kda_pool_h);
  auto dq_k = k3test::dev_nan(size_t(N * H * Dk)), dk_k = k3test::dev_nan(size_t(N * H * Dk));
  auto dg_k = k3test::dev_nan(size_t(N * H * Dk)), dv_k = k3test::dev_nan(size_t(N * H * Dv));
  auto db_k = k3test::dev_nan(size_t(N * H)), do_k = k3test::dev_nan(size_t(N * H * Dv));
  auto dckv = k3test::dev_nan(size_t(N * X)), dqm = k3test::dev_nan(size_t(N * d.heads * dq));
  auto dout = k3test::dev_nan(size_t(N * d.heads * d.v)), dnw = up(norm_w);
  auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(N, N, d)));
  cu::VarlenDev vb;
  vb.n_seqs = N;
  vb.rows = N;
  vb.cu_rows = dcu.as<int32_t>();
  vb.slots = dslots.as<int32_t>();
  vb.n_slots = n_slots;
  cu::PagedCacheDev pc;
  pc.pages = dpool.as<float>();
  pc.page_tokens = pt;
  pc.block_table = dtable.as<int32_t>();
  pc.max_pages = max_pages;
  pc.pos0 = dpos0.as<int32_t>();
  pc.n_pages = n_pages;
  cu::Stream s = cu::stream_create();
  cu::capture_begin(s);
  cu::kda_recurrent_varlen(dq_k.as<float>(), dk_k.as<float>(), dv_k.as<float>(), dg_k.as<float>(), db_k.as<float>(), vb,
                           H, Dk, Dv, dkda.as<float>(), do_k.as<float>(), s);
  cu::mla_cache_append_paged(dckv.as<float>(), vb, pc, L, R, dnw.as<float>(), eps, s);
  cu::mla_attend_absorbed_paged(dqm.as<float>(), vb, pc, dkvb.view, d, work.as<float>(), dout.as<float>(),
                                cu::Precision::F32, s);
  cu::GraphExec graph = cu::capture_end(s);
  std::vector<int64_t> order(static_cast<size_t>(N));  // batch index -> logical sequence
  std::iota(order.begin(), order.end(), 0);
  for (int64_t step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> slots(static_cast<size_t>(N)), pos0(static_cast<size_t>(N)), table(size_t(N * max_pages), -1);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t l = order[size_t(i)];
      ensure_pages(l, len[size_t(l)] + 1);
      slots[size_t(i)] = slot_of[size_t(l)];
      pos0[size_t(i)] = int32_t(len[size_t(l)]);
      std::copy(pages_of[size_t(l)].begin(), pages_of[size_t(l)].end(), table.begin() + i * max_pages);
    }
    const auto kin = k3test::make_kda(rng, N, H, Dk, Dv);
    const auto ckv = rand_vec(rng, size_t(N * X), 0.05f, 3.0f), qm = rand_vec(rng, size_t(N * d.heads * dq));
    const auto put = [&](cu::DevBuf& dst, const auto& v) { cu::h2d(dst.get(), v.data(), v.size() * sizeof(v[0]), s); };
    put(dslots, slots);
    put(dpos0, pos0);
    put(dtable, table);
    put(dq_k, kin.q);
    put(dk_k, kin.k);
    put(dv_k, kin.v);
    put(dg_k, kin.g);
    put(db_k, kin.beta);
    put(dckv, ckv);
    put(dqm, qm);
    cu::graph_launch(graph, s);
    std::vector<float> o_k(size_t(N * H * Dv)), out(size_t(N * d.heads * d.v));
    cu::d2h(o_k.data(), do_k.get(), o_k.size() * 4, s);
    cu::d2h(out.data(), dout.get(), out.size() * 4, s);
    ASSERT_EQ(count_nan(o_k), 0u);
    ASSERT_EQ(count_nan(out), 0u);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t l = order[size_t(i)], pos = len[size_t(l)];
      SCOPED_TRACE("batch row " + std::to_string(i) + " pos " + std::to_string(pos));
      auto ok = nan_vec(size_t(H * Dv));
      k3::ref::kda_recurrent(kin.q.data() + i * H * Dk, kin.k.data() + i * H * Dk, kin.v.data() + i * H * Dv,
                             kin.g.data() + i * H * Dk, kin.beta.data() + i * H, 1, H, Dk, Dv,
                             kda_pool_h.data() + slot_of[size_t(l)] * nS, ok.data());
      EXPECT_LT(rel_l2(part(o_k, i * H * Dv, H * Dv), ok), kTolKda);
      float* row = page_row(l, pos);
      k3::ref::rmsnorm(ckv.data() + i * X, 1, L, norm_w.data(), eps, row);
      std::copy_n(ckv.data() + i * X + L, R, row + L);
      std::vector<float> c(size_t((pos + 1) * L)), kr(size_t((pos + 1) * R));
      for (int64_t t = 0; t <= pos; ++t) {
        std::copy_n(page_row(l, t), L, c.data() + t * L);
        std::copy_n(page_row(l, t) + L, R, kr.data() + t * R);
      }
      auto ref = nan_vec(size_t(d.heads * d.v));
      k3::ref::mla_attend_absorbed(qm.data() + i * d.heads * dq, 1, c.data(), kr.data(), pos + 1, pos, kvb.w, d,
                                   ref.data());
      EXPECT_LT(rel_l2(part(out, i * d.heads * d.v, d.heads * d.v), ref), kTolMla);
      len[size_t(l)] = pos + 1;
    }
  }
  cu::sync(s);
  // Every slot's state: the batch's against the twin, the others as they were.
  const auto kda_got = down(dkda, kda_pool_h.size());
  for (int64_t sl = 0; sl < n_slots; ++sl) {
    if (std::find(slot_of.begin(), slot_of.end(), int32_t(sl)) != slot_of.end()) {
      EXPECT_LT(rel_l2(part(kda_got, sl * nS, nS), part(kda_pool_h, sl * nS, nS)), kTolKda) << "slot " << sl;
    } else {
      EXPECT_EQ(part(kda_got, sl * nS, nS), part(kda_pool0, sl * nS, nS)) << "slot " << sl;
    }
  }
  cu::graph_destroy(graph);
  cu::stream_destroy(s);
}

// ================================================================ bad arguments
// One-line k3::Error naming the op and the argument, before anything is launched (no GPU needed).
TEST(CudaVarlen, BadArgumentsAreOneLineErrors) {
  int32_t dummy_i[2] = {0, 1};
  float dummy_f[4] = {1, 2, 3, 4};
  const int32_t* dev_like = dummy_i;  // never dereferenced: every call below fails its checks first
  cu::VarlenDev ok;
  ok.n_seqs = 1;
  ok.rows = 1;
  ok.cu_rows = dev_like;
  ok.slots = dev_like;
  ok.n_slots = 1;
  cu::PagedCacheDev pc;
  pc.pages = dummy_f;
  pc.page_tokens = 64;
  pc.block_table = dev_like;
  pc.max_pages = 1;
  pc.pos0 = dev_like;
  pc.n_pages = 1;
  const k3::MlaAttnDims d{1, 1, 1, 1, 1, 1.0f};
  k3::WeightMat kvb;
  const auto expect_error = [](auto&& f, const char* op, const char* arg) {
    const std::string msg = k3test::error_of_call(f);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_NE(msg.find(arg), std::string::npos) << msg;
  };
  for (int64_t n : {0, -1}) {
    cu::VarlenDev b = ok;
    b.n_seqs = n;
    expect_error(
        [&] {
          cu::kda_recurrent_varlen(dummy_f, dummy_f, dummy_f, dummy_f, dummy_f, b, 1, 4, 4, dummy_f, dummy_f, nullptr);
        },
        "kda_recurrent_varlen", "n_seqs");
    expect_error(
        [&] {
          cu::kda_chunked_varlen(dummy_f, dummy_f, dummy_f, dummy_f, dummy_f, b, 1, 4, 4, 16, dummy_f, dummy_f,
                                 nullptr);
        },
        "kda_chunked_varlen", "n_seqs");
    expect_error([&] { cu::short_conv_silu_varlen(dummy_f, b, 4, dummy_f, 4, dummy_f, dummy_f, nullptr); },
                 "short_conv_silu_varlen", "n_seqs");
    expect_error([&] { cu::mla_cache_append_paged(dummy_f, b, pc, 1, 1, dummy_f, 1e-6f, nullptr); },
                 "mla_cache_append_paged", "n_seqs");
    expect_error(
        [&] { cu::mla_attend_absorbed_paged(dummy_f, b, pc, kvb, d, dummy_f, dummy_f, cu::Precision::F32, nullptr); },
        "mla_attend_absorbed_paged", "n_seqs");
  }
  {
    cu::VarlenDev b = ok;
    b.cu_rows = nullptr;
    expect_error(
        [&] {
          cu::kda_recurrent_varlen(dummy_f, dummy_f, dummy_f, dummy_f, dummy_f, b, 1, 4, 4, dummy_f, dummy_f, nullptr);
        },
        "kda_recurrent_varlen", "cu_rows");
    expect_error([&] { cu::mla_cache_append_paged(dummy_f, b, pc, 1, 1, dummy_f, 1e-6f, nullptr); },
                 "mla_cache_append_paged", "cu_rows");
    b = ok;
    b.slots = nullptr;
    expect_error([&] { cu::short_conv_silu_varlen(dummy_f, b, 4, dummy_f, 4, dummy_f, dummy_f, nullptr); },
                 "short_conv_silu_varlen", "slots");
    b = ok;
    b.n_slots = 0;
    expect_error(
        [&] {
          cu::kda_recurrent_varlen(dummy_f, dummy_f, dummy_f, dummy_f, dummy_f, b, 1, 4, 4, dummy_f, dummy_f, nullptr);
        },
        "kda_recurrent_varlen", "n_slots");
  }
  for (int64_t ptok : {0, -3}) {
    cu::PagedCacheDev c = pc;
    c.page_tokens = ptok;
    expect_error([&] { cu::mla_cache_append_paged(dummy_f, ok, c, 1, 1, dummy_f, 1e-6f, nullptr); },
                 "mla_cache_append_paged", "page_tokens");
    expect_error(
        [&] { cu::mla_attend_absorbed_paged(dummy_f, ok, c, kvb, d, dummy_f, dummy_f, cu::Precision::BF16, nullptr); },
        "mla_attend_absorbed_paged", "page_tokens");
  }
  {
    cu::PagedCacheDev c = pc;
    c.pages = nullptr;
    expect_error([&] { cu::mla_cache_append_paged(dummy_f, ok, c, 1, 1, dummy_f, 1e-6f, nullptr); },
                 "mla_cache_append_paged", "pages");
    c = pc;
    c.block_table = nullptr;
    expect_error(
        [&] { cu::mla_attend_absorbed_paged(dummy_f, ok, c, kvb, d, dummy_f, dummy_f, cu::Precision::F32, nullptr); },
        "mla_attend_absorbed_paged", "block_table");
    c = pc;
    c.pos0 = nullptr;
    expect_error(
        [&] { cu::mla_attend_absorbed_paged(dummy_f, ok, c, kvb, d, dummy_f, dummy_f, cu::Precision::F32, nullptr); },
        "mla_attend_absorbed_paged", "pos0");
    c = pc;
    c.n_pages = 0;
    expect_error([&] { cu::mla_cache_append_paged(dummy_f, ok, c, 1, 1, dummy_f, 1e-6f, nullptr); },
                 "mla_cache_append_paged", "n_pages");
  }
  // A kv_b of the wrong shape (here an empty view) is named too.
  expect_error(
      [&] { cu::mla_attend_absorbed_paged(dummy_f, ok, pc, kvb, d, dummy_f, dummy_f, cu::Precision::F32, nullptr); },
      "mla_attend_absorbed_paged", "kv_b");
}

// ================================================================ decode-shape timings
// N = 32 sequences of one decode row each at ~4k cached tokens, K3 shapes (KDA 96 heads of 128,
// conv 12288 channels, MLA 96 heads, kv_lora 512, bf16 kv_b): each varlen op against the same work
// done by N single-sequence calls, both captured in a graph on a created stream (the model's
// launch path) and replayed; microseconds per step printed (they depend on the machine).
TEST(CudaVarlenBench, DecodeN32Ctx4kAgainstNSingleCalls) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(406);
  const int64_t N = 32, H = 96, Dk = 128, Dv = 128, nS = H * Dk * Dv, C = 12288, K = 4, pt = 64;
  const MlaShape m{96, 128, 64, 128, 512, k3::WFormat::BF16};
  const k3::MlaAttnDims d = dims_of(m);
  const int64_t L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope;
  cu::Stream s = cu::stream_create();
  const auto time_us = [&](const auto& op) {
    constexpr int kCalls = 5, kReplays = 5;
    op();
    cu::sync(s);
    cu::capture_begin(s);
    for (int i = 0; i < kCalls; ++i) op();
    cu::GraphExec g = cu::capture_end(s);
    cu::graph_launch(g, s);
    cu::EventTimer timer;
    timer.start(s);
    for (int r = 0; r < kReplays; ++r) cu::graph_launch(g, s);
    timer.stop(s);
    const double us = timer.ms() * 1000.0 / (kCalls * kReplays);
    cu::sync(s);
    cu::graph_destroy(g);
    return us;
  };
  const auto report = [](const char* name, double varlen, double singles) {
    std::printf("[varlen-bench] %-30s N=32: varlen %8.1f us/step, 32 single calls %8.1f us/step (%.2fx)\n", name,
                varlen, singles, singles / varlen);
  };
  Batch b = make_batch(rng, std::vector<int64_t>(size_t(N), 1), 0);
  const DevBatch db = upload(b);
  {  // KDA recurrent, one token per sequence
    const auto in = k3test::make_kda(rng, N, H, Dk, Dv);
    auto dq_ = up(in.q), dk = up(in.k), dv = up(in.v), dg = up(in.g), dbeta = up(in.beta);
    auto pool = up(rand_vec(rng, size_t(N * nS), 0.01f, 0.5f)), o = k3test::dev_nan(size_t(N * H * Dv));
    const double tv = time_us([&] {
      cu::kda_recurrent_varlen(dq_.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), dbeta.as<float>(), db.v,
                               H, Dk, Dv, pool.as<float>(), o.as<float>(), s);
    });
    const double ts = time_us([&] {
      for (int64_t i = 0; i < N; ++i)
        cu::kda_recurrent(dq_.as<float>() + i * H * Dk, dk.as<float>() + i * H * Dk, dv.as<float>() + i * H * Dv,
                          dg.as<float>() + i * H * Dk, dbeta.as<float>() + i * H, 1, H, Dk, Dv,
                          pool.as<float>() + b.slots[size_t(i)] * nS, o.as<float>() + i * H * Dv, s);
    });
    report("kda_recurrent H=96 128x128", tv, ts);
  }
  {  // short conv
    auto x = up(rand_vec(rng, size_t(N * C))), w = up(rand_vec(rng, size_t(C * K)));
    auto pool = up(rand_vec(rng, size_t(N * C * (K - 1)))), o = k3test::dev_nan(size_t(N * C));
    const double tv = time_us([&] {
      cu::short_conv_silu_varlen(x.as<float>(), db.v, C, w.as<float>(), K, pool.as<float>(), o.as<float>(), s);
    });
    const double ts = time_us([&] {
      for (int64_t i = 0; i < N; ++i)
        cu::short_conv_silu(x.as<float>() + i * C, 1, C, w.as<float>(), K,
                            pool.as<float>() + b.slots[size_t(i)] * C * (K - 1), o.as<float>() + i * C, s);
    });
    report("short_conv_silu C=12288 K=4", tv, ts);
  }
  // MLA: ~4k cached tokens per sequence, a contiguous cache each for the single calls and a
  // shuffled paged pool for the varlen ones, both filled from one random block.
  std::vector<int64_t> ctx(static_cast<size_t>(N));
  for (auto& c : ctx) c = std::uniform_int_distribution<int64_t>(3900, 4300)(rng);
  const int64_t cap = 4400;
  const auto block = rand_vec(rng, size_t(cap * X), 0.05f, 1.5f);
  std::vector<int32_t> pos0(ctx.begin(), ctx.end());
  HostPool hp = make_pool(rng, std::vector<int64_t>(size_t(N), cap), pt, X, 0);
  hp.pages.clear();  // filled on the device below
  cu::DevBuf dpages(size_t(hp.n_pages * pt * X) * 4, "bench pool");
  for (int64_t pg = 0; pg < hp.n_pages; ++pg)
    cu::h2d(dpages.as<float>() + pg * pt * X, block.data() + (pg % (cap / pt)) * pt * X, size_t(pt * X) * 4);
  auto dtable = up(hp.table), dpos0 = up(pos0);
  cu::PagedCacheDev pc;
  pc.pages = dpages.as<float>();
  pc.page_tokens = pt;
  pc.block_table = dtable.as<int32_t>();
  pc.max_pages = hp.max_pages;
  pc.pos0 = dpos0.as<int32_t>();
  pc.n_pages = hp.n_pages;
  std::vector<cu::DevBuf> cc, kc, lens;
  std::vector<float> cblk(size_t(cap * L)), kblk(size_t(cap * R));
  for (int64_t t = 0; t < cap; ++t) {
    std::copy_n(block.data() + t * X, L, cblk.data() + t * L);
    std::copy_n(block.data() + t * X + L, R, kblk.data() + t * R);
  }
  for (int64_t i = 0; i < N; ++i) {
    cc.push_back(up(cblk));
    kc.push_back(up(kblk));
    lens.push_back(up(std::vector<int32_t>{pos0[size_t(i)]}));
  }
  auto ckv = up(rand_vec(rng, size_t(N * X), 0.05f, 3.0f)), nw = up(rand_vec(rng, size_t(L), 0.5f, 1.5f));
  auto q = up(rand_vec(rng, size_t(N * d.heads * dq)));
  k3test::OwnedW kvb = k3test::make_weight(rng, m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
  k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
  auto out = k3test::dev_nan(size_t(N * d.heads * d.v));
  {
    const double tv =
        time_us([&] { cu::mla_cache_append_paged(ckv.as<float>(), db.v, pc, L, R, nw.as<float>(), 1e-6f, s); });
    const double ts = time_us([&] {
      for (int64_t i = 0; i < N; ++i)
        cu::mla_cache_append(ckv.as<float>() + i * X, 1, L, R, nw.as<float>(), 1e-6f, lens[size_t(i)].as<int32_t>(),
                             cc[size_t(i)].as<float>(), kc[size_t(i)].as<float>(), s);
    });
    report("mla_cache_append L=512 R=64", tv, ts);
  }
  {
    auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(N, N, d)));
    auto work1 = k3test::dev_nan(size_t(cu::mla_absorbed_work_floats(1, d)));
    const double tv = time_us([&] {
      cu::mla_attend_absorbed_paged(q.as<float>(), db.v, pc, dkvb.view, d, work.as<float>(), out.as<float>(),
                                    cu::Precision::BF16, s);
    });
    const double ts = time_us([&] {
      for (int64_t i = 0; i < N; ++i)
        cu::mla_attend_absorbed(q.as<float>() + i * d.heads * dq, 1, cc[size_t(i)].as<float>(),
                                kc[size_t(i)].as<float>(), lens[size_t(i)].as<int32_t>(), dkvb.view, d,
                                work1.as<float>(), out.as<float>() + i * d.heads * d.v, cu::Precision::BF16, s);
    });
    report("mla_attend heads=96 ctx~4k", tv, ts);
    // Cost floor of this step: every cached key read once and the fp32 score + value products.
    int64_t keys = 0;
    for (int64_t c : ctx) keys += c + 1;
    std::printf("[varlen-bench] mla_attend: %lld keys, %.1f MB of cache, %.2f GFLOP fp32\n", (long long)keys,
                double(keys) * X * 4 / 1e6, double(keys) * d.heads * (X + L) * 2 / 1e9);
    EXPECT_EQ(count_nan(down(out, size_t(N * d.heads * d.v))), 0u);
  }
  cu::stream_destroy(s);
}

}  // namespace

namespace {

// The MLA prefill of one 4,096-token piece at K3's widths (96 heads, 128 + 64, v 128, latent 512)
// over 16K and 128K cached tokens: the tensor-core form's time, its rate in TFLOP/s (the attention's
// 2 · pairs · heads · (192 + 128) plus the expansion's 2 · keys · heads · 256 · 512), and the absorbed
// fp32 kernel on 512 of the same queries (per query) for the ratio. Printed, not asserted.
TEST(CudaVarlenBench, MlaTensorCorePrefillRate) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(409);
  const MlaShape m{96, 128, 64, 128, 512, k3::WFormat::BF16};
  const k3::MlaAttnDims d = dims_of(m);
  const int64_t L = d.kv_lora, R = d.rope, X = L + R, dq = d.nope + d.rope, pt = 64, T = 4096;
  cu::Stream s = cu::stream_create();
  k3test::OwnedW kvb = k3test::make_weight(rng, m.fmt, d.heads * (d.nope + d.v), L, 0.5f);
  k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
  const int64_t chunk = k3::mla_tc_key_chunk(d);
  cu::DevBuf tcw(size_t(k3::mla_tc_work_bytes(chunk, T, d)), "bench MLA tc workspace");
  auto q = up(rand_vec(rng, size_t(T * d.heads * dq)));
  auto out = k3test::dev_nan(size_t(T * d.heads * d.v));
  for (int64_t S : {int64_t(16384), int64_t(131072)}) {
    const int64_t pos0 = S - T, n_pages = S / pt;
    std::vector<int32_t> table(static_cast<size_t>(n_pages));
    std::iota(table.begin(), table.end(), 0);
    auto pages = up(rand_vec(rng, size_t(S * X), 0.05f, 1.5f));
    auto dtab = up(table);
    const std::vector<int32_t> cu_rows{0, int32_t(T)}, slots{0}, p0{int32_t(pos0)};
    const std::vector<int64_t> p0l{pos0};
    auto dcu = up(cu_rows), dsl = up(slots), dp0 = up(p0);
    const cu::VarlenDev v{1, T, dcu.as<int32_t>(), dsl.as<int32_t>(), 1};
    const cu::PagedCacheDev c{pages.as<float>(), pt, dtab.as<int32_t>(), n_pages, dp0.as<int32_t>(), n_pages};
    const auto run_tc = [&] {
      cu::mla_attend_tc_paged(q.as<float>(), v, c, cu_rows.data(), p0l.data(), nullptr, dkvb.view, d, chunk, tcw.get(),
                              out.as<float>(), s);
    };
    run_tc();
    cu::EventTimer timer;
    timer.start(s);
    run_tc();
    timer.stop(s);
    const double ms = timer.ms();
    const double pairs = double(T) * double(pos0) + double(T) * double(T + 1) / 2;
    const double att = 2 * pairs * double(d.heads) * double(dq + d.v);
    const double expand = 2 * double(S) * double(d.heads) * double(d.nope + d.v) * double(L);
    std::printf("[mla tc bench] T=%lld S=%lld heads=96: tensor cores %.2f ms = %.1f TFLOP/s (attention %.1f of them; "
                "expansion %.2f TFLOP), chunk %lld\n",
                (long long)T, (long long)S, ms, (att + expand) / ms / 1e9, att / ms / 1e9, expand / 1e12,
                (long long)chunk);
    EXPECT_EQ(count_nan(down(out, size_t(T * d.heads * d.v))), 0u);
    // The absorbed kernel on the last 512 queries of the same piece (per query it costs the same at
    // any offset of the piece, up to causality's few keys).
    const int64_t Ta = 512;
    const std::vector<int32_t> cua{0, int32_t(Ta)}, pa{int32_t(S - Ta)};
    auto dcua = up(cua), dpa = up(pa);
    const cu::VarlenDev va{1, Ta, dcua.as<int32_t>(), dsl.as<int32_t>(), 1};
    cu::PagedCacheDev ca = c;
    ca.pos0 = dpa.as<int32_t>();
    auto work = k3test::dev_nan(size_t(cu::mla_paged_work_floats(Ta, 1, d)));
    cu::mla_attend_absorbed_paged(q.as<float>(), va, ca, dkvb.view, d, work.as<float>(), out.as<float>(),
                                  cu::Precision::BF16, s);
    timer.start(s);
    cu::mla_attend_absorbed_paged(q.as<float>(), va, ca, dkvb.view, d, work.as<float>(), out.as<float>(),
                                  cu::Precision::BF16, s);
    timer.stop(s);
    const double ms_abs = timer.ms() * double(T) / double(Ta);
    std::printf("[mla tc bench] T=%lld S=%lld: absorbed fp32 %.1f ms (scaled from %lld queries): tensor cores %.1fx\n",
                (long long)T, (long long)S, ms_abs, (long long)Ta, ms_abs / ms);
  }
  cu::stream_destroy(s);
}

}  // namespace
