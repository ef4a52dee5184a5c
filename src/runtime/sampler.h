// k3::Sampler: turns one row of logits into one token id (penalties, temperature, top-k, top-p,
// min-p, a seeded draw), plus the sampling defaults read from a model's generation_config.json.
// Owns: the sampling math, its portable RNG and parameter validation. Must not: touch the model,
// the tokenizer or stop conditions (the generation loop owns those), modify the caller's logits,
// or depend on anything whose output differs across standard libraries (std:: distributions).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace k3 {

// Every field has a flag of the same meaning (docs/sampling.md); validate_sampling() names the flag.
struct SamplingParams {
  float temperature = 1.0f;         // --temp; 0 => greedy (argmax after penalties; ties -> lowest id)
  int32_t top_k = 0;                // --top-k; 0 = off
  float top_p = 1.0f;               // --top-p; 1 = off; (0, 1]
  float min_p = 0.0f;               // --min-p; 0 = off; [0, 1]
  float repetition_penalty = 1.0f;  // --repeat-penalty; 1 = off; > 0. CTRL rule, once per distinct token
  float presence_penalty = 0.0f;    // --presence-penalty; logit -= presence * (count > 0)
  float frequency_penalty = 0.0f;   // --frequency-penalty; logit -= frequency * count
  int32_t penalty_last_n = 64;      // --repeat-last-n; window of accepted tokens; -1 = all, 0 = off
  uint64_t seed = 0;                // --seed
};

// Throws k3::Error naming the flag and the allowed range, e.g. "top-p must be in (0, 1], got 1.5".
void validate_sampling(const SamplingParams& p);

// Reads DIR/generation_config.json when present (Hugging Face keys temperature, top_p, top_k, min_p,
// repetition_penalty, presence_penalty, frequency_penalty, do_sample; do_sample=false => temperature
// 0). Unknown keys and null values are ignored; a key with a wrong type or range is a k3::Error naming
// the file and the key. Absent file => built-in defaults. `source` (optional) receives a short
// description: "generation_config.json (temperature, top_p)" or "built-in defaults".
// Precedence for front ends: built-in defaults < this file < command-line flags.
SamplingParams sampling_defaults_from_dir(const std::string& dir, std::string* source = nullptr);

// Portable generator: xoshiro256** (Blackman & Vigna, 2018) whose 256-bit state is four successive
// outputs of splitmix64 started at `seed`. Both are fixed integer recurrences, so one seed gives the
// same stream on every platform (std::mt19937 is portable but the std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }
  void reseed(uint64_t seed);
  uint64_t next_u64();
  // Uniform in [0, 1): the top 53 bits of next_u64() times 2^-53 (exact in a double).
  double next_double() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

 private:
  uint64_t s_[4];
};

// Order of application: Hugging Face generate()'s (penalties, temperature, top-k, top-p, min-p).
// vLLM also puts temperature before the filters but runs min-p before top-k/top-p.
//  1. penalties on the raw logits, over the last penalty_last_n accepted tokens: for each distinct
//     token with count c > 0 in the window, repetition first (logit > 0 ? logit / rp : logit * rp,
//     once, however often it occurred), then logit -= presence + frequency * c. Penalties come first
//     because they correct the model's own scores; every later step sees the corrected scores.
//  2. temperature 0 => argmax of the penalized logits (ties -> lowest id); stop. Greedy ignores the
//     filters (they cannot change the argmax) and consumes no random number.
//  3. divide by temperature, so the filters below see the distribution that is actually drawn from.
//  4. top-k: keep the k highest (ties at the boundary -> lower id). -inf tokens are never kept, so a
//     k above the number of possible tokens keeps them all.
//  5. softmax over the kept tokens (weights exp(z - max); a weight that underflows to 0 is dropped).
//  6. top-p: keep the smallest prefix of the list sorted by probability (descending, ties -> lower
//     id) whose cumulative probability >= top_p; always at least one token.
//  7. min-p: drop tokens with p < min_p * p_max.
//  8. renormalize.
//  9. draw: u = Rng::next_double(); walk the kept tokens in ascending id order and take the first
//     whose cumulative probability exceeds u. Every non-greedy sample() consumes exactly one
//     next_u64(), even when one token is left, so the stream never depends on the logits.
// top-p and min-p compare with a slack of 1e-6 on the parameter (cum >= top_p - 1e-6; drop when
// p < (min_p - 1e-6) * p_max): the float parameter 0.8f is not 0.8, and probabilities computed from
// float logits carry ~1e-7 relative error, so without it `--top-p 0.8` over probabilities 0.5, 0.3
// would keep a third token. All arithmetic after reading the logits is in double.
// Logits: -inf means "impossible"; NaN or +inf is a k3::Error naming the first bad token; all -inf
// (after penalties) is a k3::Error.
class Sampler {
 public:
  Sampler(const SamplingParams& p, int64_t vocab);  // validates p and vocab (1..2^31-1)

