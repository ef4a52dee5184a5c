// The tokenizer's Unicode version (issue 17): the compiled-in property table (Unicode 16.0.0, from
// tools/tokenizer/gen_unicode_props.py) against known properties and against every code point's
// classes as the reference's regex engine reads them; and a corpus of Unicode 15.1 / 16.0 / 17.0
// characters in contexts of the pattern against tiktoken's pieces and ids (Kimi and small vocabulary),
// all from tools/tokenizer/unicode_reference.py (tests/tokenizer/data/). The Kimi ids need the
// vocabulary of tools/tokenizer/setup_vocab.py and skip without it; the rest always runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tok_test_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_props.h"

using k3::tok::cp_props;
using k3::tok::TokenId;
using k3::tok::Tokenizer;
namespace tok = k3::tok;

namespace {

const std::string kData = std::string(K3_SOURCE_DIR) + "/tests/tokenizer/data";

std::string vocab_dir() {
  const char* env = std::getenv("K3_TOKENIZER_DATA");
  return std::string(env && *env ? env : K3_TOKENIZER_DATA) + "/kimi";
}

const Tokenizer* kimi() {
  static std::unique_ptr<Tokenizer> t = []() -> std::unique_ptr<Tokenizer> {
    if (!std::filesystem::exists(vocab_dir() + "/tiktoken.model")) return nullptr;
    return std::make_unique<Tokenizer>(Tokenizer::load_dir(vocab_dir()));
  }();
  return t.get();
}

const Tokenizer& small() {
  static Tokenizer t = Tokenizer::load_dir(std::string(K3_SOURCE_DIR) + "/tests/fixtures/tokenizer-small");
  return t;
}

struct Case {
  std::string group, input;
  std::vector<size_t> pieces;  // empty for the long inputs
  std::vector<TokenId> kimi, small;
  bool hashed = false;  // long inputs: ids given as count + FNV-1a 64
  size_t kimi_n = 0, small_n = 0;
  std::string kimi_fnv, small_fnv;
};

std::vector<Case> read_corpus(size_t* declared) {
  std::vector<Case> out;
  std::ifstream f(kData + "/unicode_corpus.jsonl");
  std::string line;
  bool first = true;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (first) {
      *declared = j.at("strings").get<size_t>();
      first = false;
      continue;
    }
    Case c;
    c.group = j.at("group").get<std::string>();
    if (j.contains("s")) {
      c.input = j.at("s").get<std::string>();
      c.pieces = j.at("pieces").get<std::vector<size_t>>();
      c.kimi = j.at("kimi").get<std::vector<TokenId>>();
      c.small = j.at("small").get<std::vector<TokenId>>();
    } else {
      c.input = j.at("head").get<std::string>();
      const auto body = j.at("body").get<std::string>();
      for (int r = j.at("repeat").get<int>(); r > 0; --r) c.input += body;
      c.input += j.at("tail").get<std::string>();
      c.hashed = true;
      c.kimi_n = j.at("kimi_n").get<size_t>();
      c.small_n = j.at("small_n").get<size_t>();
      c.kimi_fnv = j.at("kimi_fnv").get<std::string>();
      c.small_fnv = j.at("small_fnv").get<std::string>();
    }
    out.push_back(std::move(c));
  }
  return out;
}

const std::vector<Case>& corpus() {
  static size_t declared = 0;
  static const std::vector<Case> c = read_corpus(&declared);
  EXPECT_EQ(c.size(), declared) << "unicode_corpus.jsonl is truncated";
  return c;
}

std::string fnv1a64(const std::vector<TokenId>& ids) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (TokenId v : ids)
    for (int k = 0; k < 4; ++k) h = (h ^ ((v >> (8 * k)) & 0xFF)) * 0x100000001B3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

bool ids_match(const std::vector<TokenId>& got, const std::vector<TokenId>& want, size_t want_n,
               const std::string& want_fnv, bool hashed) {
  return hashed ? got.size() == want_n && fnv1a64(got) == want_fnv : got == want;
}

}  // namespace

