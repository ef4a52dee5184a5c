// The public API (include/k3/engine.h) over the library: options checked here, loading through
// runtime/loader.h, steps through one StatePool and Model::step, text through the tokenizer and
// chat libraries, sampling through runtime/sampler.h. Must not: carry engine logic of its own
// (anything a front end shares belongs in runtime/) or let internal types into the public header.
#include "k3/engine.h"

#include <algorithm>

#include "chat/chat.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "ops/cpu/isa.h"
#include "runtime/loader.h"
#include "runtime/memory.h"
#include "runtime/sampler.h"
#include "tokenizer/tokenizer.h"

namespace k3 {

struct Engine::Impl {
  EngineOptions opt;
  LoadedCheckpoint lc;              // model, tokenizer, expert cache
  std::unique_ptr<StatePool> pool;  // after lc: released before the model
  ForwardOptions fwd;
  int64_t max_ctx = 0;
  int32_t bos = -1, eot = -1;
  chat::Format format = chat::Format::Xtml;
  std::vector<int32_t> stops;
  SamplingParams sampling;
  std::vector<SeqStep> batch;  // step scratch

  const tok::Tokenizer& tok() const {
    if (!lc.tok) fail("this engine was loaded without a tokenizer (EngineOptions::need_tokenizer is false)");
    return *lc.tok;
  }
};

namespace {

void check_options(const EngineOptions& o) {
  if (o.model_dir.empty()) fail("EngineOptions::model_dir is empty: give a checkpoint directory");
  if (o.device != "cpu" && o.device != "cuda") fail("device must be cpu or cuda, not '" + o.device + "'");
  if (o.numerics != "fast" && o.numerics != "fp32" && o.numerics != "exact")
    fail("numerics must be fast, fp32 or exact, not '" + o.numerics + "'");
  if (!o.chat_format.empty() && o.chat_format != "xtml" && o.chat_format != "k2")
    fail("chat_format must be xtml or k2 (or empty: the checkpoint's), not '" + o.chat_format + "'");
  if (o.threads < 0)
    fail("threads must be >= 0 (0 = leave the OpenMP setting as is), not " + std::to_string(o.threads));
  if (o.context < 0) fail("context must be >= 0 (0 = the model's, at most 32768), not " + std::to_string(o.context));
  if (o.cpu_experts && o.device != "cuda")
    fail("cpu_experts goes with device=cuda (on the CPU every routed expert is the CPU's already)");
  parse_hot_experts(o.hot_experts, o.cpu_experts);  // (its one-line error)
  check_cpu_experts_q8(o.cpu_experts_q8, o.cpu_experts);
  check_gpu_mem(o.gpu_mem, o.device == "cuda");
  if (!o.hot_experts.empty() && o.hot_experts != "0" && !o.ram_budget.empty())
    fail("hot_experts caches routed experts held in host RAM; with ram_budget they are read from disk (not both)");
  if (o.step_tokens < 1 || o.step_tokens > (int64_t(1) << 20))
    fail("step_tokens must be in 1..1048576, not " + std::to_string(o.step_tokens));
}

LoadOptionNames api_names() {
  LoadOptionNames n;
  n.ctx = "context";
  n.mem_limit = "mem_limit";
  n.ram_budget = "ram_budget";
  n.direct_io = "direct_io";
  n.device_cuda = "device=cuda";
  n.numerics_exact = "numerics=exact";
  n.split = "tp/ep";
  n.trunk_fp8 = "trunk_fp8";
  n.no_tokenizer = "set EngineOptions::tokenizer_dir, or need_tokenizer = false for token ids only";
  return n;
}

// The public SamplingOptions and the runtime's SamplingParams have the same fields: one copy for
// both directions.
template <class To, class From>
To convert_sampling(const From& f) {
  To t;
  t.temperature = f.temperature;
  t.top_k = f.top_k;
  t.top_p = f.top_p;
  t.min_p = f.min_p;
  t.repetition_penalty = f.repetition_penalty;
  t.presence_penalty = f.presence_penalty;
  t.frequency_penalty = f.frequency_penalty;
  t.penalty_last_n = f.penalty_last_n;
  t.seed = f.seed;
  return t;
}
SamplingParams to_params(const SamplingOptions& o) { return convert_sampling<SamplingParams>(o); }

tok::TokenId checked_id(const tok::Tokenizer& t, int32_t id) {
  if (id < 0 || !t.is_valid_id(tok::TokenId(id)))
    fail("token id " + std::to_string(id) + " is not in the tokenizer's vocabulary (" + std::to_string(t.vocab_size()) +
         " ids)");
  return tok::TokenId(id);
}

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::load(const EngineOptions& options) {
  check_options(options);
  auto im = std::make_unique<Impl>();
  im->opt = options;
  if (options.threads > 0) par::set_max_threads(options.threads);
  const bool cuda = options.device == "cuda";

  LoadRequest req;
  req.dir = options.model_dir;
  req.tokenizer_dir = options.tokenizer_dir;
  req.need_tokenizer = options.need_tokenizer;
  req.ctx_limit = options.context;
  req.ctx_tokens = options.context;
  req.ubatch = options.step_tokens;
  req.mem_limit = options.mem_limit;
  req.ram_budget = options.ram_budget;
  req.direct_io = options.direct_io;
  req.cuda = cuda;
  req.numerics = ops::parse_numerics(options.numerics);
  req.parallel = {options.tp, options.ep};
  req.trunk_fp8 = options.trunk_fp8;
  req.names = api_names();
  im->lc = load_checkpoint(req);
  im->max_ctx = im->lc.ctx_tokens;
  Model& m = *im->lc.model;

  if (cuda) {
    GpuOptions go = gpu_options_for(options.cuda_graphs, options.step_tokens, im->max_ctx, im->lc.ram_budget == 0,
                                    options.cpu_experts, parse_hot_experts(options.hot_experts, options.cpu_experts));
    go.cpu_experts_q8 = options.cpu_experts_q8;
    if (!options.gpu_mem.empty()) {
      go.gpu_mem = size_t(parse_size(options.gpu_mem, "gpu_mem"));
      go = fit_gpu_mem(m, go);
    }
    m.use_gpu(go);
  } else {
    m.set_max_step_rows(options.step_tokens);
    if (options.prefault) prefault_weights(im->lc, options.load_progress);
  }
  im->pool = m.new_pool();
  im->fwd.numerics = req.numerics;
  im->fwd.experts = im->lc.experts.get();
  im->sampling = sampling_defaults_from_dir(im->lc.dir);
  im->sampling.seed = 0;

  const int64_t V = m.dims().vocab;
  const int64_t bos = m.config().bos_token_id;
  im->bos = bos >= 0 && bos < V ? int32_t(bos) : -1;
  im->stops = eos_ids_from_dir(m, im->lc.dir);
  im->format =
      options.chat_format.empty()
          ? chat::detect_format(im->lc.tokenizer_dir.empty() ? im->lc.dir : im->lc.tokenizer_dir, m.config().model_type)
          : chat::parse_format_name(options.chat_format);
  if (im->lc.tok)
    if (const auto eot = im->lc.tok->special_id(chat::chat_format(im->format).end_marker()); eot && int64_t(*eot) < V) {
      im->eot = int32_t(*eot);
      if (std::find(im->stops.begin(), im->stops.end(), im->eot) == im->stops.end()) im->stops.push_back(im->eot);
    }
  return std::unique_ptr<Engine>(new Engine(std::move(im)));
}

const EngineOptions& Engine::options() const { return impl_->opt; }
int64_t Engine::vocab_size() const { return impl_->lc.model->dims().vocab; }
int64_t Engine::max_context() const { return impl_->max_ctx; }
bool Engine::on_gpu() const { return impl_->lc.model->on_gpu(); }

int32_t Engine::new_sequence() { return impl_->pool->alloc(); }
void Engine::free_sequence(int32_t seq) { impl_->pool->free(seq); }
int32_t Engine::fork_sequence(int32_t seq) {
  impl_->pool->check_live(seq);
  return impl_->pool->fork(seq);
}
void Engine::reset_sequence(int32_t seq) {
  impl_->pool->check_live(seq);
  impl_->pool->reset(seq);
}
int64_t Engine::position(int32_t seq) const {
  impl_->pool->check_live(seq);
  return impl_->pool->position(seq);
}

void Engine::step(const std::vector<StepInput>& in, std::vector<float>* logits, std::vector<int32_t>* argmax) {
  Impl& im = *impl_;
  if (in.empty()) fail("step: no sequences");
  if (!logits && !argmax) fail("step: give logits, argmax or both");
  im.batch.clear();
  int64_t rows = 0;
  for (const StepInput& s : in) {
    im.pool->check_live(s.seq);
    if (s.n <= 0) fail("step: sequence " + std::to_string(s.seq) + " has no tokens (n = " + std::to_string(s.n) + ")");
    if (!s.ids) fail("step: sequence " + std::to_string(s.seq) + " has n = " + std::to_string(s.n) + " but no ids");
    if (s.all_logits && !logits)
      fail("step: sequence " + std::to_string(s.seq) + " asks for all_logits but logits is null");
    const int64_t end = im.pool->position(s.seq) + s.n;
    if (end > im.max_ctx)
      fail("step: sequence " + std::to_string(s.seq) + " would hold " + std::to_string(end) +
           " tokens, over the context limit of " + std::to_string(im.max_ctx));
    im.batch.push_back({s.seq, s.ids, s.n, s.all_logits});
    rows += s.all_logits ? s.n : 1;
  }
  if (logits) logits->resize(size_t(rows) * size_t(vocab_size()));
  if (argmax) argmax->resize(in.size());
  im.lc.model->step(*im.pool, im.batch, im.fwd, logits ? logits->data() : nullptr, argmax ? argmax->data() : nullptr);
}

std::vector<int32_t> Engine::tokenize(std::string_view text) const {
  const std::vector<tok::TokenId> ids = impl_->tok().encode(text);
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string Engine::detokenize(const std::vector<int32_t>& ids, bool skip_special) const {
  const tok::Tokenizer& t = impl_->tok();
  std::vector<tok::TokenId> v;
  v.reserve(ids.size());
  for (int32_t id : ids) v.push_back(checked_id(t, id));
  return t.decode(v, skip_special);
}

uint64_t Engine::sequence_state_bytes() const { return impl_->lc.model->dims().kda_state_bytes(); }
uint64_t Engine::cache_bytes_per_token() const { return impl_->lc.model->dims().mla_bytes_per_token(); }
int64_t Engine::cache_page_tokens() const { return impl_->pool->page_tokens(); }

int32_t Engine::bos_id() const { return impl_->bos; }
int32_t Engine::end_of_turn_id() const { return impl_->eot; }
std::string Engine::chat_format() const { return chat::format_name(impl_->format); }
std::vector<int32_t> Engine::stop_ids() const { return impl_->stops; }
int32_t Engine::special_id(std::string_view text) const {
  const auto id = impl_->tok().special_id(text);
  return id ? int32_t(*id) : -1;
}

std::vector<int32_t> Engine::render_chat(const std::vector<ChatMessage>& messages, const ChatRenderOptions& o) const {
  const tok::Tokenizer& t = impl_->tok();
  std::vector<chat::Message> msgs(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    msgs[i].role = messages[i].role;
    msgs[i].content = messages[i].content;
  }
  chat::RenderOptions ro;
  ro.thinking = o.thinking;
  ro.thinking_effort = o.thinking_effort;
  ro.add_generation_prompt = o.add_generation_prompt;
  const std::vector<tok::TokenId> ids = chat::segments_ids(t, chat::chat_format(impl_->format).render(msgs, ro));
  return std::vector<int32_t>(ids.begin(), ids.end());
}

SamplingOptions Engine::sampling_defaults() const { return convert_sampling<SamplingOptions>(impl_->sampling); }

// ---- TokenSampler

struct TokenSampler::Impl {
  Sampler s;
};

TokenSampler::TokenSampler(const SamplingOptions& o, int64_t vocab) : impl_(new Impl{Sampler(to_params(o), vocab)}) {}
TokenSampler::~TokenSampler() = default;
TokenSampler::TokenSampler(TokenSampler&&) noexcept = default;
TokenSampler& TokenSampler::operator=(TokenSampler&&) noexcept = default;
int32_t TokenSampler::sample(const float* logits) {
  if (!logits) fail("TokenSampler::sample: logits is null");
  return impl_->s.sample(logits);
}
void TokenSampler::accept(int32_t id) { impl_->s.accept(id); }
void TokenSampler::reset() { impl_->s.reset(); }
bool TokenSampler::greedy() const { return impl_->s.plain_greedy(); }

// ---- Detokenizer

struct Detokenizer::Impl {
  const tok::Tokenizer* tok;
  tok::StreamDecoder dec;
};

Detokenizer::Detokenizer(const Engine& e, bool skip_special)
    : impl_(new Impl{&e.impl_->tok(), tok::StreamDecoder(e.impl_->tok(), skip_special)}) {}
Detokenizer::~Detokenizer() = default;
Detokenizer::Detokenizer(Detokenizer&&) noexcept = default;
Detokenizer& Detokenizer::operator=(Detokenizer&&) noexcept = default;
std::string Detokenizer::push(int32_t id) { return impl_->dec.push(checked_id(*impl_->tok, id)); }
std::string Detokenizer::flush() { return impl_->dec.flush(); }

// ---- ChatParser

struct ChatParser::Impl {
  std::unique_ptr<chat::StreamParser> p;
};

namespace {
std::vector<ChatEvent> to_events(const std::vector<chat::Event>& ev) {
  std::vector<ChatEvent> out;
  out.reserve(ev.size());
  for (const chat::Event& e : ev) {
    ChatEvent c;
    switch (e.kind) {
      case chat::EventKind::Reasoning:
        c.kind = ChatEventKind::Reasoning;
        break;
      case chat::EventKind::Content:
        c.kind = ChatEventKind::Content;
        break;
      case chat::EventKind::ToolCallStart:
        c.kind = ChatEventKind::ToolCallStart;
        break;
      case chat::EventKind::ToolArgs:
        c.kind = ChatEventKind::ToolArgs;
        break;
      case chat::EventKind::ToolCallEnd:
        c.kind = ChatEventKind::ToolCallEnd;
        break;
    }
    c.text = e.text;
    c.call = e.call;
    out.push_back(std::move(c));
  }
  return out;
}
}  // namespace

ChatParser::ChatParser(bool thinking_prompt) : impl_(new Impl{std::make_unique<chat::OutputParser>(thinking_prompt)}) {}
ChatParser::ChatParser(const Engine& e, bool thinking_prompt)
    : impl_(new Impl{chat::chat_format(e.impl_->format).parser(thinking_prompt)}) {}
ChatParser::~ChatParser() = default;
ChatParser::ChatParser(ChatParser&&) noexcept = default;
ChatParser& ChatParser::operator=(ChatParser&&) noexcept = default;
std::vector<ChatEvent> ChatParser::feed(std::string_view text) { return to_events(impl_->p->feed(text)); }
std::vector<ChatEvent> ChatParser::finish() { return to_events(impl_->p->finish()); }
const std::string& ChatParser::reasoning() const { return impl_->p->result().reasoning; }
const std::string& ChatParser::content() const { return impl_->p->result().content; }
bool ChatParser::finished_message() const { return impl_->p->result().finished_message; }

}  // namespace k3
