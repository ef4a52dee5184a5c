// `k3 eval` driven as a user would, on the tiny-chat checkpoint (tiny K3 + test tokenizer). The
// perplexity is checked against an independent computation: the test re-derives the window
// schedule of docs/eval.md in its own terms, gets each window's logits from `k3 logits --ids`
// and sums the log-softmax NLL of the tokens each window owns.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;
using k3test::run_shell;

namespace {

const std::string kModelDir = (fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny-chat").string();
std::string model() { return quote(kModelDir); }
fs::path tmp(const std::string& name) {
  return fs::temp_directory_path() / ("k3eval_" + std::to_string(::getpid()) + "_" + name);
}
size_t count_lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }
constexpr int32_t kBos = 2256;  // tiny-chat config.json bos_token_id

// A few hundred tokens of plain text (deterministic).
const fs::path& text_file() {
  static const fs::path p = [] {
    const fs::path f = tmp("text.txt");
    const char* words[] = {"the",   "river",    "runs",   "past", "old",    "stone",   "houses,",
                           "where", "children", "play;",  "and",  "the",    "wind",    "carries",
                           "songs", "over",     "fields", "of",   "wheat.", "Ünïcödé", "naïve"};
    std::ofstream out(f, std::ios::binary);
    uint32_t x = 12345;
    for (int i = 0; i < 500; ++i) {
      x = x * 1103515245u + 12345u;
      out << (i ? " " : "") << words[(x >> 16) % (sizeof words / sizeof *words)];
    }
    out << "\n";
    std::atexit([] {
      std::error_code ec;
      fs::remove(tmp("text.txt"), ec);
    });
    return f;
  }();
  return p;
}

std::vector<int32_t> tokenize_file(const fs::path& f) {
  const auto r = run_k3("tokenize --vocab " + model() + " --file " + quote(f.string()));
  EXPECT_EQ(r.code, 0) << r.err;
  std::istringstream in(r.out);
  std::vector<int32_t> ids;
  for (int64_t v; in >> v;) ids.push_back(int32_t(v));
  return ids;
}

std::string join(const std::vector<int32_t>& v, size_t from, size_t to, const char* sep) {
  std::string s;
  for (size_t i = from; i < to; ++i) s += (i > from ? sep : "") + std::to_string(v[i]);
  return s;
}

// Logits [T, vocab] of one fresh prefill over ids, from `k3 logits` (one thread: fast when the
// machine is busy; the result does not depend on it beyond rounding).
std::vector<float> window_logits(const std::vector<int32_t>& ids, int64_t start, int64_t len, int64_t* vocab) {
  const fs::path out = tmp("logits.bin");
  const auto r = run_shell("OMP_NUM_THREADS=1 " + std::string(K3_BIN) + " logits -m " + model() + " --ids " +
                           join(ids, size_t(start), size_t(start + len), ",") + " -o " + out.string());
  EXPECT_EQ(r.code, 0) << r.err;
  const std::string bytes = k3test::slurp(out);
  fs::remove(out);
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  *vocab = int64_t(v.size()) / len;
  EXPECT_EQ(int64_t(v.size()), *vocab * len);
  return v;
}

double log_softmax_nll(const float* row, int64_t vocab, int32_t target) {
  double m = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, double(row[i]));
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(double(row[i]) - m);
  return -(double(row[target]) - m - std::log(s));
}

struct Expected {
  double nll = 0;
  int64_t scored = 0, windows = 0;
};

