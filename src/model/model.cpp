// Model construction and backend choice, and Session: one sequence as a slot of the model's own
// state pool (mark/rollback, the session file format K3SESS01).
// Must not: compute (model/forward.cpp) or bind tensors (model/kimi_k3.cpp).
#include <algorithm>
#include <bit>
#include <cstring>
#include <istream>
#include <ostream>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/backend_profile.h"
#include "model/backends.h"
#include "model/model.h"

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

bool Model::on_gpu() const { return std::string_view(backend_->name()) == "cuda"; }

void Model::set_gpu_graphs(bool on) const {
  if (!backend_->set_graphs(on)) fail("set_gpu_graphs: the model is not on the GPU");
}

void Model::set_op_profile(OpProfile* sink) {
  if (set_profile_sink(*backend_, sink) || !sink) return;
  // Wrapped once; memory already allocated through the backend stays with the wrapped one inside.
  backend_ = make_profiling_backend(std::move(backend_), sink);
}

void Model::use_gpu(const GpuOptions& o) {
  if (split_ || role_.comm)
    fail(
        "--device cuda: a model split over ranks (--tp/--ep) runs on the CPU backend only (the NCCL communicator "
        "for GPUs is not built yet)");
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
  p.context = context;
  return p;
}

GpuMemoryPlan gpu_memory_plan(const Model& m, const GpuOptions& o, int64_t context) {
  uint64_t bytes = 0;
  for_each_weight(
      m.weights(),
      [&](const WeightMat& w, WeightRole role) {
        if (o.experts_resident || role != WeightRole::RoutedExpert) bytes += weight_bytes(w);
      },
      [&](const FVec& v) { bytes += weight_bytes(v); });
  return gpu_memory_plan(m.config(), bytes, o, context);
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
