// The timing Backend of backend_profile.h: every op forwarded, timed while a sink is set.
#include "model/backend_profile.h"

#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

namespace k3 {

namespace {

class ProfilingBackend final : public Backend {
 public:
  ProfilingBackend(std::unique_ptr<Backend> inner, OpProfile* sink)
      : in_(std::move(inner)), sink_(sink), async_(std::string_view(in_->name()) != "cpu") {}
  void set_sink(OpProfile* s) {
    settle();
    sink_ = s;
  }

  const char* name() const override { return in_->name(); }
  BackendCaps caps() const override { return in_->caps(); }
  void* alloc(size_t bytes, const char* what) override { return in_->alloc(bytes, what); }
  void release(void* p) noexcept override { in_->release(p); }
  void upload(void* dst, const void* src, size_t bytes) override { in_->upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { in_->download(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override {
    timed("copy", [&] { in_->copy(dst, src, bytes); });
  }
  void zero(void* dst, size_t bytes) override {
    timed("zero", [&] { in_->zero(dst, bytes); });
  }
  void sync() override { in_->sync(); }
  void place(ModelWeights& w) override { in_->place(w); }
  bool set_graphs(bool on) override { return in_->set_graphs(on); }

  bool begin_step(const StepView& s, const int32_t* ids, StepNumerics n, bool replayable) override {
    if (sink_) ++sink_->steps;
    return in_->begin_step(s, ids, n, replayable && !sink_);  // no graph replay while timing ops
  }
  void end_step() override {
    timed("end_step", [&] { in_->end_step(); });
    settle();
  }
  void abort_step() noexcept override {
    in_->abort_step();
    pending_.clear();
    in_->reset_marks();
  }

  void embed(const WeightMat& E, const int32_t* ids, int64_t R, float* out) override {
    timed("embed", [&] { in_->embed(E, ids, R, out); });
  }
  void matmul(const WeightMat& W, const float* x, int64_t R, float* y, const int32_t* groups,
              int64_t n_groups) override {
    timed("matmul", [&] { in_->matmul(W, x, R, y, groups, n_groups); });
  }
  void matmul_shared_input(const WeightMat* const* W, int64_t n, const float* x, int64_t R, float* const* y,
                           const bool* fp32) override {
    timed("matmul_shared_input", [&] { in_->matmul_shared_input(W, n, x, R, y, fp32); });
  }
  void matmul_many(const WeightMat* const* W, const float* const* x, int64_t n, int64_t R, float* const* y) override {
    timed("matmul_many", [&] { in_->matmul_many(W, x, n, R, y); });
  }
  void rmsnorm(const float* x, int64_t R, int64_t n, const float* w, float eps, float* out) override {
    timed("rmsnorm", [&] { in_->rmsnorm(x, R, n, w, eps, out); });
  }
  void rmsnorm_gate(const float* x, int64_t R, int64_t n, const float* w, float eps, const float* gate,
                    float* out) override {
    timed("rmsnorm_gate", [&] { in_->rmsnorm_gate(x, R, n, w, eps, gate, out); });
  }
  void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) override {
    timed("l2norm_scale", [&] { in_->l2norm_scale(x, rows, n, eps, scale); });
  }
  void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) override {
    timed("glu_activation", [&] { in_->situ_glu(g, u, n, b1, b2, out); });
  }
  void moe_tail(const MoeTail& p, int64_t R) override {
    timed("moe_tail", [&] { in_->moe_tail(p, R); });
  }
  void kda_gate(const float* f, int64_t R, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
                float lower_bound, float* g) override {
    timed("kda_gate", [&] { in_->kda_gate(f, R, H, D, A_log, dt_bias, lower_bound, g); });
  }
  void sigmoid(float* x, int64_t n) override {
    timed("sigmoid", [&] { in_->sigmoid(x, n); });
  }
  void sigmoid_mul(float* x, const float* gate, int64_t n) override {
    timed("sigmoid_mul", [&] { in_->sigmoid_mul(x, gate, n); });
  }
  void add(float* y, const float* x, int64_t n) override {
    timed("add", [&] { in_->add(y, x, n); });
  }
  void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst) override {
    timed("gather_rows", [&] { in_->gather_rows(src, rows, n, width, dst); });
  }
  void attnres_mix(const float* const* src, int64_t n_src, int64_t R, int64_t H, const float* fold, float eps,
                   float* out) override {
    timed("attnres_mix", [&] { in_->attnres_mix(src, n_src, R, H, fold, eps, out); });
  }
  void residual_norm(const ResidualNorm& p, int64_t R, int64_t H) override {
    timed("residual_norm", [&] { in_->residual_norm(p, R, H); });
  }
  void short_conv_silu(const float* x, const StepView& s, int64_t C, const float* w, int64_t K, float* state_pool,
                       float* out) override {
    timed("short_conv_silu", [&] { in_->short_conv_silu(x, s, C, w, K, state_pool, out); });
  }
  void kda_prepare(const KdaPrepare& p, const StepView& s, int64_t R) override {
    timed("kda_prepare", [&] { in_->kda_prepare(p, s, R); });
  }
  void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const StepView& s,
           int64_t H, int64_t Dk, int64_t Dv, KdaAlgo algo, int64_t chunk, float* S_pool, float* o) override {
    timed("kda", [&] { in_->kda(q, k, v, g, beta, s, H, Dk, Dv, algo, chunk, S_pool, o); });
  }
  void mla_append(const float* ckv, const StepView& s, int64_t kv_lora, int64_t rope, const float* norm_w, float eps,
                  const MlaPages& pages) override {
    timed("mla_append", [&] { in_->mla_append(ckv, s, kv_lora, rope, norm_w, eps, pages); });
  }
  void mla_attend(const float* q, const StepView& s, const MlaPages& pages, const WeightMat& kv_b, const MlaAttnDims& d,
                  MlaAlgo algo, float* out) override {
    timed("mla_attend", [&] { in_->mla_attend(q, s, pages, kv_b, d, algo, out); });
  }
  void router_topk(const float* logits, const float* bias, int64_t R, int64_t E, int64_t k, bool renorm, float scale,
                   int32_t* idx, float* w) override {
    timed("router_topk", [&] { in_->router_topk(logits, bias, R, E, k, renorm, scale, idx, w); });
    if (!sink_ || R <= 0 || k <= 0 || E <= 0) return;
    ids_.resize(size_t(R * k));
    in_->download(ids_.data(), idx, ids_.size() * sizeof(int32_t));
    seen_.assign(size_t(E), 0);
    int64_t n = 0;
    for (const int32_t e : ids_)
      if (e >= 0 && e < E && !seen_[size_t(e)]) {
        seen_[size_t(e)] = 1;
        ++n;
      }
    ++sink_->router_calls;
    sink_->distinct_experts += double(n);
  }
  void moe_routed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                  const float* wt, int64_t R, int64_t top_k, float* agg, ExpertSource* source, float* terms) override {
    timed("moe_routed", [&] { in_->moe_routed(w, latent, situ, z, idx, wt, R, top_k, agg, source, terms); });
  }
  void moe_combine(const float* terms, const int32_t* idx, const float* wt, int64_t R, int64_t top_k, int64_t latent,
                   float* agg) override {
    timed("moe_combine", [&] { in_->moe_combine(terms, idx, wt, R, top_k, latent, agg); });
  }
  void all_gather(Communicator& comm, const float* send, int64_t n, float* out) override {
    timed("all_gather", [&] { in_->all_gather(comm, send, n, out); });
  }
  void all_gather_v(Communicator& comm, const float* send, int64_t n, float* out, const int64_t* counts) override {
    timed("all_gather_v", [&] { in_->all_gather_v(comm, send, n, out, counts); });
  }
  void join_group(Communicator& comm) override { in_->join_group(comm); }
  void broadcast(Communicator& comm, float* buf, int64_t n, int root) override {
    timed("broadcast", [&] { in_->broadcast(comm, buf, n, root); });
  }
  void argmax_rows(const float* logits, int64_t R, int64_t V, int32_t* out) override {
    timed("argmax_rows", [&] { in_->argmax_rows(logits, R, V, out); });
  }
  HotExpertStats hot_expert_stats() const override { return in_->hot_expert_stats(); }