// The protocol in the test's own terms: C = min(ctx, N-1) tokens fed per window; window starts are
// {0, S, 2S, ... below N-1-C} plus N-1-C (the window whose last prediction is the last token).
// Window at s predicts tokens s+1..s+C; each token 1..N-1 is owned by the first window that
// predicts it.
Expected expected_nll(const std::vector<int32_t>& ids, int64_t ctx, int64_t stride) {
  const int64_t N = int64_t(ids.size());
  const int64_t C = std::min(ctx, N - 1), S = std::min(stride, C);
  std::set<int64_t> starts;
  for (int64_t s = 0; s + C < N - 1; s += S) starts.insert(s);
  starts.insert(N - 1 - C);
  std::vector<int64_t> owner(size_t(N), -1);
  for (int64_t t = 1; t < N; ++t)
    for (int64_t s : starts)
      if (s < t && t <= s + C) {
        owner[size_t(t)] = s;
        break;
      }
  Expected e;
  e.windows = int64_t(starts.size());
  for (int64_t s : starts) {
    int64_t V = 0;
    const std::vector<float> lg = window_logits(ids, s, C, &V);
    for (int64_t t = s + 1; t <= s + C; ++t) {
      if (owner[size_t(t)] != s) continue;
      if (s > 0) {
        EXPECT_GE(t - s, C - S + 1) << "token " << t << " has too little context in the window at " << s;
      }
      e.nll += log_softmax_nll(lg.data() + (t - 1 - s) * V, V, ids[size_t(t)]);
      ++e.scored;
    }
  }
  for (int64_t t = 1; t < N; ++t) EXPECT_GE(owner[size_t(t)], 0) << "token " << t << " is never predicted";
  return e;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

// Runs `k3 eval ARGS --json J -t 1` and returns the JSON (and the result through *r).
nlohmann::json eval_json(const std::string& args, k3test::CmdResult* r = nullptr) {
  const fs::path j = tmp("out.json");
  fs::remove(j);
  // Exact numerics: compared with `k3 logits` (a reference tool, always exact) to 1e-6.
  const auto res = run_k3("eval -m " + model() + " --numerics exact -t 1 " + args + " --json " + j.string());
  EXPECT_EQ(res.code, 0) << args << "\n" << res.err;
  if (r) *r = res;
  if (!fs::exists(j)) return {};
  auto js = read_json(j);
  fs::remove(j);
  return js;
}

void expect_rel(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), tol * std::fabs(want)) << what << ": got " << got << ", want " << want;
}

// Exit 2 and exactly one line on stderr that contains `needle`.
void expect_one_line_error(const std::string& args, const std::string& needle) {
  const auto r = run_k3(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(count_lines(r.err), 1u) << args << "\n" << r.err;
  EXPECT_NE(r.err.find("k3 eval: error: "), std::string::npos) << args << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
  EXPECT_EQ(r.out, "") << args;
}

}  // namespace

TEST(Eval, NllEqualsIndependentComputationForSeveralStrides) {
  const std::vector<int32_t> all = tokenize_file(text_file());
  ASSERT_GE(all.size(), 100u);
  const std::vector<int32_t> ids(all.begin(), all.begin() + 60);
  // stride = ctx (disjoint windows), ctx/2, an odd stride, stride 1; 60 tokens never fit exactly,
  // so the last window is always the aligned one.
  for (int64_t stride : {16, 8, 5, 1}) {
    SCOPED_TRACE("stride " + std::to_string(stride));
    const auto js =
        eval_json("-f " + quote(text_file().string()) + " --max-tokens 60 --ctx 16 --stride " + std::to_string(stride));
    ASSERT_FALSE(js.is_null());
    const Expected e = expected_nll(ids, 16, stride);
    EXPECT_EQ(js["tokens"].get<int64_t>(), 60);
    EXPECT_EQ(js["tokens_scored"].get<int64_t>(), 59);  // every token but the first, once
    EXPECT_EQ(e.scored, 59);
    EXPECT_EQ(js["ctx"].get<int64_t>(), 16);
    EXPECT_EQ(js["stride"].get<int64_t>(), stride);
    EXPECT_EQ(js["windows"].get<int64_t>(), e.windows);
    EXPECT_FALSE(js["interrupted"].get<bool>());
    expect_rel(js["nll_sum"].get<double>(), e.nll, 1e-6, "nll_sum");
    expect_rel(js["nll_mean"].get<double>(), e.nll / 59, 1e-6, "nll_mean");
    expect_rel(js["perplexity"].get<double>(), std::exp(e.nll / 59), 1e-5, "perplexity");
  }
}

