// Full Kimi vocabulary tests: spec §4 goldens, the >= 10 MB corpus and the fuzz set against ids from
// the tiktoken reference (written by tools/tokenizer/setup_vocab.py), and round trips. Skips with a
// message when that output folder is absent (set K3_TOKENIZER_DATA to point elsewhere).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "tokenizer/tok_test_util.h"
#include "tokenizer/tokenizer.h"

using k3::tok::TokenId;
using k3::tok::Tokenizer;

namespace {

std::string data_dir() {
  const char* env = std::getenv("K3_TOKENIZER_DATA");
  return env && *env ? env : K3_TOKENIZER_DATA;
}

const Tokenizer* kimi() {
  static std::unique_ptr<Tokenizer> t = []() -> std::unique_ptr<Tokenizer> {
    const std::string dir = data_dir() + "/kimi";
    if (!std::filesystem::exists(dir + "/tiktoken.model")) return nullptr;
    return std::make_unique<Tokenizer>(Tokenizer::load_dir(dir));
  }();
  return t.get();
}

#define REQUIRE_KIMI()                                                                                                \
  if (!kimi())                                                                                                        \
  GTEST_SKIP() << "Kimi vocabulary not found in " << data_dir() << "/kimi: run tools/tokenizer/setup_vocab.py --out " \
               << data_dir() << " (needs pip packages "                                                               \
               << "from tools/tokenizer/requirements.txt)"

}  // namespace

TEST(KimiVocab, SpecGoldens) {
  REQUIRE_KIMI();
  const Tokenizer& t = *kimi();
  EXPECT_EQ(t.n_ranks(), 163584u);
  EXPECT_EQ(t.encode("Hello world"), (std::vector<TokenId>{19180, 2695}));
  EXPECT_EQ(t.encode("Hello, world!"), (std::vector<TokenId>{19180, 11, 2695, 0}));
  EXPECT_EQ(t.encode("你好世界"), (std::vector<TokenId>{33845, 2243}));
  EXPECT_EQ(t.encode("1234567890"), (std::vector<TokenId>{6694, 12972, 16242, 15}));
  EXPECT_EQ(t.encode("中文English混合"), (std::vector<TokenId>{16717, 44372, 13935}));
  EXPECT_EQ(t.encode("The capital of France is"), (std::vector<TokenId>{1008, 10484, 318, 15383, 387}));
  EXPECT_EQ(t.encode("What's"), (std::vector<TokenId>{58434}));
  EXPECT_EQ(t.encode("中文abc"), (std::vector<TokenId>{16717, 8497}));
}

TEST(KimiVocab, K3SpecialTokenIds) {
  REQUIRE_KIMI();
  const Tokenizer& t = *kimi();
  EXPECT_EQ(t.require_special("[BOS]"), 163584u);
  EXPECT_EQ(t.require_special("[EOS]"), 163585u);
  EXPECT_EQ(t.require_special("<|end_of_msg|>"), 163586u);
  EXPECT_EQ(t.require_special("<|open|>"), 163587u);
  EXPECT_EQ(t.require_special("<|close|>"), 163588u);
  EXPECT_EQ(t.require_special("<|sep|>"), 163589u);
  EXPECT_EQ(t.require_special("[EOT]"), 163593u);
  EXPECT_EQ(t.require_special("<|media_pad|>"), 163605u);
  EXPECT_EQ(t.require_special("[PAD]"), 163839u);
  EXPECT_EQ(t.vocab_size(), 163840u);
  EXPECT_EQ(t.encode_with_special("<|close|>think<|sep|>"), (std::vector<TokenId>{163588, 39964, 163589}));
  for (TokenId id : t.encode("<|close|>think<|sep|><|end_of_msg|>")) EXPECT_LT(id, 163584u);
}

TEST(KimiVocab, CorpusMatchesReferenceByteExact) {
  REQUIRE_KIMI();
  const auto docs = k3test::read_records(data_dir() + "/corpus.bin");
  const auto ref = k3test::read_id_records(data_dir() + "/corpus.ids");
  ASSERT_EQ(docs.size(), ref.size());
  size_t bytes = 0, tokens = 0, bad = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const auto ids = kimi()->encode(docs[i]);
    bytes += docs[i].size();
    tokens += ids.size();
    if (ids != ref[i]) {
      size_t k = 0;
      while (k < ids.size() && k < ref[i].size() && ids[k] == ref[i][k]) ++k;
      if (++bad <= 5) ADD_FAILURE() << "document " << i << ": first difference at token " << k;
    }
    EXPECT_EQ(kimi()->decode(ids), docs[i]) << "round trip of document " << i;
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_GE(bytes, 10u * 1000 * 1000);
  std::printf("corpus: %zu documents, %zu bytes, %zu tokens\n", docs.size(), bytes, tokens);
}

TEST(KimiVocab, FuzzMatchesReferenceByteExact) {
  REQUIRE_KIMI();
  const auto strs = k3test::read_records(data_dir() + "/fuzz.bin");
  const auto ref = k3test::read_id_records(data_dir() + "/fuzz.ids");
  ASSERT_EQ(strs.size(), ref.size());
  ASSERT_GE(strs.size(), 10000u);
  size_t bad = 0;
  for (size_t i = 0; i < strs.size(); ++i) {
    const auto ids = kimi()->encode(strs[i]);
    if (ids != ref[i] && ++bad <= 5) ADD_FAILURE() << "fuzz string " << i << " differs: " << strs[i];
    if (kimi()->decode(ids) != strs[i] && ++bad <= 5) ADD_FAILURE() << "fuzz string " << i << " round trip";
  }
  EXPECT_EQ(bad, 0u);
}
