// Checks the hand-written Kimi pre-tokenizer against ICU's regex engine running the §4 pattern
// verbatim (ICU supports the && class intersection and the look-ahead). The only rewrite is \s/\S ->
// \p{White_Space}/\P{White_Space}: the reference engine's \s is Unicode White_Space, ICU's is not.
#include <gtest/gtest.h>
#include <unicode/uregex.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>

#include <random>
#include <string>
#include <vector>

#include "tokenizer/pre_tokenizer.h"

namespace {

// spec k3-architecture.md §4, alternatives joined by '|'
const char* kBranches[] = {
    R"([\p{Han}]+)",
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
    R"(\p{N}{1,3})",
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*)",
    R"(\s*[\r\n]+)",
    R"(\s+(?!\S))",
    R"(\s+)",
};

std::string oracle_pattern() {
  std::string p;
  for (const char* b : kBranches) {
    if (!p.empty()) p += '|';
    p += b;
  }
  std::string out;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == '\\' && i + 1 < p.size() && (p[i + 1] == 's' || p[i + 1] == 'S')) {
      out += p[i + 1] == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
      ++i;
    } else {
      out += p[i];
    }
  }
  return out;
}

class Oracle {
 public:
  Oracle() {
    const std::string pat = oracle_pattern();
    std::u16string u16 = to16(pat);
    UParseError pe;
    UErrorCode err = U_ZERO_ERROR;
    re_ = uregex_open(reinterpret_cast<const UChar*>(u16.data()), static_cast<int32_t>(u16.size()), 0, &pe, &err);
    ok_ = U_SUCCESS(err);
  }
  ~Oracle() { uregex_close(re_); }
  bool ok() const { return ok_; }

  std::vector<std::string> split(const std::string& utf8) {
    std::u16string u = to16(utf8);
    UErrorCode err = U_ZERO_ERROR;
    uregex_setText(re_, reinterpret_cast<const UChar*>(u.data()), static_cast<int32_t>(u.size()), &err);
    std::vector<std::string> out;
    int32_t last = 0;
    while (uregex_findNext(re_, &err)) {
      const int32_t s = uregex_start(re_, 0, &err), e = uregex_end(re_, 0, &err);
      if (s != last) out.push_back("<gap>" + to8(u.substr(last, s - last)));  // unmatched text
      out.push_back(to8(u.substr(s, e - s)));
      last = e;
    }
    if (last != static_cast<int32_t>(u.size())) out.push_back("<gap>" + to8(u.substr(last)));
    return out;
  }

  static std::u16string to16(const std::string& s) {
    std::u16string out(s.size() + 1, u'\0');
    int32_t len = 0;
    UErrorCode err = U_ZERO_ERROR;
    u_strFromUTF8(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()), &len, s.data(),
                  static_cast<int32_t>(s.size()), &err);
    out.resize(static_cast<size_t>(len));
    return out;
  }
  static std::string to8(const std::u16string& s) {
    std::string out(s.size() * 3 + 1, '\0');
    int32_t len = 0;
    UErrorCode err = U_ZERO_ERROR;
    u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &len, reinterpret_cast<const UChar*>(s.data()),
                static_cast<int32_t>(s.size()), &err);
    out.resize(static_cast<size_t>(len));
    return out;
  }

 private:
  URegularExpression* re_ = nullptr;
  bool ok_ = false;
};

std::vector<std::string> ours(const std::string& s) {
  std::vector<k3::tok::ByteRange> r;
  k3::tok::split_pieces(s, r);
  std::vector<std::string> out;
  for (auto x : r) out.push_back(s.substr(x.begin, x.end - x.begin));
  return out;
}

void append_cp(std::string& s, uint32_t cp) {
  char buf[4];
  int32_t n = 0;
  UBool err = false;
  U8_APPEND(reinterpret_cast<uint8_t*>(buf), n, 4, static_cast<UChar32>(cp), err);
  if (!err) s.append(buf, static_cast<size_t>(n));
}

}  // namespace

