// Tiktoken-format loader, rank index (open addressing), BPE merging by lowest rank (leftmost on
// ties, as the reference does), special-token handling and streaming decode.
// Must not emit special ids from encode(), and must never crash on bad bytes or bad files.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <queue>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/pre_tokenizer.h"

namespace k3::tok {

namespace {

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 29)) * 0x94d049bb133111ebull;
    p += 8;
    n -= 8;
  }
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  h ^= v;
  // full avalanche (murmur3 fmix64) so the low bits used for the slot index depend on every byte
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool b64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (unsigned char c : in) {
    if (c == '=') {
      ++pad;
      continue;
    }
    if (pad) return false;
    const int v = b64_value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return pad <= 2 && (in.size() % 4 == 0);
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("tokenizer: cannot open " + std::string(what) + " " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

Tokenizer Tokenizer::load_dir(const std::string& dir) {
  const std::string cfg = dir + "/tokenizer_config.json";
  std::ifstream probe(cfg);
  return load_files(dir + "/tiktoken.model", probe ? cfg : std::string());
}

Tokenizer Tokenizer::load_files(const std::string& model_path, const std::string& config_path) {
  Tokenizer t;
  const std::string text = read_file(model_path, "tiktoken model");
  std::vector<std::pair<TokenId, std::string>> entries;
  std::string tok;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    auto bad = [&](const char* why) {
      return Error("tokenizer: " + model_path + " line " + std::to_string(line_no) + ": " + why);
    };
    if (sp == std::string_view::npos) throw bad("expected '<base64> <rank>'");
    if (!b64_decode(line.substr(0, sp), tok) || tok.empty()) throw bad("bad base64 token");
    std::string_view r = line.substr(sp + 1);
    uint64_t rank = 0;
    if (r.empty() || r.size() > 9) throw bad("bad rank");
    for (char ch : r) {
      if (ch < '0' || ch > '9') throw bad("bad rank");
      rank = rank * 10 + static_cast<uint64_t>(ch - '0');
    }
    entries.emplace_back(static_cast<TokenId>(rank), tok);
  }
  if (entries.empty()) throw Error("tokenizer: " + model_path + " has no ranks");
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].first != i)
      throw Error("tokenizer: " + model_path + ": ranks must be 0..N-1 without gaps or repeats (rank " +
                  std::to_string(entries[i].first) + " at position " + std::to_string(i) + ")");
  }
  t.n_ranks_ = entries.size();
  t.tokens_.reserve(entries.size() + 256);
  for (auto& e : entries) t.tokens_.push_back(std::move(e.second));
  t.is_special_.assign(t.tokens_.size(), 0);
  t.build_index();
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    if (!t.rank_of(&c, 1))
      throw Error("tokenizer: " + model_path + ": byte " + std::to_string(b) + " has no rank (not byte-level BPE)");
  }
  for (size_t i = 0; i < t.tokens_.size(); ++i) {
    if (*t.rank_of(t.tokens_[i].data(), t.tokens_[i].size()) != i)
      throw Error("tokenizer: " + model_path + ": token of rank " + std::to_string(i) + " is duplicated");
  }

  if (!config_path.empty()) {
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(read_file(config_path, "tokenizer config"));
    } catch (const nlohmann::json::exception& e) {
      throw Error("tokenizer: " + config_path + ": invalid JSON (" + std::string(e.what()) + ")");
    }
    if (cfg.contains("added_tokens_decoder")) {
      const auto& added = cfg["added_tokens_decoder"];
      if (!added.is_object()) throw Error("tokenizer: " + config_path + ": added_tokens_decoder is not an object");
      for (auto it = added.begin(); it != added.end(); ++it) {
        uint64_t id = 0;
        const std::string& key = it.key();
        if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos)
          throw Error("tokenizer: " + config_path + ": added token id '" + key + "' is not a number");
        id = std::stoull(key);
        if (!it->is_object() || !it->contains("content") || !(*it)["content"].is_string())
          throw Error("tokenizer: " + config_path + ": added token " + key + " has no string content");
        if (id < t.n_ranks_)
          throw Error("tokenizer: " + config_path + ": added token id " + key + " collides with a rank");
        const std::string name = (*it)["content"].get<std::string>();
        if (name.empty() || t.specials_.count(name))
          throw Error("tokenizer: " + config_path + ": added token name '" + name + "' is empty or repeated");
        if (t.tokens_.size() <= id) {
          t.tokens_.resize(id + 1);
          t.is_special_.resize(id + 1, 0);
        }
        t.tokens_[id] = name;
        t.is_special_[id] = 1;
        t.specials_.emplace(name, static_cast<TokenId>(id));
        t.specials_by_len_.emplace_back(name, static_cast<TokenId>(id));
      }
      std::sort(t.specials_by_len_.begin(), t.specials_by_len_.end(),
                [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    }
  }
  return t;
}