TEST(Eval, DefaultWindowIsTheWholeShortTextAndBitsPerByte) {
  const std::vector<int32_t> all = tokenize_file(text_file());
  const std::vector<int32_t> ids(all.begin(), all.begin() + 40);
  k3test::CmdResult r;
  const auto js = eval_json("-f " + quote(text_file().string()) + " --max-tokens 40", &r);
  ASSERT_FALSE(js.is_null());
  EXPECT_EQ(js["ctx"].get<int64_t>(), 39);  // default 512, capped to N-1
  EXPECT_EQ(js["windows"].get<int64_t>(), 1);
  const Expected e = expected_nll(ids, 512, 256);
  expect_rel(js["nll_sum"].get<double>(), e.nll, 1e-6, "nll_sum");
  // bits/byte: NLL in bits over the bytes of the scored tokens, decoded.
  const auto det = run_k3("detokenize --vocab " + model() + " --ids " + quote(join(ids, 1, ids.size(), " ")));
  ASSERT_EQ(det.code, 0) << det.err;
  const int64_t bytes = int64_t(det.out.size()) - 1;  // detokenize ends with a newline
  EXPECT_EQ(js["bytes_scored"].get<int64_t>(), bytes);
  expect_rel(js["bits_per_byte"].get<double>(), e.nll / std::log(2.0) / double(bytes), 1e-6, "bits_per_byte");
  for (const char* k : {"model", "file", "tokens_scored", "ctx", "stride", "nll_sum", "nll_mean", "perplexity",
                        "bits_per_byte", "seconds", "windows"})
    EXPECT_TRUE(js.contains(k)) << k;
  EXPECT_EQ(js["file"].get<std::string>(), text_file().string());
  // The stdout line: one line, the documented shape, numbers matching the JSON.
  const std::regex line(
      R"(perplexity ([0-9.]+) over 39 tokens \(ctx 39, stride 39\) \| nll/token ([0-9.]+) \| bits/byte ([0-9.]+) \| [0-9.]+ tok/s\n)");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(r.out, m, line)) << r.out;
  EXPECT_NEAR(std::stod(m[1]), js["perplexity"].get<double>(), 1e-4 * js["perplexity"].get<double>());
  EXPECT_NEAR(std::stod(m[2]), js["nll_mean"].get<double>(), 1e-4);
  EXPECT_NEAR(std::stod(m[3]), js["bits_per_byte"].get<double>(), 1e-3);
}

