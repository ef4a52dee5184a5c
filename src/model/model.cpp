// Model construction and backend choice, the FP8 trunk (quantize_trunk_fp8), and Session: one
// sequence as a slot of the model's own state pool (mark/rollback, the session file format K3SESS01).
// Must not: compute (model/forward.cpp) or bind tensors (model/kimi_k3.cpp).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <istream>
#include <ostream>
#include <unordered_map>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/backend_profile.h"
#include "model/backends.h"
#include "model/model.h"
#include "model/remote.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace k3 {

Model::Model() : backend_(make_cpu_backend()) {}

void Model::set_max_step_rows(int64_t rows) {
  if (rows < 1) fail("rows per step must be >= 1");
  if (on_gpu()) fail("set_max_step_rows: on the GPU the step size is GpuOptions::tokens_per_call");
  max_rows_ = rows;
  work_.reset();
  if (split_)
    for (auto& r : split_->ranks) r->set_max_step_rows(rows);
}

Model::~Model() {
  // Memory of the backend goes back before the backend itself (and the ranks' pools before the ranks).
  sessions_.reset();
  work_.reset();
  split_.reset();
}

std::unique_ptr<StatePool> Model::new_pool(const StatePoolOptions& o) const {
  if (split_) {  // rank 0's pool, holding every other rank's
    auto p = split_->ranks[0]->new_pool(o);
    for (size_t r = 1; r < split_->ranks.size(); ++r) p->add_shard(split_->ranks[r]->new_pool(o));
    if (split_->remote) p->attach_remote(split_->remote, split_->remote->new_pool(o));
    return p;
  }
  std::vector<bool> kda;
  for (const LayerWeights& l : host_.layers) kda.push_back(l.is_kda);
  return std::make_unique<StatePool>(*backend_, dims_, std::move(kda), o);
}

StatePool& Model::session_pool() const {
  if (!sessions_) sessions_ = new_pool(session_pool_opts_);
  return *sessions_;
}

bool Model::on_gpu() const {
  if (split_) return split_->ranks[0]->on_gpu();  // ranks as processes: this process's rank
  return std::string_view(backend_->name()) == "cuda";
}

void Model::set_gpu_graphs(bool on) const {
  if (split_) return split_->ranks[0]->set_gpu_graphs(on);
  if (!backend_->set_graphs(on)) fail("set_gpu_graphs: the model is not on the GPU");
}

void Model::set_op_profile(OpProfile* sink) {
  if (set_profile_sink(*backend_, sink) || !sink) return;
  // Wrapped once; memory already allocated through the backend stays with the wrapped one inside.
  backend_ = make_profiling_backend(std::move(backend_), sink);
}

void Model::use_gpu(const GpuOptions& o) {
  if (split_ && split_->remote) return use_gpu_split(o);
  if (split_ || role_.comm) fail(std::string("--device cuda: ") + kGpuSplitHow);
  use_gpu_here(o);
}

void Model::use_gpu_here(const GpuOptions& o) {
  if (o.tokens_per_call < 1) fail("GPU: tokens per call must be >= 1");
  std::unique_ptr<Backend> be = make_cuda_backend(*this, o);  // checks the device and the fit
  ModelWeights placed = host_;
  be->place(placed);
  sessions_.reset();
  work_.reset();
  backend_ = std::move(be);
  placed_ = std::move(placed);
  max_rows_ = o.tokens_per_call;
  session_pool_opts_.initial_pages = std::max<int64_t>(1, (o.initial_context + 63) / 64);
  ++backend_generation_;
}

