// k3::tok::Tokenizer: tiktoken-format byte-level BPE (any vocabulary: base64 token + rank per line)
// with the Kimi pre-tokenizer and the special tokens of tokenizer_config.json. encode() never
// produces special ids (user text is plain text); only encode_with_special()/special_id() do.
// Owns text <-> ids only: no chat format here (see src/chat), no tensor code.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace k3::tok {

using TokenId = uint32_t;

class Tokenizer {
 public:
  // dir holds tiktoken.model and (optionally) tokenizer_config.json. Throws k3::Error.
  static Tokenizer load_dir(const std::string& dir);
  static Tokenizer load_files(const std::string& model_path, const std::string& config_path);

  // Ordinary encoding of arbitrary bytes. Valid UTF-8 runs go through the Kimi pre-tokenizer (with
  // the long-input rules); each run of invalid UTF-8 bytes is BPE-merged as one piece. Literal
  // special-token text (e.g. "<|end_of_msg|>") is encoded as plain text.
  std::vector<TokenId> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<TokenId>& out) const;
  // Like encode(), but exact special-token names in the text become their ids (trusted text only).
  std::vector<TokenId> encode_with_special(std::string_view text) const;

  // ids -> bytes. Special ids decode to their names unless skip_special. Throws on unknown ids.
  std::string decode(std::span<const TokenId> ids, bool skip_special = false) const;
  std::string_view token_bytes(TokenId id) const;  // throws on unknown ids

  std::optional<TokenId> special_id(std::string_view name) const;
  TokenId require_special(std::string_view name) const;  // throws k3::Error when absent
  bool is_special(TokenId id) const { return id < is_special_.size() && is_special_[id]; }
  bool is_valid_id(TokenId id) const { return id < tokens_.size() && (id < n_ranks_ || is_special_[id]); }
  size_t n_ranks() const { return n_ranks_; }
  size_t vocab_size() const { return tokens_.size(); }

  // BPE of one piece (exposed for tests): whole-piece lookup first, then lowest-rank merging.
  void encode_piece(std::string_view piece, std::vector<TokenId>& out) const;

 private:
  struct Slot {         // 16 bytes; tokens of <= 8 bytes compare without leaving the slot
    uint64_t key8 = 0;  // first 8 bytes, zero padded
    TokenId id = 0;
    uint16_t tag = 0;  // upper hash bits
    uint16_t len = 0;  // 0 = empty slot; lengths >= 0xFFFF are stored as 0xFFFF
  };
  std::optional<TokenId> rank_of(const char* p, size_t n) const;
  void build_index();
  void encode_valid(std::string_view text, std::vector<TokenId>& out) const;
  void bpe_small(std::string_view piece, std::vector<TokenId>& out) const;
  void bpe_large(std::string_view piece, std::vector<TokenId>& out) const;

  std::vector<std::string> tokens_;  // id -> bytes (ranks) or name (specials)
  std::vector<uint8_t> is_special_;
  size_t n_ranks_ = 0;
  std::vector<Slot> slots_;
  std::vector<uint32_t> byte_pair_rank_;  // [a*256+b] -> rank of the two-byte token, or UINT32_MAX
  uint64_t mask_ = 0;
  std::unordered_map<std::string, TokenId> specials_;
  std::vector<std::pair<std::string, TokenId>> specials_by_len_;  // longest first, for matching
};

// Incremental ids -> text. push() returns the bytes that are ready: never the first bytes of a
// UTF-8 character whose remaining bytes may still arrive (bytes that can never become valid are
// passed through). flush() returns what is held at the end. Concatenating all outputs equals
// Tokenizer::decode of the same ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false) : tok_(&tok), skip_special_(skip_special) {}
  std::string push(TokenId id);
  std::string flush();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

// Length of the trailing incomplete-but-completable UTF-8 sequence of s (0..3).
size_t utf8_incomplete_tail(std::string_view s);

}  // namespace k3::tok
