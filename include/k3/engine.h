// The public C++ API of k3: load a K3-family checkpoint, run many sequences per step, tokenize,
// render chats, parse chat output, sample. Standard library only (the internals stay behind
// pointers); every bad input is a k3::Error (include/k3/error.h) with a one-line message.
//
// Threading contract:
//  - One thread (the scheduler) drives an Engine: step, new_sequence, free_sequence,
//    fork_sequence, reset_sequence and position must not run concurrently with each other.
//  - The tokenizer and chat calls (tokenize, detokenize, render_chat, the ids and other const
//    getters) are const and may run on other threads concurrently, also while step runs.
//  - TokenSampler, Detokenizer and ChatParser objects are per sequence and not thread-safe;
//    different objects may be used on different threads.
//  - The thread count (EngineOptions::threads) is a process-wide setting of the CPU loops' pool.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "k3/error.h"

namespace k3 {

struct EngineOptions {
  std::string model_dir;          // config.json + safetensors (+ tiktoken.model, tokenizer_config.json)
  std::string device = "cpu";     // cpu | cuda (an NVIDIA GPU; needs a build with the CUDA backend)
  std::string numerics = "fast";  // fast | fp32 | exact (exact: fp64 sums, reference grade, CPU only)
  std::string ram_budget;         // "" or a size ("24G"): keep weights within it by streaming routed
                                  // experts from disk (CPU only; same output)
  bool direct_io = false;         // with ram_budget: read experts with O_DIRECT
  int threads = 0;                // most CPU threads (process-wide); 0 = leave as is (default: all CPUs)
  std::string mem_limit;          // refuse to load above this size ("" = the machine's MemAvailable)
  int64_t context = 0;            // longest sequence in tokens; 0 = min(max_position_embeddings, 32768).
                                  // The load-time memory check counts one sequence of this length.
  int64_t step_tokens = 512;      // rows of one forward piece (longer steps run in pieces); 1..1048576
  std::string tokenizer_dir;      // "" = model_dir
  std::string chat_format;        // "" = the checkpoint's (its chat template, else model_type), xtml or k2
  bool need_tokenizer = true;     // false: load without a tokenizer (token ids only; text calls throw)
  bool prefault = true;           // CPU: read the weights in at load time (else on first use)
  bool cuda_graphs = true;        // cuda: replay decode steps as CUDA graphs
  bool cpu_experts = false;       // cuda: the routed experts stay in host RAM, computed by the CPU
  std::string hot_experts;        // with cpu_experts: a GPU cache of the most routed experts ("0.25", "auto"; "" none)
  bool cpu_experts_q8 = false;    // with cpu_experts: the CPU's experts with 8-bit activations (faster; tokens may
                                  // differ from all on the GPU at near ties)
  std::string gpu_mem;            // cuda: at most this much GPU memory ("40G"); where the model does not fit, the
                                  // routed experts stay in host RAM and as many as fit are cached ("": the free memory)
  int tp = 1, ep = 1;             // split the model over tp (tensor) / ep (expert) parallel ranks in this
                                  // process (CPU only; same output as one rank: docs/multi-gpu.md)
  bool trunk_fp8 = false;         // hold the trunk in FP8 (E4M3, 128 x 128 block scales), quantised at
                                  // load (CPU only for now: docs/fp8-trunk.md)
  // Called during load(), on the loading thread, with bytes done/total while the weights are read in
  // (CPU prefault); a server reports it on /health. Empty = no reports.
  std::function<void(uint64_t done, uint64_t total)> load_progress;
};

// One sequence's part of a step: n tokens appended to sequence seq. ids must stay valid during step.
struct StepInput {
  int32_t seq = -1;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  bool all_logits = false;  // logits of every token, else of the last one only
};

// Sampling settings (docs/sampling.md gives the order of application).
struct SamplingOptions {
  float temperature = 1.0f;         // 0 = greedy (argmax after penalties; ties -> lowest id)
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // 1 = off; (0, 1]
  float min_p = 0.0f;               // 0 = off; [0, 1]
  float repetition_penalty = 1.0f;  // 1 = off; > 0
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t penalty_last_n = 64;  // window of accepted tokens; -1 = all, 0 = off
  uint64_t seed = 0;
};

struct ChatMessage {
  std::string role;  // system | user | assistant | tool
  std::string content;
};

struct ChatRenderOptions {
  bool thinking = true;               // the generation prompt opens a reasoning section (else the answer)
  std::string thinking_effort;        // "" (none given), low, medium, high, max, or none (= non-thinking)
  bool add_generation_prompt = true;  // end with the assistant's opening
};

class Engine {
 public:
  static std::unique_ptr<Engine> load(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineOptions& options() const;
  int64_t vocab_size() const;   // the model's (logits rows have this many entries)
  int64_t max_context() const;  // tokens one sequence may hold (EngineOptions::context resolved)
  bool on_gpu() const;

  // ---- sequences (scheduler thread)
  int32_t new_sequence();               // empty
  void free_sequence(int32_t seq);      // k3::Error for a sequence that is not live
  int32_t fork_sequence(int32_t seq);   // a copy of seq (cache pages shared until written)
  void reset_sequence(int32_t seq);     // back to empty
  int64_t position(int32_t seq) const;  // tokens the sequence holds

  // Memory of sequences (const; any thread): what a cache of forked sequences budgets with.
  uint64_t sequence_state_bytes() const;   // fixed per sequence: KDA recurrent + conv state of every KDA layer
  uint64_t cache_bytes_per_token() const;  // MLA latent cache per held token, all MLA layers
  int64_t cache_page_tokens() const;       // tokens per cache page (forks share whole pages until written)

  // One step of many distinct live sequences. logits (when given) is resized to the output rows,
  // sequence by sequence in input order (n rows with all_logits, else 1), times vocab_size(); argmax
  // (when given) to in.size(): the argmax of each sequence's last row (ties -> lowest id). At least
  // one of them must be given, and logits whenever some input asks for all_logits. Each sequence's
  // results equal the same tokens run alone (bitwise on the CPU with numerics exact).
  void step(const std::vector<StepInput>& in, std::vector<float>* logits, std::vector<int32_t>* argmax);

  // ---- tokenizer (const; any thread)
  std::vector<int32_t> tokenize(std::string_view text) const;  // special-token text stays text
  std::string detokenize(const std::vector<int32_t>& ids, bool skip_special = false) const;
  int32_t bos_id() const;                 // -1 when the model has none
  int32_t end_of_turn_id() const;         // the chat format's end of turn (<|end_of_msg|>, K2 <|im_end|>), -1 if none
  std::vector<int32_t> stop_ids() const;  // end of sequence (config + generation_config) and end of turn
  int32_t special_id(std::string_view text) const;  // the id of a special token's text ("<|open|>"), -1 if none

  // ---- chat (const; any thread): the checkpoint's chat format rendered to ids, ready to feed.
  std::string chat_format() const;  // "xtml" (K3) or "k2" (Kimi K2 template, Kimi Linear)
  std::vector<int32_t> render_chat(const std::vector<ChatMessage>& messages, const ChatRenderOptions& o = {}) const;

  // The checkpoint's sampling defaults (generation_config.json, else built-in), seed 0.
  SamplingOptions sampling_defaults() const;

 private:
  friend class Detokenizer;
  friend class ChatParser;
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns rows of logits into token ids for one sequence (penalties, temperature, top-k/p, min-p, a
// seeded portable RNG). Per sequence; not thread-safe.
class TokenSampler {
 public:
  TokenSampler(const SamplingOptions& o, int64_t vocab);  // k3::Error naming a bad setting
  ~TokenSampler();
  TokenSampler(TokenSampler&&) noexcept;
  TokenSampler& operator=(TokenSampler&&) noexcept;
  int32_t sample(const float* logits);  // logits[vocab] (not modified)
  void accept(int32_t id);              // adds to the penalty history (feed prompt tokens too)
  void reset();                         // clears the history, reseeds
  bool greedy() const;                  // temperature 0, no penalties: sample() == the step's argmax

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Incremental ids -> text: push() returns what is ready (never half a UTF-8 character), flush()
// the rest. The Engine must outlive it. Per sequence; not thread-safe.
class Detokenizer {
 public:
  explicit Detokenizer(const Engine& e, bool skip_special = false);
  ~Detokenizer();
  Detokenizer(Detokenizer&&) noexcept;
  Detokenizer& operator=(Detokenizer&&) noexcept;
  std::string push(int32_t id);
  std::string flush();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Incremental parser of the model's chat output (text, as Detokenizer gives it, special markers
// included: do not skip special tokens) into reasoning, answer and tool-call events.
enum class ChatEventKind { Reasoning, Content, ToolCallStart, ToolArgs, ToolCallEnd };
struct ChatEvent {
  ChatEventKind kind = ChatEventKind::Content;
  std::string text;  // a delta; the tool name for ToolCallStart
  int call = -1;     // 0-based tool call within the message (tool events)
};

class ChatParser {
 public:
  explicit ChatParser(bool thinking_prompt = true);   // XTML; thinking_prompt as ChatRenderOptions::thinking
  ChatParser(const Engine& e, bool thinking_prompt);  // in the engine's chat format
  ~ChatParser();
  ChatParser(ChatParser&&) noexcept;
  ChatParser& operator=(ChatParser&&) noexcept;
  std::vector<ChatEvent> feed(std::string_view text);
  std::vector<ChatEvent> finish();
  const std::string& reasoning() const;  // everything parsed so far
  const std::string& content() const;
  bool finished_message() const;  // the end of the assistant message was seen

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3