TEST(Eval, ThousandsSeparatorAndFullText) {
  k3test::CmdResult r;
  const auto js = eval_json("-q -f " + quote(text_file().string()) + " --ctx 256", &r);
  ASSERT_FALSE(js.is_null());
  const int64_t n = int64_t(tokenize_file(text_file()).size());
  ASSERT_GT(n, 1000);  // so that the count is grouped
  EXPECT_EQ(js["tokens_scored"].get<int64_t>(), n - 1);
  EXPECT_EQ(js["stride"].get<int64_t>(), 128);  // default ctx/2
  std::string grouped = std::to_string(n - 1);
  for (int i = int(grouped.size()) - 3; i > 0; i -= 3) grouped.insert(size_t(i), ",");
  EXPECT_NE(r.out.find("over " + grouped + " tokens (ctx 256, stride 128)"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");  // -q
}

TEST(Eval, BosIsPrependedAndNeverScored) {
  const std::vector<int32_t> all = tokenize_file(text_file());
  std::vector<int32_t> ids{kBos};
  ids.insert(ids.end(), all.begin(), all.begin() + 39);  // --max-tokens counts the BOS
  const auto js = eval_json("-f " + quote(text_file().string()) + " --bos --max-tokens 40 --ctx 16 --stride 8");
  ASSERT_FALSE(js.is_null());
  EXPECT_TRUE(js["bos"].get<bool>());
  EXPECT_EQ(js["tokens_scored"].get<int64_t>(), 39);
  const Expected e = expected_nll(ids, 16, 8);
  expect_rel(js["nll_sum"].get<double>(), e.nll, 1e-6, "nll_sum with BOS");
  const auto plain = eval_json("-f " + quote(text_file().string()) + " --max-tokens 40 --ctx 16 --stride 8");
  EXPECT_NE(plain["nll_sum"].get<double>(), js["nll_sum"].get<double>());
}

TEST(Eval, MaxTokensAndStdinAndUbatchPieces) {
  const std::string f = quote(text_file().string());
  const auto a = eval_json("-f " + f + " --max-tokens 50 --ctx 16 --stride 8");
  const auto b = eval_json("-f - --max-tokens 50 --ctx 16 --stride 8 < " + f);
  const auto c = eval_json("--file " + f + " --max-tokens 50 --ctx 16 --stride 8 --ubatch 5");
  ASSERT_FALSE(a.is_null());
  ASSERT_FALSE(b.is_null());
  ASSERT_FALSE(c.is_null());
  EXPECT_EQ(a["tokens_scored"].get<int64_t>(), 49);
  EXPECT_EQ(a["nll_sum"].get<double>(), b["nll_sum"].get<double>());  // stdin reads the same text
  EXPECT_EQ(b["file"].get<std::string>(), "-");
  // Prefill in pieces of 5 (only the rounding of the chunked KDA differs).
  expect_rel(c["nll_sum"].get<double>(), a["nll_sum"].get<double>(), 1e-5, "ubatch 5");
  const std::vector<int32_t> all = tokenize_file(text_file());
  const Expected e = expected_nll(std::vector<int32_t>(all.begin(), all.begin() + 50), 16, 8);
  expect_rel(a["nll_sum"].get<double>(), e.nll, 1e-6, "nll_sum over 50 tokens");
}

TEST(Eval, ProgressAndHeaderOnStderr) {
  // stderr is a file here: the header and a few plain progress lines, no carriage returns.
  const auto r =
      run_k3("eval -m " + model() + " -t 1 -f " + quote(text_file().string()) + " --max-tokens 60 --ctx 16 --stride 8");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("k3 eval: loaded "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("7 window(s) of 16 tokens at stride 8"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("fresh session"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("k3 eval: 100% 7/7 windows | 59 tokens scored | ppl "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tok/s"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\r'), std::string::npos);
  EXPECT_LE(count_lines(r.err), 10u) << r.err;
  EXPECT_EQ(count_lines(r.out), 1u) << r.out;
  const auto q =
      run_k3("eval -m " + model() + " -t 1 -q -f " + quote(text_file().string()) + " --max-tokens 60 --ctx 16");
  ASSERT_EQ(q.code, 0) << q.err;
  EXPECT_EQ(q.err, "");
}

TEST(Eval, CtrlCPrintsThePartialResult) {
  // Stride 1 over ~1,000 tokens: hundreds of windows, far longer than the 3 s before SIGINT.
  const fs::path j = tmp("intr.json");
  fs::remove(j);
  const auto r =
      run_shell("timeout --foreground --preserve-status -s INT 3 " + std::string(K3_BIN) + " eval -m " + model() +
                " -t 1 -q -f " + quote(text_file().string()) + " --ctx 128 --stride 1 --json " + j.string());
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_NE(r.out.find("perplexity "), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.out.find("| interrupted after "), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(j));
  const auto js = read_json(j);
  EXPECT_TRUE(js["interrupted"].get<bool>());
  const int64_t w = js["windows"].get<int64_t>();
  EXPECT_GE(w, 1);
  EXPECT_LT(w, js["windows_total"].get<int64_t>());
  EXPECT_EQ(js["tokens_scored"].get<int64_t>(), 128 + (w - 1));  // the first window scores 128, each later one 1
  fs::remove(j);
}

TEST(Eval, BadInputIsOneLineAndExit2) {
  const std::string m = "eval -m " + model() + " -q ";
  const std::string f = " -f " + quote(text_file().string());
  const fs::path empty = tmp("empty.txt"), one = tmp("one.txt");
  std::ofstream(empty).flush();
  std::ofstream(one) << "a";
  expect_one_line_error(m + "-f /nonexistent/text.txt", "/nonexistent/text.txt");
  expect_one_line_error(m + "-f " + fs::temp_directory_path().string(), "directory");
  expect_one_line_error(m + "-f " + empty.string(), "empty");
  expect_one_line_error(m + "-f - < " + empty.string(), "empty");
  expect_one_line_error(m + "-f " + one.string(), "at least 2");
  expect_one_line_error(m + f + " --max-tokens 1", "--max-tokens");
  expect_one_line_error(m, "--file");
  expect_one_line_error(m + f + " --ctx 1", "--ctx");
  expect_one_line_error(m + f + " --ctx 0", "--ctx");
  expect_one_line_error(m + f + " --ctx 16 --stride 0", "--stride");
  expect_one_line_error(m + f + " --ctx 16 --stride -3", "--stride");
  expect_one_line_error(m + f + " --ctx 16 --stride 17", "--stride");
  expect_one_line_error(m + f + " --stride 600", "--stride");  // over the default window of 512
  expect_one_line_error(m + f + " --ctx 5000", "max_position_embeddings");
  expect_one_line_error(m + f + " --ctx abc", "--ctx");
  expect_one_line_error(m + f + " --bogus", "bogus");
  expect_one_line_error(m + f + " --kda fast", "--kda");
  expect_one_line_error(m + f + " --mem-limit 1K", "--mem-limit");
  expect_one_line_error(m + f + " --json /nonexistent/dir/out.json", "--json");
  expect_one_line_error("eval -m /nonexistent/model" + f, "/nonexistent/model");
  expect_one_line_error("eval -q -m " + quote((fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny").string()) + f,
                        "tiktoken.model");
  fs::remove(empty);
  fs::remove(one);
}

TEST(Eval, Help) {
  const auto r = run_k3("eval --help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* flag : {"--file", "--ctx", "--stride", "--max-tokens", "--bos", "--json", "--ubatch", "--mem-limit"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  const auto top = run_k3("--help");
  EXPECT_NE(top.out.find("eval"), std::string::npos) << top.out;
}
