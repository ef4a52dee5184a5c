// Checks the hand-written Kimi pre-tokenizer against a general backtracking regex engine (std::wregex,
// ECMAScript: leftmost-first alternation, greedy quantifiers, look-ahead) running the §4 pattern with
// the reference's character classes. std::regex has no \p{...}, so every code point is replaced by a
// symbol standing for its membership in the pattern's classes as tiktoken's regex engine reads them
// (tests/tokenizer/data/unicode_classes.txt, written by tools/tokenizer/unicode_reference.py), and each
// class becomes a bracket of the symbols in it; the characters the pattern names literally (space,
// apostrophe, CR, LF and the case-folded contraction letters) stay themselves. Nothing here uses the
// tokenizer's own property table, so a wrong table entry or a wrong branch both show up.
#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tok_test_util.h"

namespace {

const std::string kClasses = std::string(K3_SOURCE_DIR) + "/tests/tokenizer/data/unicode_classes.txt";

// the classes of the pattern, as named in unicode_classes.txt (bit i of a code point's membership)
const char* kClassNames[] = {
    "han", "letter", "number", "upper", "lower", "not_letter_number_crlf", "not_space_letter_number", "space", "crlf"};
enum { kHan, kLetter, kNumber, kUpper, kLower, kNotLNCrLf, kNotSLN, kSpace, kCrLf, kNClasses };
const char* kFolds[] = {"fold_s", "fold_t", "fold_r", "fold_e", "fold_v", "fold_m", "fold_l", "fold_d"};

class Oracle {
 public:
  Oracle() {
    const auto classes = k3test::read_unicode_classes(kClasses);
    for (const char* n : kClassNames)
      if (!classes.count(n)) return;
    for (const char* n : kFolds)
      if (!classes.count(n)) return;
    member_.assign(0x110000, 0);
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      for (int k = 0; k < kNClasses; ++k)
        if (classes.at(kClassNames[k])[cp]) member_[cp] |= static_cast<uint16_t>(1u << k);
    }
    std::set<uint32_t> literal = {' ', '\'', '\r', '\n'};
    for (const char* n : kFolds) {
      for (uint32_t cp = 0; cp < 0x110000; ++cp)
        if (classes.at(n)[cp]) literal.insert(cp);
    }
    literal_.assign(0x110000, false);
    for (uint32_t cp : literal) literal_[cp] = true;
    std::set<uint16_t> combos(member_.begin(), member_.end());
    // bracket of class k (or, when `without`, of the code points outside it)
    auto bracket = [&](int k, bool without = false) {
      std::wstring b = L"[";
      for (uint32_t cp : literal)
        if (((member_[cp] >> k) & 1) != without) b += static_cast<wchar_t>(cp);
      for (uint16_t c : combos)
        if (((c >> k) & 1) != without) b += static_cast<wchar_t>(kSymbolBase + c);
      return b + L"]";
    };
    auto fold = [&](int i) {
      std::wstring b = L"[";
      for (uint32_t cp = 0; cp < 0x110000; ++cp)
        if (classes.at(kFolds[i])[cp]) b += static_cast<wchar_t>(cp);
      return b + L"]";
    };
    const std::wstring contraction = L"(?:'" + fold(0) + L"|'" + fold(1) + L"|'" + fold(2) + fold(3) + L"|'" + fold(4) +
                                     fold(3) + L"|'" + fold(5) + L"|'" + fold(6) + fold(6) + L"|'" + fold(7) + L")?";
    const std::wstring p = bracket(kNotLNCrLf) + L"?";
    // spec k3-architecture.md §4, alternatives joined by '|'
    const std::wstring branches[] = {
        bracket(kHan) + L"+",
        p + bracket(kUpper) + L"*" + bracket(kLower) + L"+" + contraction,
        p + bracket(kUpper) + L"+" + bracket(kLower) + L"*" + contraction,
        bracket(kNumber) + L"{1,3}",
        L" ?" + bracket(kNotSLN) + L"+" + bracket(kCrLf) + L"*",
        bracket(kSpace) + L"*" + bracket(kCrLf) + L"+",
        bracket(kSpace) + L"+(?!" + bracket(kSpace, true) + L")",
        bracket(kSpace) + L"+",
    };
    std::wstring pat;
    for (const auto& b : branches) pat += (pat.empty() ? L"" : L"|") + b;
    re_.assign(pat, std::regex_constants::ECMAScript);
    ok_ = true;
  }
  bool ok() const { return ok_; }