TEST(TokUnicodeTable, VersionAndKnownProperties) {
  EXPECT_STREQ(tok::unicode_version(), "16.0.0");
  const uint8_t lu = tok::kLetter | tok::kUpper, ll = tok::kLetter | tok::kLower;
  const uint8_t lo = tok::kLetter | tok::kUpper | tok::kLower, mark = tok::kUpper | tok::kLower;
  EXPECT_EQ(cp_props('A'), lu);
  EXPECT_EQ(cp_props('z'), ll);
  EXPECT_EQ(cp_props('7'), tok::kNumber);
  EXPECT_EQ(cp_props(' '), tok::kSpace | tok::kPySpace);
  EXPECT_EQ(cp_props('\n'), tok::kSpace | tok::kCrLf | tok::kPySpace);
  EXPECT_EQ(cp_props('\r'), tok::kSpace | tok::kCrLf | tok::kPySpace);
  EXPECT_EQ(cp_props(0x1F), tok::kPySpace);  // str.isspace, not White_Space
  EXPECT_EQ(cp_props('\''), 0);
  EXPECT_EQ(cp_props(0x4E2D), tok::kHan | tok::kLetter);
  EXPECT_EQ(cp_props(0x3005), tok::kHan | tok::kLetter);  // 々 Lm, Script=Han
  EXPECT_EQ(cp_props(0x3007), tok::kHan | tok::kNumber);  // 〇 Nl, Script=Han
  EXPECT_EQ(cp_props(0x3001), 0);                         // 、 Script=Common (Script_Extensions has Han)
  EXPECT_EQ(cp_props(0x0301), mark);
  EXPECT_EQ(cp_props(0xD55C), lo);  // 한 Lo, not Han
  // Unicode 15.1 / 16.0 additions
  EXPECT_EQ(cp_props(0x1C89), lu);                         // CYRILLIC CAPITAL LETTER TJE (16.0)
  EXPECT_EQ(cp_props(0x1C8A), ll);                         // CYRILLIC SMALL LETTER TJE (16.0)
  EXPECT_EQ(cp_props(0xA7CB), lu);                         // LATIN CAPITAL LETTER RAMS HORN (16.0)
  EXPECT_EQ(cp_props(0xA7DC), lu);                         // LATIN CAPITAL LETTER LAMBDA WITH STROKE (16.0)
  EXPECT_EQ(cp_props(0x0897), mark);                       // ARABIC PEPET (16.0, Mn)
  EXPECT_EQ(cp_props(0x10EFC), mark);                      // ARABIC COMBINING ALEF OVERLAY (16.0, Mn)
  EXPECT_EQ(cp_props(0x10D40), tok::kNumber);              // GARAY DIGIT ZERO (16.0, Nd)
  EXPECT_EQ(cp_props(0x10D4A), lo);                        // GARAY VOWEL SIGN A (16.0, Lo)
  EXPECT_EQ(cp_props(0x10D50), lu);                        // GARAY CAPITAL LETTER A (16.0)
  EXPECT_EQ(cp_props(0x16D40), tok::kLetter | mark);       // KIRAT RAI SIGN ANUSVARA (16.0, Lm)
  EXPECT_EQ(cp_props(0x2EBF0), tok::kHan | tok::kLetter);  // CJK Extension I (15.1)
  EXPECT_EQ(cp_props(0x1171E), mark);                      // AHOM CONSONANT SIGN MEDIAL RA (Mn -> Mc in 16.0)
  // Unicode 17.0 characters are unassigned for the reference
  EXPECT_EQ(cp_props(0x11DB0), 0);
  EXPECT_EQ(cp_props(0x323B0), 0);  // CJK Extension J
  // surrogates, out of range
  EXPECT_EQ(cp_props(0xD800), 0);
  EXPECT_EQ(cp_props(0x110000), 0);
  EXPECT_EQ(cp_props(0xFFFFFFFFu), 0);
  EXPECT_TRUE(tok::py_isspace(0x85));
  EXPECT_TRUE(tok::py_isspace(0x3000));
  EXPECT_FALSE(tok::py_isspace(0x200B));
  EXPECT_FALSE(tok::py_isspace(0x180E));
  EXPECT_FALSE(tok::py_isspace(0x110000));
}