void Tokenizer::build_index() {
  size_t cap = 16;
  while (cap < tokens_.size() + tokens_.size() / 2) cap <<= 1;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (TokenId id = 0; id < n_ranks_; ++id) {
    const std::string& s = tokens_[id];
    const uint64_t h = hash_bytes(s.data(), s.size());
    Slot fresh;
    std::memcpy(&fresh.key8, s.data(), std::min<size_t>(8, s.size()));
    fresh.id = id;
    fresh.tag = static_cast<uint16_t>(h >> 48);
    fresh.len = static_cast<uint16_t>(std::min<size_t>(s.size(), 0xFFFF));
    for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& sl = slots_[i];
      if (sl.len == 0) {
        sl = fresh;
        break;
      }
      if (sl.tag == fresh.tag && tokens_[sl.id] == s) break;  // duplicate: first rank wins, caught by caller
    }
  }
  byte_pair_rank_.assign(65536, UINT32_MAX);
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const char two[2] = {static_cast<char>(a), static_cast<char>(b)};
      if (auto r = rank_of(two, 2)) byte_pair_rank_[static_cast<size_t>(a * 256 + b)] = *r;
    }
  }
}

std::optional<TokenId> Tokenizer::rank_of(const char* p, size_t n) const {
  const uint64_t h = hash_bytes(p, n);
  const uint16_t tag = static_cast<uint16_t>(h >> 48);
  uint64_t key8 = 0;
  std::memcpy(&key8, p, std::min<size_t>(8, n));
  const uint16_t len = static_cast<uint16_t>(std::min<size_t>(n, 0xFFFF));
  for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& sl = slots_[i];
    if (sl.len == 0) return std::nullopt;
    if (sl.tag == tag && sl.len == len && sl.key8 == key8) {
      if (n <= 8) return sl.id;
      const std::string& t = tokens_[sl.id];
      if (t.size() == n && std::memcmp(t.data() + 8, p + 8, n - 8) == 0) return sl.id;
    }
  }
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<TokenId>& out) const {
  if (piece.empty()) return;
  if (auto r = rank_of(piece.data(), piece.size())) {
    out.push_back(*r);
    return;
  }
  if (piece.size() <= 256) {
    bpe_small(piece, out);
  } else {
    bpe_large(piece, out);
  }
}

// Quadratic scan over part boundaries (fast for the short pieces that dominate real text).
void Tokenizer::bpe_small(std::string_view piece, std::vector<TokenId>& out) const {
  constexpr uint32_t kNone = UINT32_MAX;
  struct Part {
    uint32_t start, rank;
  };
  thread_local std::vector<Part> parts;
  const size_t n = piece.size();
  parts.clear();
  auto pair_rank = [&](size_t i) -> uint32_t {  // rank of parts[i] + parts[i+1]
    if (i + 2 >= parts.size()) return kNone;
    auto r = rank_of(piece.data() + parts[i].start, parts[i + 2].start - parts[i].start);
    return r ? *r : kNone;
  };
  for (size_t i = 0; i <= n; ++i) parts.push_back({static_cast<uint32_t>(i), kNone});
  for (size_t i = 0; i + 1 < n; ++i)
    parts[i].rank =
        byte_pair_rank_[static_cast<unsigned char>(piece[i]) * 256u + static_cast<unsigned char>(piece[i + 1])];
  while (parts.size() > 2) {
    uint32_t best = kNone;
    size_t bi = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].rank < best) {
        best = parts[i].rank;
        bi = i;
      }
    }
    if (best == kNone) break;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(bi) + 1);
    parts[bi].rank = pair_rank(bi);
    if (bi > 0) parts[bi - 1].rank = pair_rank(bi - 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i)
    out.push_back(*rank_of(piece.data() + parts[i].start, parts[i + 1].start - parts[i].start));
}