  // pieces of valid UTF-8 text; text between matches is reported as "<gap>..." (never expected)
  std::vector<std::string> split(const std::string& utf8) const {
    std::vector<uint32_t> cps;
    std::vector<size_t> off;
    if (!k3test::decode_utf8(utf8, &cps, &off)) return {"<invalid UTF-8>"};
    std::wstring sym;
    for (uint32_t cp : cps) sym += static_cast<wchar_t>(literal_[cp] ? cp : kSymbolBase + member_[cp]);
    std::vector<std::string> out;
    size_t last = 0;
    auto it = sym.cbegin();
    std::wsmatch m;
    while (it != sym.cend()) {
      const auto flags =
          it == sym.cbegin() ? std::regex_constants::match_default : std::regex_constants::match_prev_avail;
      if (!std::regex_search(it, sym.cend(), m, re_, flags)) break;
      const size_t s = static_cast<size_t>(m[0].first - sym.cbegin()),
                   e = static_cast<size_t>(m[0].second - sym.cbegin());
      if (s != last) out.push_back("<gap>" + utf8.substr(off[last], off[s] - off[last]));
      out.push_back(utf8.substr(off[s], off[e] - off[s]));
      last = e;
      it = m[0].second;
    }
    if (last != cps.size()) out.push_back("<gap>" + utf8.substr(off[last]));
    return out;
  }

 private:
  static constexpr uint32_t kSymbolBase = 0x200000;  // outside the code point range
  std::vector<uint16_t> member_;
  std::vector<bool> literal_;
  std::wregex re_;
  bool ok_ = false;
};

const Oracle& oracle() {
  static const Oracle o;
  return o;
}

std::vector<std::string> ours(const std::string& s) {
  std::vector<k3::tok::ByteRange> r;
  k3::tok::split_pieces(s, r);
  std::vector<std::string> out;
  for (auto x : r) out.push_back(s.substr(x.begin, x.end - x.begin));
  return out;
}

}  // namespace

TEST(PreTokenizerOracle, PatternCompiles) {
  const Oracle& o = oracle();
  ASSERT_TRUE(o.ok()) << "cannot read " << kClasses;
  // sanity of the oracle itself on hand-checked cases
  EXPECT_EQ(o.split("Hello world"), (std::vector<std::string>{"Hello", " world"}));
  EXPECT_EQ(o.split("中文English混合"), (std::vector<std::string>{"中文", "English", "混合"}));
  EXPECT_EQ(o.split("1234567"), (std::vector<std::string>{"123", "456", "7"}));
  EXPECT_EQ(o.split("a   b"), (std::vector<std::string>{"a", "  ", " b"}));
  // Unicode 16.0 letters and digits, as the reference reads them (issue 17)
  EXPECT_EQ(o.split("a\u1c89's"), (std::vector<std::string>{"a", "\u1c89's"}));
  EXPECT_EQ(o.split("4\U00010D4056789"), (std::vector<std::string>{"4\U00010D405", "678", "9"}));
}

TEST(PreTokenizerOracle, HandPickedCasesAgree) {
  const Oracle& o = oracle();
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
                                          "\xc2\x85\xc2\x85x",
                                          "a\u1c89's \u1c89\u1c8a'S 4\U00010D4056789 \U0002EBF0\U0002EBF1x",
                                          "\ua7cb\ua7dc's \u0897\u0897 \U00010EFC1 \U00011DB0's \U000323B0\u4e2d"};
  for (const auto& c : cases) EXPECT_EQ(ours(c), o.split(c)) << c;
}

TEST(PreTokenizerOracle, RandomStringsAgree) {
  const Oracle& o = oracle();
  ASSERT_TRUE(o.ok());
  std::mt19937 rng(12345);
  const std::vector<uint32_t> picks = {
      'a',     'Z',     'q',     '0',     '7',     ' ',     ' ',    '\t',    '\n',   '\r',   0x0B,   0x0C,
      '\'',    's',     'T',     'l',     'e',     'R',     '.',    ',',     '!',    '-',    0x4E2D, 0x6587,
      0x3005,  0x3007,  0x3001,  0x30FC,  0x30AB,  0xD55C,  0x01C5, 0x02B0,  0x0301, 0x0308, 0x017F, 0x0663,
      0x216B,  0xBD,    0xA0,    0x3000,  0x85,    0x2028,  0x1C,   0x1F642, 0x200D, 0xFE0F, 0xDF,   0x130,
      0x3A9,   0xE9,    0x200B,  0xFEFF,  0x1D518, 0x20000, 0x0,    0x7F,    0x1C89, 0x1C8A, 0xA7CB, 0x0897,
      0x10D40, 0x10D4A, 0x2EBF0, 0x16D40, 0x1171E, 0x11DB0, 0x323B0};
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
      k3test::append_utf8(s, cp);
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
  const Oracle& o = oracle();
  ASSERT_TRUE(o.ok());
  // Each scalar value between letters, after a space and doubled, and in a digit group (every one
  // through CJK Extension J, U+3347F; every 97th past it, planes 4-16 being mostly unassigned).
  size_t bad = 0;
  for (uint32_t cp = 0; cp < 0x110000; cp += (cp < 0x34000 ? 1 : 97)) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s = "a";
    k3test::append_utf8(s, cp);
    s += "B ";
    k3test::append_utf8(s, cp);
    k3test::append_utf8(s, cp);
    s += "'s4";
    k3test::append_utf8(s, cp);
    s += "56";
    if (ours(s) != o.split(s) && ++bad <= 5) ADD_FAILURE() << "code point U+" << std::hex << cp;
  }
  EXPECT_EQ(bad, 0u);
}