GpuMemoryPlan gpu_memory_plan(const ModelConfig& c, size_t weight_bytes, const GpuOptions& o, int64_t context) {
  GpuMemoryPlan p;
  const ModelDims d = ModelDims::from_config(c);
  p.weights = weight_bytes;
  p.state_fixed = d.kda_state_bytes();
  p.state_per_token = d.mla_bytes_per_token();
  p.workspace = size_t(forward_work_floats(d, o.tokens_per_call)) * 4;
  if (d.kda_layers > 0) p.workspace += size_t(d.kda.tc_work_bytes(o.tokens_per_call));  // the bf16 chunked KDA
  // The CUDA backend's own buffers (backend_cuda.cpp): the routed experts' per-slot scratch and row
  // lists, the step's ids / sequences / picks / MLA flags, and cuBLAS's workspace with its bf16 copy of
  // the widest product's input.
  const int64_t R = o.tokens_per_call, K = std::max<int64_t>(d.moe.top_k, 1);
  if (d.moe.experts > 0)
    p.workspace += size_t(R * K * (2 * d.moe.inter + 3 * d.moe.latent)) * 4 + size_t(2 * R * K) * 4 +
                   // (ExpertTile: 3 int32; prefill's tiles of kExpertTileRows 64, decode's of kGemvMaxT 8)
                   size_t(std::max(R * K / 64 + d.moe.experts, (R * K + 7) / 8 + std::min(d.moe.experts, R * K))) * 12;
  p.workspace += size_t(6 * R + 1) * 4;
  p.workspace += (size_t(32) << 20) + size_t(R * d.widest_product_input()) * 2;
  const MlaAttnDims ad{d.mla.heads, d.mla.nope, d.mla.rope, d.mla.v, d.mla.kv_lora, 0.0f};
  if (o.sm_count < 1) fail("gpu_memory_plan: sm_count must be >= 1");
  // The absorbed MLA kernel's q̃ / o_lat rows, split partials and row plan: the most a step of up to
  // tokens_per_call rows takes on a GPU of o.sm_count multiprocessors (ops.h, as the backend sizes it).
  if (d.mla_layers > 0) p.workspace += size_t(paged_mla_work_floats_max(o.tokens_per_call, ad, o.sm_count)) * 4;
  if (d.mla_layers > 0 && mla_tc_supported(ad))  // the tensor-core MLA prefill and its per-sequence flags
    p.workspace += size_t(mla_tc_work_bytes(mla_tc_key_chunk(ad), o.tokens_per_call, ad)) + size_t(o.tokens_per_call) * 4;
  p.context = context;
  return p;
}

GpuOptions::PrefillExperts parse_prefill_experts(const std::string& s) {
  if (s == "auto") return GpuOptions::PrefillExperts::Auto;
  if (s == "cpu") return GpuOptions::PrefillExperts::Cpu;
  if (s == "gpu") return GpuOptions::PrefillExperts::Gpu;
  fail("--prefill-experts: unknown value '" + s + "' (auto, cpu or gpu)");
}

size_t stream_staging_plan(const GpuOptions& o, int64_t E, size_t per_expert) {
  if (!o.experts_on_cpu || o.prefill_experts == GpuOptions::PrefillExperts::Cpu || o.tokens_per_call <= 8 || E < 1 ||
      per_expert == 0)
    return 0;
  const int64_t cap = std::clamp<int64_t>(int64_t(o.stream_staging_bytes / (2 * per_expert)), 1, E);
  return 2 * size_t(cap) * per_expert;
}

std::string gib_text(size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", double(bytes) / (1024.0 * 1024 * 1024));
  return s;
}

GpuOptions fit_gpu_mem(const Model& m, const GpuOptions& o, std::string* how) {
  if (o.gpu_mem == 0) return o;
  const auto gib = gib_text;
  const size_t all = gpu_memory_plan(m, o, o.initial_context).total();
  if (all <= o.gpu_mem) {
    if (how) *how = "--gpu-mem " + gib(o.gpu_mem) + ": the placement asked for fits (" + gib(all) + ")";
    return o;
  }
  if (o.experts_on_cpu || !o.experts_resident)
    fail("--gpu-mem " + gib(o.gpu_mem) + ": the placement asked for needs " + gib(all) +
         " of GPU memory (weights, state and workspace); raise the cap or lower --ctx / --ubatch");
  GpuOptions h = o;
  h.experts_on_cpu = true;
  h.hot_experts = 0;
  const size_t base = gpu_memory_plan(m, h, h.initial_context).total();
  if (base > o.gpu_mem)
    fail("--gpu-mem " + gib(o.gpu_mem) + ": all on the GPU needs " + gib(all) +
         ", and with the routed experts in host RAM the trunk, state and workspace still need " + gib(base) +
         "; raise the cap or lower --ctx / --ubatch");
  GpuOptions whole = h;
  whole.hot_experts = 1.0;
  const size_t routed = gpu_memory_plan(m, whole, h.initial_context).total() - base;
  int64_t E = 0;
  for (const LayerWeights& l : m.weights().layers)
    if (!l.dense_ffn && !l.moe.experts.empty()) E = std::max<int64_t>(E, int64_t(l.moe.experts.size()));
  // The largest whole number of experts per layer that fits (the cache rounds F x E per layer).
  const double f = routed > 0 ? double(o.gpu_mem - base) / double(routed) : 0.0;
  const int64_t per_layer = E > 0 ? std::clamp<int64_t>(int64_t(std::floor(f * double(E))), 0, E) : 0;
  h.hot_experts = E > 0 ? double(per_layer) / double(E) : 0.0;
  if (how)
    *how = "--gpu-mem " + gib(o.gpu_mem) + ": all on the GPU needs " + gib(all) +
           ", so the routed experts stay in host RAM, computed by the CPU" +
           (per_layer > 0 ? ", " + std::to_string(per_layer) + " of each layer's " + std::to_string(E) +
                                " cached on the GPU (" + gib(gpu_memory_plan(m, h, h.initial_context).total()) +
                                " planned)"
                          : " (none cached: " + gib(o.gpu_mem - base) + " left beside the trunk)");
  return h;
}