TEST(TokUnicodeTable, EveryCodePointMatchesTheReferenceClasses) {
  const auto classes = k3test::read_unicode_classes(kData + "/unicode_classes.txt");
  ASSERT_FALSE(classes.empty()) << "cannot read " << kData << "/unicode_classes.txt";
  using Pred = bool (*)(uint8_t);
  const std::vector<std::pair<std::string, Pred>> preds = {
      {"han", [](uint8_t f) { return (f & tok::kHan) != 0; }},
      {"letter", [](uint8_t f) { return (f & tok::kLetter) != 0; }},
      {"number", [](uint8_t f) { return (f & tok::kNumber) != 0; }},
      {"upper", [](uint8_t f) { return (f & tok::kUpper) != 0; }},
      {"lower", [](uint8_t f) { return (f & tok::kLower) != 0; }},
      {"space", [](uint8_t f) { return (f & tok::kSpace) != 0; }},
      {"crlf", [](uint8_t f) { return (f & tok::kCrLf) != 0; }},
      {"not_letter_number_crlf", [](uint8_t f) { return !(f & (tok::kLetter | tok::kNumber | tok::kCrLf)); }},
      {"not_space_letter_number", [](uint8_t f) { return !(f & (tok::kSpace | tok::kLetter | tok::kNumber)); }},
      {"py_isspace", [](uint8_t f) { return (f & tok::kPySpace) != 0; }},
  };
  for (const auto& [name, pred] : preds) {
    ASSERT_TRUE(classes.count(name)) << name;
    const auto& want = classes.at(name);
    size_t bad = 0, members = 0;
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;  // not in strings
      members += want[cp];
      if (pred(cp_props(cp)) != want[cp] && ++bad <= 5)
        ADD_FAILURE() << name << ": U+" << std::hex << cp << " is " << (want[cp] ? "" : "not ") << "a member";
    }
    EXPECT_EQ(bad, 0u) << name;
    EXPECT_GT(members, 0u) << name;
  }
  // the case-insensitive contraction letters the matcher folds: ASCII pairs, and U+017F for 's'
  for (const char* c : {"s", "t", "r", "e", "v", "m", "l", "d"}) {
    const auto& f = classes.at(std::string("fold_") + c);
    std::vector<uint32_t> got;
    for (uint32_t cp = 0; cp < 0x110000; ++cp)
      if (f[cp]) got.push_back(cp);
    std::vector<uint32_t> want = {static_cast<uint32_t>(c[0] - 32), static_cast<uint32_t>(c[0])};
    if (c[0] == 's') want.push_back(0x17F);
    EXPECT_EQ(got, want) << c;
  }
}

TEST(TokUnicodeCorpus, PiecesMatchTiktoken) {
  const auto& cs = corpus();
  ASSERT_GT(cs.size(), 1000u);
  size_t bad = 0, strings = 0, pieces = 0;
  std::vector<tok::ByteRange> r;
  for (const auto& c : cs) {
    if (c.hashed) continue;
    r.clear();
    tok::split_pieces(c.input, r);
    std::vector<size_t> got;
    for (auto x : r) got.push_back(x.end - x.begin);
    ++strings;
    pieces += c.pieces.size();
    if (got != c.pieces && ++bad <= 10) ADD_FAILURE() << "[" << c.group << "] pieces differ for: " << c.input;
  }
  EXPECT_EQ(bad, 0u);
  std::printf("unicode corpus: %zu strings, %zu reference pieces, %zu mismatching\n", strings, pieces, bad);
}

TEST(TokUnicodeCorpus, SmallVocabIdsMatchTiktoken) {
  size_t bad = 0, ids = 0;
  for (const auto& c : corpus()) {
    const auto got = small().encode(c.input);
    ids += got.size();
    if (!ids_match(got, c.small, c.small_n, c.small_fnv, c.hashed) && ++bad <= 10)
      ADD_FAILURE() << "[" << c.group << "] small-vocabulary ids differ for: " << c.input.substr(0, 200);
    EXPECT_EQ(small().decode(got), c.input);
  }
  EXPECT_EQ(bad, 0u);
  std::printf("unicode corpus, small vocabulary: %zu strings, %zu ids, %zu mismatching\n", corpus().size(), ids, bad);
}

TEST(TokUnicodeCorpus, KimiIdsMatchTiktoken) {
  if (!kimi()) GTEST_SKIP() << "Kimi vocabulary not found in " << vocab_dir() << ": run tools/tokenizer/setup_vocab.py";
  size_t bad = 0, ids = 0;
  for (const auto& c : corpus()) {
    const auto got = kimi()->encode(c.input);
    ids += got.size();
    if (!ids_match(got, c.kimi, c.kimi_n, c.kimi_fnv, c.hashed) && ++bad <= 10)
      ADD_FAILURE() << "[" << c.group << "] Kimi ids differ for: " << c.input.substr(0, 200);
    EXPECT_EQ(kimi()->decode(got), c.input);
  }
  EXPECT_EQ(bad, 0u);
  std::printf("unicode corpus, Kimi vocabulary: %zu strings, %zu ids, %zu mismatching\n", corpus().size(), ids, bad);
}