// Same merge order with a heap and a linked list: O(n log n) for long pieces.
void Tokenizer::bpe_large(std::string_view piece, std::vector<TokenId>& out) const {
  const size_t n = piece.size();
  std::vector<uint32_t> start(n + 1), next(n + 1), prev(n + 1);
  std::vector<uint8_t> alive(n + 1, 1);
  for (size_t i = 0; i <= n; ++i) {
    start[i] = static_cast<uint32_t>(i);
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i ? i - 1 : 0);
  }
  // Part i covers [i, next[i]); node n is the end sentinel. Heap entries (rank, i, right end).
  using E = std::tuple<uint32_t, uint32_t, uint32_t>;
  std::priority_queue<E, std::vector<E>, std::greater<E>> heap;
  auto push_pair = [&](uint32_t i) {
    if (i >= n) return;
    const uint32_t j = next[i];
    if (j >= n) return;
    const uint32_t e = next[j];
    if (auto r = rank_of(piece.data() + i, e - i)) heap.emplace(*r, i, e);
  };
  for (uint32_t i = 0; i < n; ++i) push_pair(i);
  while (!heap.empty()) {
    auto [r, i, e] = heap.top();
    heap.pop();
    if (!alive[i] || next[i] >= n || next[next[i]] != e) continue;  // stale entry
    const uint32_t j = next[i];
    alive[j] = 0;
    next[i] = e;
    prev[e] = i;
    push_pair(i);
    if (i > 0) push_pair(prev[i]);
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(*rank_of(piece.data() + i, next[i] - i));
}

void Tokenizer::encode_valid(std::string_view text, std::vector<TokenId>& out) const {
  thread_local std::vector<ByteRange> chunks, pieces;
  auto run_pieces = [&](std::string_view chunk) {
    pieces.clear();
    split_pieces(chunk, pieces);
    for (const auto& p : pieces) encode_piece(chunk.substr(p.begin, p.end - p.begin), out);
  };
  if (text.size() <= 25000) {  // fewer bytes than either long-input limit: no cut possible
    run_pieces(text);
    return;
  }
  std::vector<ByteRange> local;
  split_long_input(text, local);
  for (const auto& c : local) run_pieces(text.substr(c.begin, c.end - c.begin));
}

void Tokenizer::encode_append(std::string_view text, std::vector<TokenId>& out) const {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t j = i;
    while (j < n) {
      const int len = utf8_valid_len(text, j);
      if (len == 0) break;
      j += static_cast<size_t>(len);
    }
    if (j > i) encode_valid(text.substr(i, j - i), out);
    size_t k = j;
    while (k < n && utf8_valid_len(text, k) == 0) ++k;
    if (k > j) encode_piece(text.substr(j, k - j), out);  // invalid bytes: one byte-level piece
    i = k;
  }
}

std::vector<TokenId> Tokenizer::encode(std::string_view text) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  encode_append(text, out);
  return out;
}

std::vector<TokenId> Tokenizer::encode_with_special(std::string_view text) const {
  std::vector<TokenId> out;
  size_t plain = 0;
  for (size_t i = 0; i < text.size();) {
    bool hit = false;
    for (const auto& [name, id] : specials_by_len_) {
      if (text.compare(i, name.size(), name) == 0) {
        encode_append(text.substr(plain, i - plain), out);
        out.push_back(id);
        i += name.size();
        plain = i;
        hit = true;
        break;
      }
    }
    if (!hit) ++i;
  }
  encode_append(text.substr(plain), out);
  return out;
}

std::string_view Tokenizer::token_bytes(TokenId id) const {
  if (!is_valid_id(id))
    throw Error("tokenizer: token id " + std::to_string(id) + " is not in the vocabulary (" +
                std::to_string(tokens_.size()) + " ids)");
  return tokens_[id];
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  std::string out;
  for (TokenId id : ids) {
    std::string_view b = token_bytes(id);
    if (skip_special && is_special(id)) continue;
    out.append(b);
  }
  return out;
}

std::optional<TokenId> Tokenizer::special_id(std::string_view name) const {
  auto it = specials_.find(std::string(name));
  if (it == specials_.end()) return std::nullopt;
  return it->second;
}

TokenId Tokenizer::require_special(std::string_view name) const {
  auto id = special_id(name);
  if (!id) throw Error("tokenizer: special token " + std::string(name) + " is not in tokenizer_config.json");
  return *id;
}

size_t utf8_incomplete_tail(std::string_view s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = 0;
    if (b >= 0xC2 && b <= 0xDF)
      need = 2;
    else if (b >= 0xE0 && b <= 0xEF)
      need = 3;
    else if (b >= 0xF0 && b <= 0xF4)
      need = 4;
    if (need <= back) return 0;  // ASCII, invalid lead, or already complete
    // the bytes after the lead must be a valid prefix (second-byte ranges per Unicode Table 3-7)
    if (back >= 2) {
      const auto c1 = static_cast<unsigned char>(s[n - back + 1]);
      unsigned lo = 0x80, hi = 0xBF;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
      if (c1 < lo || c1 > hi) return 0;
    }
    return back;
  }
  return 0;
}

std::string StreamDecoder::push(TokenId id) {
  std::string_view b = tok_->token_bytes(id);
  if (!(skip_special_ && tok_->is_special(id))) pending_.append(b);
  const size_t hold = utf8_incomplete_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return ready;
}

std::string StreamDecoder::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

}  // namespace k3::tok