GpuMemoryPlan gpu_memory_plan(const Model& m, const GpuOptions& o, int64_t context) {
  uint64_t bytes = 0, routed = 0;
  for_each_weight(
      m.weights(),
      [&](const WeightMat& w, WeightRole role) {
        if ((o.experts_resident && !o.experts_on_cpu) || role != WeightRole::RoutedExpert)
          bytes += gpu_weight_bytes(w, is_mla_kv_b(m.weights(), w));
        if (role == WeightRole::RoutedExpert) routed += weight_bytes(w);
      },
      [&](const FVec& v) { bytes += weight_bytes(v); });
  // A fraction of the host's routed experts cached on the GPU (--hot-experts F; auto fills what is
  // left over when it fills, so it is not planned).
  if (o.experts_on_cpu && o.hot_experts > 0) bytes += uint64_t(double(routed) * std::min(o.hot_experts, 1.0));
  GpuMemoryPlan p = gpu_memory_plan(m.config(), bytes, o, context);
  for (const LayerWeights& l : m.weights().layers)  // the streamed prefill's staging (one layer's shape)
    if (!l.dense_ffn && !l.moe.experts.empty()) {
      const GluWeights& f = l.moe.experts.front();
      const size_t per = size_t(weight_bytes(f.gate) + weight_bytes(f.up) + weight_bytes(f.down));
      p.workspace += stream_staging_plan(o, int64_t(l.moe.experts.size()), per);
      break;
    }
  return p;
}

// ---------------------------------------------------------------- the FP8 trunk (--trunk-fp8)
// What is quantised: WeightRole::Trunk, every matrix read once per token whatever the routing (the
// attention projections, the MoE latent projections, the shared experts, the dense FFN). What stays:
// the router (its top-k over sigmoid scores is tie-sensitive: a rounded gate can change which experts
// run), the routed experts (MXFP4 as shipped, never re-quantised), the embedding (one row read per
// token: nothing to gain in bandwidth) and lm_head (the logits themselves), as DeepSeek-V3's FP8
// training and serving recipes keep the embedding, the output head, the gating and the norms in
// higher precision.

TrunkFp8Bytes trunk_fp8_bytes(const ModelWeights& w) {
  TrunkFp8Bytes b;
  std::vector<const void*> seen;
  for_each_weight(
      w,
      [&](const WeightMat& m, WeightRole role) {
        if (role != WeightRole::Trunk || std::find(seen.begin(), seen.end(), m.data) != seen.end()) return;
        seen.push_back(m.data);
        ++b.matrices;
        b.before += weight_bytes(m);
        b.after += fp8_matrix_bytes(m.rows, m.cols);
        WeightMat q = m;  // the FP8 form's GPU bytes
        q.fmt = WFormat::FP8;
        b.after_gpu += gpu_weight_bytes(q, is_mla_kv_b(w, m));
      },
      [](const FVec&) {});
  return b;
}