TEST(PreTokenizerOracle, PatternCompilesInIcu) {
  Oracle o;
  ASSERT_TRUE(o.ok()) << oracle_pattern();
  // sanity of the oracle itself on hand-checked cases
  EXPECT_EQ(o.split("Hello world"), (std::vector<std::string>{"Hello", " world"}));
  EXPECT_EQ(o.split("中文English混合"), (std::vector<std::string>{"中文", "English", "混合"}));
  EXPECT_EQ(o.split("1234567"), (std::vector<std::string>{"123", "456", "7"}));
  EXPECT_EQ(o.split("a   b"), (std::vector<std::string>{"a", "  ", " b"}));
}

TEST(PreTokenizerOracle, HandPickedCasesAgree) {
  Oracle o;
  ASSERT_TRUE(o.ok());
  const std::vector<std::string> cases = {"Hello, world! It's DON'T we'RE they'll I'M",
                                          "中文English混合",
                                          "x = f(a,b);\n\n\treturn 42;\r\n",
                                          "   leading and trailing   ",
                                          "\n\n\n",
                                          " \n \n x",
                                          "ǅemal ǅ Ǆ",
                                          "ʰʰa",
                                          "e\u0301te\u0301",
                                          "\u0301\u0301",
                                          "中、文々〇ー",
                                          "١٢٣٤ ½Ⅻ",
                                          "🙂🙂 hi🙂",
                                          "a\u00a0b\u3000c",
                                          "tab\tand\vvtab\x0b\x0bz",
                                          "x\x1c\x1cy",
                                          "ſ's 'S 'Re 'LL'd",
                                          "'s",
                                          "$$$\n\nfoo",
                                          " !!\r\n",
                                          "ΑΒΓαβγ Привет мир",
                                          "한국어 日本語です カタカナ",
                                          std::string("nul\0byte", 8),
                                          "\x7f\x01",
                                          "\xc2\x85\xc2\x85x"};
  for (const auto& c : cases) EXPECT_EQ(ours(c), o.split(c)) << c;
}

TEST(PreTokenizerOracle, RandomStringsAgree) {
  Oracle o;
  ASSERT_TRUE(o.ok());
  std::mt19937 rng(12345);
  const std::vector<uint32_t> picks = {
      'a',    'Z',     'q',    '0',    '7',    ' ',    ' ',    '\t',   '\n',   '\r',   0x0B,    0x0C,    '\'',   's',
      'T',    'l',     'e',    'R',    '.',    ',',    '!',    '-',    0x4E2D, 0x6587, 0x3005,  0x3007,  0x3001, 0x30FC,
      0x30AB, 0xD55C,  0x01C5, 0x02B0, 0x0301, 0x0308, 0x017F, 0x0663, 0x216B, 0xBD,   0xA0,    0x3000,  0x85,   0x2028,
      0x1C,   0x1F642, 0x200D, 0xFE0F, 0xDF,   0x130,  0x3A9,  0xE9,   0x200B, 0xFEFF, 0x1D518, 0x20000, 0x0,    0x7F};
  size_t checked = 0;
  for (int iter = 0; iter < 40000; ++iter) {
    std::string s;
    const int len = static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) {
      uint32_t cp;
      if (rng() % 4 == 0) {  // any scalar value, all planes
        do {
          cp = rng() % 0x110000;
        } while (cp >= 0xD800 && cp <= 0xDFFF);
      } else {
        cp = picks[rng() % picks.size()];
      }
      append_cp(s, cp);
    }
    auto a = ours(s), b = o.split(s);
    if (a != b) {
      ADD_FAILURE() << "split differs for a random string of " << s.size() << " bytes: " << s;
      if (++checked > 10) break;
    }
  }
  EXPECT_EQ(checked, 0u);
}

TEST(PreTokenizerOracle, EveryCodePointInContextAgrees) {
  Oracle o;
  ASSERT_TRUE(o.ok());
  // Each scalar value between letters, after a space and doubled: covers every table entry.
  size_t bad = 0;
  for (uint32_t cp = 0; cp < 0x110000; cp += (cp < 0x30000 ? 1 : 97)) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s = "a";
    append_cp(s, cp);
    s += "B ";
    append_cp(s, cp);
    append_cp(s, cp);
    s += "1";
    if (ours(s) != o.split(s) && ++bad <= 5) ADD_FAILURE() << "code point U+" << std::hex << cp;
  }
  EXPECT_EQ(bad, 0u);
}