 private:
  // An op's time: on a backend with device marks, the device time between a mark before and one
  // after it (read back at the end of the step, so ops are not waited for one by one: the time
  // includes the gaps between the op's own kernels, not the host's launch work); otherwise the
  // host clock around it (waiting for an asynchronous backend before and after).
  template <class F>
  void timed(const char* op, F&& f) {
    if (!sink_) return f();
    const int64_t a = in_->mark();
    if (a >= 0) {
      f();
      pending_.push_back({op, a, in_->mark()});
      return;
    }
    if (async_) in_->sync();  // the previous op's time is not this one's
    const auto t0 = std::chrono::steady_clock::now();
    f();
    if (async_) in_->sync();
    add(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  void add(const char* op, double seconds) {
    OpProfile::Entry& e = sink_->ops[op];
    ++e.calls;
    e.seconds += seconds;
  }
  // Reads the device marks of the step's ops (after end_step).
  void settle() {
    if (pending_.empty()) return;
    for (const Pending& p : pending_)
      if (sink_) add(p.op, in_->seconds_between(p.a, p.b));
    pending_.clear();
    in_->reset_marks();
  }

  struct Pending {
    const char* op;
    int64_t a, b;
  };
  std::unique_ptr<Backend> in_;
  OpProfile* sink_;
  bool async_;
  std::vector<Pending> pending_;
  std::vector<int32_t> ids_;  // router_topk's ids read back, and which experts they hit
  std::vector<uint8_t> seen_;
};

}  // namespace

std::unique_ptr<Backend> make_profiling_backend(std::unique_ptr<Backend> inner, OpProfile* sink) {
  return std::make_unique<ProfilingBackend>(std::move(inner), sink);
}

bool set_profile_sink(Backend& be, OpProfile* sink) {
  auto* p = dynamic_cast<ProfilingBackend*>(&be);
  if (!p) return false;
  p->set_sink(sink);
  return true;
}

}  // namespace k3