namespace {
constexpr uint64_t kArenaAlign = 64;
uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Hands the whole pages inside [p, p + n) of a read-only mapping back to the kernel (they are read
// again from the file if ever touched); returns the bytes released.
uint64_t release_pages(const uint8_t* p, uint64_t n) {
  static const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t b = align_up(reinterpret_cast<uintptr_t>(p), page),
                 e = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (e <= b) return 0;
  if (madvise(reinterpret_cast<void*>(b), size_t(e - b), MADV_DONTNEED) != 0) return 0;
  return e - b;
}
}  // namespace

bool Model::replaced_by_trunk_fp8(std::string_view tensor_name) const {
  if (trunk_fp8_sources_.empty()) return false;
  const TensorView* t = ckpt_->find(tensor_name);
  return t &&
         std::binary_search(trunk_fp8_sources_.begin(), trunk_fp8_sources_.end(), static_cast<const void*>(t->data));
}

TrunkFp8Report Model::quantize_trunk_fp8(TrunkFp8Store store) {
  if (on_gpu())
    fail("--trunk-fp8: the model is already on the GPU (the trunk is quantised at load, before the upload)");
  if (split_ || role_.comm)
    fail("--trunk-fp8: the model is already split over ranks (" + parallel().str() +
         "); quantise the trunk before Model::split");
  if (trunk_fp8_) fail("--trunk-fp8: the trunk is already quantised");
  const auto t0 = std::chrono::steady_clock::now();
  const bool f32 = store == TrunkFp8Store::DequantizedF32;

  // One job per distinct trunk matrix: its source view, where its codes and scales (or F32 twin) go.
  struct Job {
    WeightMat src;
    std::vector<WeightMat*> uses;  // the host views to rewrite
    uint64_t codes = 0, scales = 0;
    std::string name;
    std::atomic<int64_t> left{0};  // block rows still to quantise
  };
  std::vector<std::unique_ptr<Job>> jobs;
  std::unordered_map<const void*, Job*> by_data;
  for_each_weight(
      host_,
      [&](WeightMat& w, WeightRole role) {
        if (role != WeightRole::Trunk) return;
        if (auto it = by_data.find(w.data); it != by_data.end()) return it->second->uses.push_back(&w);
        auto j = std::make_unique<Job>();
        j->src = w;
        j->uses.push_back(&w);
        j->name = "a trunk matrix [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]";
        by_data[w.data] = j.get();
        jobs.push_back(std::move(j));
      },
      [](FVec&) {});
  for (const std::string& n : ckpt_->names())  // tensor names, for messages
    if (const TensorView* t = ckpt_->find(n))
      if (auto it = by_data.find(t->data); it != by_data.end()) it->second->name = n;
  uint64_t size = 0;
  for (auto& j : jobs) {
    const WeightMat& w = j->src;
    if (w.fmt != WFormat::F32 && w.fmt != WFormat::F16 && w.fmt != WFormat::BF16)
      fail("--trunk-fp8: trunk matrix " + j->name + " is " + wformat_name(w.fmt) + " (F32, F16 or BF16 expected)");
    j->codes = size;
    size = align_up(size + uint64_t(w.rows) * uint64_t(w.cols) * (f32 ? 4 : 1), kArenaAlign);
    j->scales = size;
    if (!f32)
      size = align_up(size + 4 * uint64_t((w.rows + kFp8Block - 1) / kFp8Block * fp8_block_cols(w.cols)), kArenaAlign);
    j->left = (w.rows + kFp8Block - 1) / kFp8Block;
  }
  std::unique_ptr<uint8_t[]> store_mem(new uint8_t[size + kArenaAlign]);
  uint8_t* const arena =
      reinterpret_cast<uint8_t*>(align_up(reinterpret_cast<uintptr_t>(store_mem.get()), kArenaAlign));

  // Every (matrix, block row) is one task, in matrix order: a matrix's source pages are released as
  // soon as its last block row is done, so at most a few matrices' pages are resident at once.
  struct Task {
    Job* job;
    int64_t br;
  };
  std::vector<Task> tasks;
  for (auto& j : jobs)
    for (int64_t br = 0; br < j->left; ++br) tasks.push_back({j.get(), br});
  const auto source_bytes = [](const WeightMat& w) { return uint64_t(w.rows) * uint64_t(row_bytes(w)); };
  const auto in_mapping = [&](const WeightMat& w) {
    return ckpt_->locate(static_cast<const uint8_t*>(w.data), source_bytes(w)).has_value();
  };
  par::parallel_for_each(int64_t(tasks.size()), [&](int64_t i) {
    Job& j = *tasks[size_t(i)].job;
    const int64_t br = tasks[size_t(i)].br, cols = j.src.cols, nbc = fp8_block_cols(cols);
    const int64_t r0 = br * kFp8Block, n = std::min(j.src.rows, r0 + kFp8Block) - r0;
    if (!f32) {
      ops::quantize_fp8_block_row(j.src, br, arena + j.codes + uint64_t(r0 * cols),
                                  reinterpret_cast<float*>(arena + j.scales) + br * nbc, j.name);
    } else {  // the same rounding, written out dequantised
      std::vector<uint8_t> codes(size_t(n * cols));
      std::vector<float> scales(static_cast<size_t>(nbc));
      ops::quantize_fp8_block_row(j.src, br, codes.data(), scales.data(), j.name);
      const WeightMat q = ops::fp8_matrix(codes.data(), scales.data(), n, cols);
      float* out = reinterpret_cast<float*>(arena + j.codes) + r0 * cols;
      for (int64_t r = 0; r < n; ++r) ops::dequant_row(q, r, out + r * cols);
    }
    if (--j.left == 0 && in_mapping(j.src)) release_pages(static_cast<const uint8_t*>(j.src.data), source_bytes(j.src));
  });

  // The views, then the pages shared by two neighbouring replaced tensors (which neither could give
  // back alone): the merged ranges, again page by page inside them (the count is theirs: a superset
  // of what each tensor gave back alone).
  TrunkFp8Report rep;
  std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
  for (auto& j : jobs) {
    const WeightMat& w = j->src;
    WeightMat v;
    if (f32) {
      v = wmat_f32(reinterpret_cast<const float*>(arena + j->codes), w.rows, w.cols);
    } else {
      v = ops::fp8_matrix(arena + j->codes, reinterpret_cast<const float*>(arena + j->scales), w.rows, w.cols);
    }
    for (WeightMat* u : j->uses) *u = v;
    ++rep.bytes.matrices;
    rep.bytes.before += weight_bytes(w);
    rep.bytes.after += weight_bytes(v);
    bool kv_b = false;  // (an MLA kv_b_proj goes to the GPU in fp32: gpu_weight_bytes)
    for (const WeightMat* u : j->uses) kv_b = kv_b || is_mla_kv_b(host_, *u);
    rep.bytes.after_gpu += gpu_weight_bytes(v, kv_b);
    trunk_fp8_sources_.push_back(w.data);
    if (in_mapping(w)) ranges.push_back({static_cast<const uint8_t*>(w.data), source_bytes(w)});
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    const uint8_t* b = ranges[i].first;
    const uint8_t* e = b + ranges[i].second;
    size_t k = i + 1;
    for (; k < ranges.size() && ranges[k].first <= e; ++k) e = std::max(e, ranges[k].first + ranges[k].second);
    rep.released_bytes += release_pages(b, uint64_t(e - b));
    i = k;
  }
  std::sort(trunk_fp8_sources_.begin(), trunk_fp8_sources_.end());
  trunk_fp8_store_ = std::move(store_mem);
  trunk_fp8_ = true;
  placed_ = host_;  // the CPU backend reads the host views as they are (on_gpu was refused above)
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

// ---------------------------------------------------------------- session
Session::Session(const Model& m) : model_(&m), generation_(m.backend_generation_) { slot_ = pool().alloc(); }

Session::~Session() {
  // A session of a backend the model has left has no slot to give back (that pool is gone).
  if (generation_ == model_->backend_generation_ && model_->sessions_) model_->sessions_->free(slot_);
}

Session::Session(const Session& o) : model_(o.model_), generation_(o.generation_) { slot_ = pool().fork(o.slot_); }

Session& Session::operator=(const Session& o) {
  if (this == &o) return *this;
  if (o.model_ != model_) fail("session copy: the sessions belong to different models");
  o.pool();  // refuses a stale source
  pool().copy_into(slot_, o.slot_);
  return *this;
}

StatePool& Session::pool() const {
  if (generation_ != model_->backend_generation_)
    fail("this session was created before the model moved to the GPU; create a new session");
  return model_->session_pool();
}

void Session::reset() { pool().reset(slot_); }
int64_t Session::position() const { return pool().position(slot_); }

size_t Session::state_bytes() const {
  const ModelDims& d = model_->dims();
  return size_t(d.kda_state_bytes() + d.mla_bytes_per_token() * uint64_t(position()));
}

Session::Mark Session::mark() const { return pool().snapshot(slot_); }
void Session::rollback(const Mark& m) { pool().restore(slot_, m); }

namespace {
constexpr char kSessionMagic[8] = {'K', '3', 'S', 'E', 'S', 'S', '0', '1'};

void put_u64(std::ostream& o, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  o.write(reinterpret_cast<const char*>(b), 8);
}
uint64_t get_u64(std::istream& in) {
  unsigned char b[8];
  if (!in.read(reinterpret_cast<char*>(b), 8)) fail("session file is truncated");
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(b[i]) << (8 * i);
  return v;
}
void put_floats(std::ostream& o, const std::vector<float>& v) {
  static_assert(sizeof(float) == 4 && std::endian::native == std::endian::little, "session files are little-endian");
  put_u64(o, v.size());
  o.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 4));  // little-endian hosts only
}
void get_floats(std::istream& in, std::vector<float>& v, size_t expect, const char* what) {
  const uint64_t n = get_u64(in);
  if (n != expect)
    fail(std::string("session file: ") + what + " has " + std::to_string(n) + " values, expected " +
         std::to_string(expect));
  v.resize(size_t(n));
  if (n && !in.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4))) fail("session file is truncated");
}
}  // namespace