  // Appends to the penalty history (callers feed prompt tokens too; sample() does not call it).
  // Throws k3::Error for an id outside [0, vocab).
  void accept(int32_t token);
  void reset();  // clears the history and reseeds the RNG from params().seed

  // Draws one token from distribution(logits); logits[vocab] are not modified. Advances the RNG
  // (unless greedy). Never sorts the vocabulary: O(V) passes, plus O(k log k) with top-k and the
  // sort of one histogram bucket with top-p; with no filter it draws straight from the weights.
  // Not thread-safe (reuses scratch buffers); distribution() allocates its own and is const.
  int32_t sample(const float* logits);

  // The final distribution sample() draws from: (token, probability) sorted by probability
  // descending (ties: lower id first), summing to 1. Greedy gives {(argmax, 1.0)}. For tests and
  // --verbose.
  std::vector<std::pair<int32_t, double>> distribution(const float* logits) const;

  // Step 1 alone: logits after the penalties (in double, -inf kept), for tests and --verbose.
  std::vector<double> penalized_logits(const float* logits) const;

  const SamplingParams& params() const { return p_; }
  // Temperature 0 with every penalty off: sample() is the argmax of the raw logits (ties -> lowest
  // id), which a GPU can pick itself without copying the logits back (Model::forward argmax_out).
  bool plain_greedy() const {
    return p_.temperature == 0.0f &&
           (p_.penalty_last_n == 0 ||
            (p_.repetition_penalty == 1.0f && p_.presence_penalty == 0.0f && p_.frequency_penalty == 0.0f));
  }
  int64_t vocab() const { return vocab_; }

 private:
  // Working buffers, reused by sample() so that it does not allocate per token.
  struct Scratch {
    std::vector<double> v;       // [vocab]: penalized logit, then scaled logit, then weight
    std::vector<int32_t> kept;   // surviving ids, ascending
    std::vector<int32_t> order;  // top-p: the ids of the bucket holding the cut, sorted
    double total = 0;            // sum of v[id] over kept: probability = v[id] / total
  };

  void penalize(const float* logits, std::vector<double>& v) const;  // checks + step 1
  int32_t argmax(const std::vector<double>& v) const;                // step 2
  void filter(Scratch& s) const;                                     // steps 3-8
  int32_t top_p_last(Scratch& s, double total) const;                // step 6's cut

  SamplingParams p_;
  int64_t vocab_;
  Rng rng_;
  std::vector<int32_t> window_;  // last n accepted tokens (ring, oldest at head_); unused for -1 and 0
  size_t head_ = 0;
  // (token, occurrences in the window; -1: all history), ascending by token, counts > 0.
  std::vector<std::pair<int32_t, int32_t>> counts_;
  void count(int32_t token, int32_t delta);
  Scratch scratch_;
};

}  // namespace k3