void Session::save(std::ostream& out) const {
  if (model_->split_) fail("session files of a model split with --tp/--ep are not supported yet");
  StatePool& p = pool();
  const ModelDims& d = model_->dims();
  const int64_t pos = p.position(slot_);
  out.write(kSessionMagic, 8);
  put_u64(out, model_->fingerprint());
  put_u64(out, uint64_t(pos));
  put_u64(out, uint64_t(d.layers));
  std::vector<float> S, conv[3], c, kr;
  const std::vector<float> none;
  for (int64_t L = 0; L < d.layers; ++L) {
    const bool kda = model_->layers[size_t(L)].is_kda;
    if (kda) p.read_kda(slot_, L, S, conv);
    put_floats(out, kda ? S : none);
    for (int j = 0; j < 3; ++j) put_floats(out, kda ? conv[j] : none);
    if (!kda) p.read_mla(slot_, L, c, kr);
    put_u64(out, kda ? 0 : uint64_t(pos));
    put_floats(out, kda ? none : c);
    put_floats(out, kda ? none : kr);
  }
  if (!out) fail("session file: write failed");
}

void Session::load(std::istream& in) {
  if (model_->split_) fail("session files of a model split with --tp/--ep are not supported yet");
  StatePool& p = pool();
  char magic[8];
  if (!in.read(magic, 8) || std::memcmp(magic, kSessionMagic, 8) != 0) fail("not a k3 session file (bad magic)");
  if (get_u64(in) != model_->fingerprint()) fail("session file was saved with a different model");
  const uint64_t pos = get_u64(in);
  const ModelDims& d = model_->dims();
  if (get_u64(in) != uint64_t(d.layers)) fail("session file: layer count differs from the model");
  // Read everything first so a bad file leaves this session untouched.
  struct Layer {
    std::vector<float> S, conv[3], c, kr;
  };
  std::vector<Layer> staged(size_t(d.layers));
  const size_t state = size_t(d.kda.state_floats()), conv = size_t(d.kda.conv_floats());
  for (int64_t L = 0; L < d.layers; ++L) {
    Layer& l = staged[size_t(L)];
    const bool kda = model_->layers[size_t(L)].is_kda;
    get_floats(in, l.S, kda ? state : 0, "KDA state");
    for (auto& cv : l.conv) get_floats(in, cv, kda ? conv : 0, "KDA conv state");
    const uint64_t len = get_u64(in);
    if (len > pos) fail("session file: MLA cache longer than the position");
    if (!kda && len != pos) fail("session file: MLA cache length differs from the position");
    get_floats(in, l.c, size_t(len) * size_t(d.mla.kv_lora), "MLA latent cache");
    get_floats(in, l.kr, size_t(len) * size_t(d.mla.rope), "MLA rope-key cache");
  }
  p.set_position(slot_, int64_t(pos));
  for (int64_t L = 0; L < d.layers; ++L) {
    Layer& l = staged[size_t(L)];
    if (model_->layers[size_t(L)].is_kda)
      p.write_kda(slot_, L, l.S, l.conv);
    else
      p.write_mla(slot_, L, l.c, l.kr);
  }
}

}  // namespace k3
