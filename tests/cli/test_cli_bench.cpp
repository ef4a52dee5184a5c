// The `k3 bench` contract on the tiny fixture: md rows per test, json/jsonl shape and statistics
// recomputed from the raw samples, --json-out, and one-line exit-2 errors for every bad input.
// Must not: assert on absolute speeds (only positive and finite).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

fs::path tiny() { return fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny"; }
std::string m() { return "-m " + quote(tiny().string()); }

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::vector<std::string> cells(const std::string& row) {  // "| a | b |" -> {"a", "b"}
  std::vector<std::string> out;
  size_t pos = row.find('|');
  while (pos != std::string::npos) {
    const size_t next = row.find('|', pos + 1);
    if (next == std::string::npos) break;
    std::string c = row.substr(pos + 1, next - pos - 1);
    c.erase(0, c.find_first_not_of(' '));
    c.erase(c.find_last_not_of(' ') + 1);
    out.push_back(c);
    pos = next;
  }
  return out;
}

void expect_bad(const k3test::CmdResult& r, const std::string& fragment) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("k3 bench: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << "stderr was: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "want exactly one line: " << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// avg/stddev of tokens/s recomputed from samples_ns (sample stddev, n - 1).
void check_stats(const nlohmann::json& res, int64_t n_tokens) {
  const auto ns = res["samples_ns"].get<std::vector<int64_t>>();
  std::vector<double> ts;
  for (int64_t v : ns) {
    EXPECT_GT(v, 0);
    ts.push_back(double(n_tokens) * 1e9 / double(v));
  }
  double mean = 0;
  for (double v : ts) mean += v;
  mean /= double(ts.size());
  double ss = 0;
  for (double v : ts) ss += (v - mean) * (v - mean);
  const double sd = ts.size() > 1 ? std::sqrt(ss / double(ts.size() - 1)) : 0.0;
  EXPECT_NEAR(res["avg_ts"].get<double>(), mean, 1e-9 * mean) << res.dump();
  EXPECT_NEAR(res["stddev_ts"].get<double>(), sd, 1e-9 * mean + 1e-12) << res.dump();
  EXPECT_TRUE(std::isfinite(mean) && mean > 0) << res.dump();
}

}  // namespace

TEST(CliBench, MarkdownRows) {
  const auto r = run_k3("bench " + m() + " -p 8 -n 4 -d 0,16 -r 2 -t 1 --no-progress --no-roofline");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  const auto ls = lines(r.out);
  ASSERT_GE(ls.size(), 7u) << r.out;
  EXPECT_EQ(ls[0].rfind("k3 ", 0), 0u) << ls[0];
  EXPECT_NE(ls[0].find("CPU: "), std::string::npos) << ls[0];
  EXPECT_NE(ls[0].find("KDA chunked"), std::string::npos) << ls[0];
  EXPECT_NE(ls[0].find("MLA auto"), std::string::npos) << ls[0];
  EXPECT_TRUE(ls[1].empty());
  EXPECT_EQ(cells(ls[2]), (std::vector<std::string>{"model", "size", "params", "threads", "test", "t/s"}));
  const std::vector<std::string> want = {"pp8", "tg4", "pp8 @ d16", "tg4 @ d16"};
  // The table, then a blank line and the depth context's prefill time.
  ASSERT_EQ(ls.size(), 4u + want.size() + 2) << r.out;
  EXPECT_TRUE(ls[4 + want.size()].empty());
  EXPECT_EQ(ls.back().rfind("depth 16: prefill of 16 tokens (--ubatch 512, not a timed test) took ", 0), 0u) << ls.back();
  for (size_t i = 0; i < want.size(); ++i) {
    const auto c = cells(ls[4 + i]);
    ASSERT_EQ(c.size(), 6u) << ls[4 + i];
    EXPECT_EQ(c[0], "tiny");
    EXPECT_NE(c[1].find("iB"), std::string::npos) << c[1];
    // "1", or "1 (0.93 used)" when other processes kept the core busy (the pool shrank its team).
    EXPECT_TRUE(c[3] == "1" || c[3].rfind("1 (", 0) == 0) << c[3];
    EXPECT_EQ(c[4], want[i]);
    const size_t pm = c[5].find(" ± ");
    ASSERT_NE(pm, std::string::npos) << c[5];
    const double ts = std::stod(c[5].substr(0, pm)), sd = std::stod(c[5].substr(pm + 4));
    EXPECT_TRUE(std::isfinite(ts) && ts > 0) << c[5];
    EXPECT_TRUE(std::isfinite(sd) && sd >= 0) << c[5];
  }
}

// Roofline: probes per thread count in the header and the JSON, a ratio column, and each ratio
// equal to t/s x work per token / roof (bytes for tg, weight FLOPs for pp): against the start
// probe, and per repetition against the larger of the probes taken just before and after it.
TEST(CliBench, RooflineColumnAndJson) {
  const auto md = run_k3("bench " + m() + " -p 8 -n 4 -r 1 -t 1 --no-progress --roofline-mib 32");
  ASSERT_EQ(md.code, 0) << md.err;
  const auto ls = lines(md.out);
  ASSERT_GE(ls.size(), 6u) << md.out;
  EXPECT_NE(ls[0].find("numerics fast"), std::string::npos) << ls[0];
  EXPECT_EQ(ls[1].rfind("roofline t=1: read ", 0), 0u) << ls[1];
  EXPECT_NE(ls[1].find("GFLOP/s"), std::string::npos) << ls[1];
  EXPECT_EQ(cells(ls[3]).back(), "roofline");
  EXPECT_NE(cells(ls[5]).back().find("% peak"), std::string::npos) << ls[5];
  EXPECT_NE(cells(ls[6]).back().find("% BW"), std::string::npos) << ls[6];

  const auto r = run_k3("bench " + m() +
                        " -p 8 -n 4 -d 0,16 -r 2 -t 1 -o json --no-progress --roofline-mib 32 "
                        "--numerics exact --cpu-isa scalar");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["settings"]["numerics"], "exact");
  EXPECT_EQ(doc["settings"]["cpu_isa"], "scalar");
  ASSERT_EQ(doc["roofline"].size(), 1u);
  const double bw = doc["roofline"][0]["read_gbs"], peak = doc["roofline"][0]["peak_gflops"];
  EXPECT_GT(bw, 0.1);
  EXPECT_GT(peak, 0.01);
  double tg_bytes_d0 = 0, tg_bytes_d16 = 0, pp_flops_1piece = 0;
  for (const auto& res : doc["results"]) {
    const auto& rl = res["roofline"];
    const bool pp = res["n_prompt"].get<int64_t>() > 0;
    const double work = pp ? rl["weight_flops_per_token"].get<double>() : rl["bytes_per_token"].get<double>();
    EXPECT_GT(work, 0) << res.dump();
    EXPECT_NEAR(rl["ratio_vs_start_probe"].get<double>(), res["avg_ts"].get<double>() * work / ((pp ? peak : bw) * 1e9),
                1e-9)
        << res.dump();
    EXPECT_EQ(rl[pp ? "start_peak_gflops" : "start_read_gbs"].get<double>(), pp ? peak : bw) << res.dump();
    // Two repetitions: three probes around them, one ratio each, the column their mean.
    const auto around = rl["probes_around_reps"].get<std::vector<double>>();
    const auto samples = res["samples_ns"].get<std::vector<int64_t>>();
    ASSERT_EQ(samples.size(), 2u);
    ASSERT_EQ(around.size(), 3u) << res.dump();
    double mean_ratio = 0, mean_roof = 0;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(around[i], 0);
      const double roof = std::max(around[i], around[i + 1]);
      const double ratio = double(res["n_prompt"].get<int64_t>() + res["n_gen"].get<int64_t>()) * 1e9 /
                           double(samples[i]) * work / (roof * 1e9);
      EXPECT_NEAR(rl["rep_ratios"][i].get<double>(), ratio, 1e-9 * ratio) << res.dump();
      mean_ratio += ratio / 2;
      mean_roof += roof / 2;
    }
    EXPECT_NEAR(rl["ratio"].get<double>(), mean_ratio, 1e-9 * mean_ratio) << res.dump();
    EXPECT_NEAR(rl[pp ? "peak_gflops" : "read_gbs"].get<double>(), mean_roof, 1e-9 * mean_roof) << res.dump();
    if (!pp) (res["n_depth"].get<int64_t>() == 0 ? tg_bytes_d0 : tg_bytes_d16) = work;
    // pp8 in one --ubatch piece: the lm_head runs for one of the 8 tokens.
    const double lm = rl["lm_head_flops_per_logit_row"].get<double>();
    EXPECT_GT(lm, 0) << res.dump();
    EXPECT_EQ(rl["logit_rows_per_run"].get<int64_t>(), pp ? 1 : 4) << res.dump();
    if (pp) pp_flops_1piece = work;
  }
  // A deeper context adds the MLA cache read: 16 tokens x (kv_lora + rope) fp32 per MLA layer
  // (tiny: kv_lora 32, rope 8, 4 MLA layers).
  EXPECT_EQ(tg_bytes_d16 - tg_bytes_d0, 16.0 * (32 + 8) * 4 * 4);

  // The same pp8 in --ubatch 2 pieces runs the lm_head 4 times: 3/8 of its FLOPs more per token
  // (tiny: vocab 512 x hidden 64, untied: 2 x 32768 FLOPs per logit row).
  const auto r2 = run_k3("bench " + m() + " -p 8 -n 0 -r 1 -t 1 -o json --no-progress --roofline-mib 32 --ubatch 2");
  ASSERT_EQ(r2.code, 0) << r2.err;
  const auto doc2 = nlohmann::json::parse(r2.out);
  const auto& rl2 = doc2["results"][0]["roofline"];
  EXPECT_EQ(rl2["logit_rows_per_run"].get<int64_t>(), 4);
  EXPECT_EQ(rl2["lm_head_flops_per_logit_row"].get<double>(), 2.0 * 512 * 64);
  EXPECT_NEAR(rl2["weight_flops_per_token"].get<double>() - pp_flops_1piece, 2.0 * 512 * 64 * 3 / 8, 1e-6);
}

TEST(CliBench, JsonDocumentAndJsonOut) {
  const fs::path file = fs::temp_directory_path() / ("k3bench_" + std::to_string(::getpid()) + ".json");
  const auto r =
      run_k3("bench " + m() + " -p 8 -n 4 -d 0,16 -r 2 -t 1,2 -o json --no-progress --no-roofline --json-out " +
             quote(file.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(k3test::slurp(file), r.out) << "--json-out must hold the same document";
  fs::remove(file);
  ASSERT_TRUE(doc.contains("build"));
  EXPECT_FALSE(doc["build"]["version"].get<std::string>().empty());
  EXPECT_FALSE(doc["build"]["cpu"].get<std::string>().empty());
  // The one depth context built by prefill, with its wall time; the process's peak memory.
  ASSERT_EQ(doc["depth_prefills"].size(), 1u) << doc.dump();
  EXPECT_EQ(doc["depth_prefills"][0]["n_depth"], 16);
  EXPECT_EQ(doc["depth_prefills"][0]["tokens"], 16);
  EXPECT_GT(doc["depth_prefills"][0]["seconds"].get<double>(), 0.0);
  EXPECT_NEAR(doc["depth_prefills"][0]["ts"].get<double>() * doc["depth_prefills"][0]["seconds"].get<double>(), 16.0,
              1e-6);
  EXPECT_GT(doc["peak_rss_bytes"].get<uint64_t>(), uint64_t(1) << 20);
  const auto& res = doc["results"];
  ASSERT_EQ(res.size(), 8u);  // 2 depths x 2 thread counts x {pp8, tg4}
  size_t i = 0;
  for (int64_t d : {0, 16})
    for (int64_t t : {1, 2})
      for (bool pp : {true, false}) {
        const auto& x = res[i++];
        EXPECT_EQ(x["model"], "tiny");
        EXPECT_GT(x["model_bytes"].get<int64_t>(), 0);
        EXPECT_GT(x["n_params"].get<int64_t>(), x["n_active_params"].get<int64_t>());
        EXPECT_EQ(x["threads"].get<int64_t>(), t);
        EXPECT_EQ(x["n_depth"].get<int64_t>(), d);
        EXPECT_EQ(x["n_prompt"].get<int64_t>(), pp ? 8 : 0);
        EXPECT_EQ(x["n_gen"].get<int64_t>(), pp ? 0 : 4);
        EXPECT_EQ(x["test"], std::string(pp ? "pp8" : "tg4") + (d ? " @ d16" : ""));
        EXPECT_EQ(x["kda"], "chunked");
        EXPECT_EQ(x["mla"], "auto");
        ASSERT_EQ(x["samples_ns"].size(), 2u);
        check_stats(x, pp ? 8 : 4);
      }
}

TEST(CliBench, JsonlAndAlgorithms) {
  const fs::path file = fs::temp_directory_path() / ("k3bench_l_" + std::to_string(::getpid()) + ".json");
  const auto r = run_k3("bench " + m() +
                        " -p 5 -n 3 -d 7 -r 3 --kda recurrent --mla expanded --ubatch 2 -o jsonl "
                        "--no-progress --json-out " +
                        quote(file.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 2u) << r.out;
  const auto doc = nlohmann::json::parse(k3test::slurp(file));
  fs::remove(file);
  ASSERT_EQ(doc["results"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto x = nlohmann::json::parse(ls[i]);
    EXPECT_EQ(x["test"], i == 0 ? "pp5 @ d7" : "tg3 @ d7");
    EXPECT_EQ(x["kda"], "recurrent");
    EXPECT_EQ(x["mla"], "expanded");
    EXPECT_EQ(x["n_ubatch"], 2);
    ASSERT_EQ(x["samples_ns"].size(), 3u);
    check_stats(x, i == 0 ? 5 : 3);
    EXPECT_EQ(x["test"], doc["results"][i]["test"]);
  }
}

TEST(CliBench, ProgressOnStderrOnly) {
  const auto r = run_k3("bench " + m() + " -p 4 -n 0 -d 12 -r 1 --ubatch 5 -o jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("k3 bench: depth 12: prefill 10/12"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("k3 bench: depth 12: prefill 12/12"), std::string::npos) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 1u) << r.out;  // only the result
  EXPECT_EQ(nlohmann::json::parse(ls[0])["test"], "pp4 @ d12");
}

TEST(CliBench, DepthsInAnyOrder) {
  // 16 is built, 8 starts over, 16 again extends 8: rows keep the -d order.
  const auto r = run_k3("bench " + m() + " -p 4 -n 2 -d 16,8,16 -r 1 -o jsonl --no-progress --no-roofline");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 6u) << r.out;
  const std::vector<std::string> want = {"pp4 @ d16", "tg2 @ d16", "pp4 @ d8", "tg2 @ d8", "pp4 @ d16", "tg2 @ d16"};
  for (size_t i = 0; i < ls.size(); ++i) {
    const auto x = nlohmann::json::parse(ls[i]);
    EXPECT_EQ(x["test"], want[i]);
    EXPECT_EQ(x["n_depth"], i < 2 || i >= 4 ? 16 : 8);
    check_stats(x, i % 2 == 0 ? 4 : 2);
  }
}

// --depth-fill random: the depth context without a prefill (seeded values in the cache and state);
// the rows name it, decode runs from it, and depths in any order each get their own fill.
TEST(CliBench, DepthFillRandom) {
  const auto r =
      run_k3("bench " + m() + " -p 4 -n 2 -d 300,40 -r 1 --depth-fill random -o jsonl --no-progress --no-roofline");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 4u) << r.out;
  for (size_t i = 0; i < ls.size(); ++i) {
    const auto x = nlohmann::json::parse(ls[i]);
    EXPECT_EQ(x["n_depth"], i < 2 ? 300 : 40);
    EXPECT_EQ(x["depth_fill"], "random");
    check_stats(x, i % 2 == 0 ? 4 : 2);
  }
  const auto p = run_k3("bench " + m() + " -p 0 -n 2 -d 16 -r 1 -o json --no-progress --no-roofline");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(nlohmann::json::parse(p.out)["results"][0]["depth_fill"], "prefill") << p.out;
}

// -b: one row per batch size, batch 1 first; t/s is the aggregate (N x per-sequence), compared
// with the batch-1 row of the same test. Without a batch other than 1 nothing of it shows.
TEST(CliBench, BatchRowsMarkdown) {
  const auto r = run_k3("bench " + m() + " -p 8 -n 4 -b 3,1 -r 2 -t 1 --no-progress --no-roofline");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 8u) << r.out;
  EXPECT_EQ(cells(ls[2]), (std::vector<std::string>{"model", "size", "params", "threads", "n_batch", "test", "t/s",
                                                    "t/s per seq", "vs n_batch=1"}));
  auto num = [](const std::string& c, size_t* sd_pos = nullptr) {
    const size_t pm = c.find(" ± ");
    if (sd_pos) *sd_pos = pm;
    return std::stod(c.substr(0, pm));
  };
  const std::vector<std::pair<std::string, int64_t>> want = {{"pp8", 1}, {"pp8", 3}, {"tg4", 1}, {"tg4", 3}};
  double agg1 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const auto c = cells(ls[4 + i]);
    ASSERT_EQ(c.size(), 9u) << ls[4 + i];
    EXPECT_EQ(c[4], std::to_string(want[i].second)) << ls[4 + i];
    EXPECT_EQ(c[5], want[i].first) << ls[4 + i];
    size_t pm = 0;
    const double agg = num(c[6], &pm), per = num(c[7]);
    ASSERT_NE(pm, std::string::npos) << c[6];
    EXPECT_TRUE(std::isfinite(agg) && agg > 0) << c[6];
    // Both printed with two decimals.
    EXPECT_NEAR(agg, double(want[i].second) * per, 0.005 * double(want[i].second) + 0.006) << ls[4 + i];
    if (want[i].second == 1) {
      agg1 = agg;
      EXPECT_EQ(c[7], c[6]);
      EXPECT_EQ(c[8], "1.00x");
    } else {
      ASSERT_EQ(c[8].back(), 'x') << c[8];
      EXPECT_NEAR(std::stod(c[8]), agg / agg1, 0.006 + 0.01 * agg / agg1) << ls[4 + i];
    }
  }

  // No batch-1 row to compare with: '-'.
  const auto r2 = run_k3("bench " + m() + " -p 0 -n 2 -b 2 -r 1 -t 1 --no-progress --no-roofline");
  ASSERT_EQ(r2.code, 0) << r2.err;
  const auto ls2 = lines(r2.out);
  ASSERT_EQ(ls2.size(), 5u) << r2.out;
  const auto c2 = cells(ls2[4]);
  ASSERT_EQ(c2.size(), 9u) << ls2[4];
  EXPECT_EQ(c2[4], "2");
  EXPECT_EQ(c2[8], "-");

  // -b 1 alone: the table and the json of before.
  const auto r3 = run_k3("bench " + m() + " -p 4 -n 2 -b 1 -r 1 -t 1 --no-progress --no-roofline");
  ASSERT_EQ(r3.code, 0) << r3.err;
  EXPECT_EQ(cells(lines(r3.out)[2]), (std::vector<std::string>{"model", "size", "params", "threads", "test", "t/s"}));
  const auto r4 = run_k3("bench " + m() + " -p 4 -n 2 --batch 1 -r 1 -t 1 -o json --no-progress --roofline-mib 32");
  ASSERT_EQ(r4.code, 0) << r4.err;
  const auto doc4 = nlohmann::json::parse(r4.out);
  EXPECT_FALSE(doc4["settings"].contains("n_batch"));
  for (const auto& x : doc4["results"]) {
    EXPECT_FALSE(x.contains("n_batch")) << x.dump();
    EXPECT_FALSE(x.contains("per_seq_ts")) << x.dump();
    EXPECT_FALSE(x["roofline"].contains("bytes_per_step")) << x.dump();
  }
}

// json with -b: n_batch, aggregate statistics over N x n tokens, per_seq_ts = avg_ts / N, the
// ratio to batch 1, and the batched decode traffic (tiny: 8 experts, top-3).
TEST(CliBench, BatchJsonAndTraffic) {
  const auto r = run_k3("bench " + m() + " -p 8 -n 4 -d 0,16 -b 1,3 -r 2 -t 1 -o json --no-progress --roofline-mib 32");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["settings"]["n_batch"], (std::vector<int64_t>{1, 3}));
  const auto& res = doc["results"];
  ASSERT_EQ(res.size(), 8u);  // 2 depths x {pp8, tg4} x {1, 3}
  const double bw = doc["roofline"][0]["read_gbs"];
  size_t i = 0;
  for (int64_t d : {0, 16}) {
    const nlohmann::json* one = nullptr;
    for (bool pp : {true, false})
      for (int64_t b : {1, 3}) {
        const auto& x = res[i++];
        EXPECT_EQ(x["n_batch"].get<int64_t>(), b) << x.dump();
        EXPECT_EQ(x["n_depth"].get<int64_t>(), d);
        EXPECT_EQ(x["test"], std::string(pp ? "pp8" : "tg4") + (d ? " @ d16" : ""));
        check_stats(x, b * (pp ? 8 : 4));
        const double avg = x["avg_ts"];
        EXPECT_NEAR(x["per_seq_ts"].get<double>(), avg / double(b), 1e-12 * avg);
        EXPECT_NEAR(x["per_seq_stddev_ts"].get<double>(), x["stddev_ts"].get<double>() / double(b), 1e-12 * avg);
        if (b == 1) one = &x;
        ASSERT_NE(one, nullptr);
        EXPECT_NEAR(x["aggregate_vs_batch1"].get<double>(), avg / (*one)["avg_ts"].get<double>(), 1e-12 * avg);
        const auto& rl = x["roofline"];
        EXPECT_EQ(rl["logit_rows_per_run"].get<int64_t>(), b * (pp ? 1 : 4)) << x.dump();
        if (pp) {  // the same weight FLOPs per token whatever the batch
          EXPECT_EQ(rl["weight_flops_per_token"], (*one)["roofline"]["weight_flops_per_token"]);
          EXPECT_FALSE(rl.contains("bytes_per_step"));
          continue;
        }
        const auto& parts = rl["bytes_per_step_parts"];
        const double step = rl["bytes_per_step"];
        EXPECT_EQ(step, parts["trunk"].get<double>() + parts["experts"].get<double>() +
                            parts["kda_state"].get<double>() + parts["mla_cache"].get<double>())
            << x.dump();
        EXPECT_NEAR(rl["bytes_per_token"].get<double>(), step / double(b), 1e-9 * step);
        EXPECT_NEAR(rl["ratio_vs_start_probe"].get<double>(), avg * step / double(b) / (bw * 1e9), 1e-9) << x.dump();
        EXPECT_EQ(rl["experts_per_moe_layer"].get<double>(), b == 1 ? 3.0 : 8.0);  // min(3 x 3, 8)
        const auto& p1 = (*one)["roofline"]["bytes_per_step_parts"];
        // Per sequence: KDA state and MLA cache (16 tokens x (32 + 8) fp32 x 4 MLA layers at d16).
        EXPECT_EQ(parts["kda_state"].get<double>(), double(b) * p1["kda_state"].get<double>());
        EXPECT_EQ(parts["mla_cache"].get<double>(), double(b) * (d ? 16.0 * (32 + 8) * 4 * 4 : 0.0));
        // The weights once: 8/3 of the batch-1 expert bytes, trunk + 2 more embedding rows.
        EXPECT_NEAR(parts["experts"].get<double>(), (b == 1 ? 1.0 : 8.0 / 3) * p1["experts"].get<double>(), 2.0);
        if (b == 3) {
          EXPECT_GT(parts["trunk"].get<double>(), p1["trunk"].get<double>());
        }
      }
  }
}

TEST(CliBench, Help) {
  const auto r = run_k3("bench --help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* s : {"-p", "-n", "-d", "-r", "-t", "--json-out", "--ubatch", "--no-progress"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
}

TEST(CliBenchBadInput, Lists) {
  expect_bad(run_k3("bench " + m() + " -p ''"), "-p/--n-prompt: empty list");
  expect_bad(run_k3("bench " + m() + " -p 8,,4"), "-p/--n-prompt: empty item");
  expect_bad(run_k3("bench " + m() + " -n 4,"), "-n/--n-gen: empty item");
  expect_bad(run_k3("bench " + m() + " -p 8,x"), "-p/--n-prompt: 'x' is not a non-negative integer");
  expect_bad(run_k3("bench " + m() + " -d 1.5"), "-d/--n-depth: '1.5' is not a non-negative integer");
  expect_bad(run_k3("bench " + m() + " -d 0,-16"), "-d/--n-depth: '-16' is negative");
  expect_bad(run_k3("bench " + m() + " -n -3"), "-n/--n-gen: '-3' is negative");
  expect_bad(run_k3("bench " + m() + " -t 0"), "-t/--threads: 0 is too small");
  expect_bad(run_k3("bench " + m() + " -p 99999999999999999999999"),
             "-p/--n-prompt: 99999999999999999999999 is too large");
  expect_bad(run_k3("bench " + m() + " -p 0 -n 0"), "nothing to run");
}

TEST(CliBenchBadInput, Batch) {
  expect_bad(run_k3("bench " + m() + " -b 0"), "-b/--batch: 0 is too small");
  expect_bad(run_k3("bench " + m() + " -b x"), "-b/--batch: 'x' is not a non-negative integer");
  expect_bad(run_k3("bench " + m() + " -b 1,,2"), "-b/--batch: empty item in list '1,,2'");
  expect_bad(run_k3("bench " + m() + " --batch 1,-2"), "-b/--batch: '-2' is negative");
  expect_bad(run_k3("bench " + m() + " --batch=99999"), "-b/--batch: 99999 is too large (at most 4096)");
  expect_bad(run_k3("bench " + m() + " -b"), "--batch: 1 required");
}

TEST(CliBenchBadInput, Scalars) {
  expect_bad(run_k3("bench " + m() + " -r 0"), "-r/--repetitions: 0 is too small");
  expect_bad(run_k3("bench " + m() + " -r 2,3"), "-r/--repetitions: '2,3' is not a non-negative integer");
  expect_bad(run_k3("bench " + m() + " -o csv"), "-o/--output: unknown format 'csv'");
  expect_bad(run_k3("bench " + m() + " --kda magic"), "--kda: unknown algorithm 'magic'");
  expect_bad(run_k3("bench " + m() + " --mla magic"), "--mla: unknown form 'magic'");
  expect_bad(run_k3("bench " + m() + " --depth-fill zeros"), "--depth-fill: unknown mode 'zeros' (prefill or random)");
  expect_bad(run_k3("bench " + m() + " --chunk 0"), "--chunk: 0 is too small");
  expect_bad(run_k3("bench " + m() + " --ubatch 0"), "--ubatch: 0 is too small");
  expect_bad(run_k3("bench " + m() + " --seed -1"), "--seed: '-1' is negative");
  expect_bad(run_k3("bench " + m() + " -p"), "--n-prompt: 1 required");
  expect_bad(run_k3("bench " + m() + " --bogus"), "not expected: --bogus");
  expect_bad(run_k3("bench " + m() + " --no-progress=1"), "no-progress was given a disallowed flag override");
  expect_bad(run_k3("bench " + m() + " --no-roofline=1"), "no-roofline was given a disallowed flag override");
  expect_bad(run_k3("bench " + m() + " --numerics approx"), "unknown numerics 'approx' (expected exact, fp32 or fast)");
  expect_bad(run_k3("bench " + m() + " --cpu-isa sse9"), "unknown CPU level 'sse9'");
  expect_bad(run_k3("bench " + m() + " --roofline-mib 1"), "--roofline-mib: 1 is too small");
  expect_bad(run_k3("bench " + m() + " --json-out /nonexistent/dir/x.json"),
             "--json-out: cannot write /nonexistent/dir/x.json");
}

TEST(CliBenchBadInput, Model) {
  // Without -m: $K3_MODEL, then the bundled model, as every subcommand that reads a model.
  expect_bad(k3test::run_shell("K3_MODEL=/nonexistent/k3env " + std::string(K3_BIN) + " bench -p 8"),
             "model directory '/nonexistent/k3env' does not exist");
  expect_bad(run_k3("bench -m /nonexistent/k3"), "model directory '/nonexistent/k3' does not exist");
  const std::string file = (tiny() / "config.json").string();
  expect_bad(run_k3("bench -m " + quote(file)), "is not a directory");
  const fs::path empty = fs::temp_directory_path() / ("k3bench_empty_" + std::to_string(::getpid()));
  fs::create_directories(empty);
  const auto r = run_k3("bench -m " + quote(empty.string()));
  fs::remove_all(empty);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(CliBenchBadInput, BeyondMaxPositions) {
  // tiny: max_position_embeddings 4096.
  expect_bad(run_k3("bench " + m() + " -p 8 -n 0 -d 0,4090"),
             "depth 4090 + prompt 8 = 4098 tokens exceeds the model's max_position_embeddings (4096)");
  expect_bad(run_k3("bench " + m() + " -p 0 -n 100 -d 4000"),
             "depth 4000 + generated 100 = 4100 tokens exceeds the model's max_position_embeddings (4096)");
  expect_bad(run_k3("bench " + m() + " -p 5000 -n 0"), "prompt 5000");
}

// --profile with -b: the union of routed experts the profiled run's decode steps read (the router's
// ids read back after each router op): exactly top_k at batch 1, between top_k and the bound the
// roofline counts (min(B x top_k, E)) at B = 3, and the tg ratio with the bound's expert bytes
// replaced by the union's; the md report says it under the op table.
TEST(CliBench, ProfiledExpertUnion) {
  const std::string args = "bench " + m() + " -p 0 -n 4 -b 1,3 -r 1 -t 1 --no-progress --roofline-mib 32 --profile";
  const auto r = run_k3(args + " -o json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  const auto& res = doc["results"];
  ASSERT_EQ(res.size(), 2u);
  for (const auto& x : res) {
    const int64_t b = x["n_batch"];
    const auto& rl = x["roofline"];
    ASSERT_TRUE(rl.contains("experts_per_moe_layer_profiled")) << x.dump();
    const double u = rl["experts_per_moe_layer_profiled"], bound = rl["experts_per_moe_layer"];
    const double ratio = rl["ratio"], got = rl["ratio_profiled_union"];
    if (b == 1) {
      EXPECT_EQ(u, 3.0) << x.dump();  // top-3 distinct experts per token
      EXPECT_NEAR(got, ratio, 1e-12 * ratio);
      continue;
    }
    EXPECT_GE(u, 3.0) << x.dump();
    EXPECT_LE(u, bound) << x.dump();
    const double step = rl["bytes_per_step"], ex = rl["bytes_per_step_parts"]["experts"];
    const double want = ratio * (step - ex + ex * u / bound) / step;
    EXPECT_NEAR(got, want, 1e-12 * want) << x.dump();
  }
  const auto md = run_k3(args);
  ASSERT_EQ(md.code, 0) << md.err;
  EXPECT_NE(md.out.find("routed experts read per MoE layer in this run: "), std::string::npos) << md.out;
}

// --profile: each result carries the op table of one extra run (the steps of that run; the ops a
// K3 layer calls, each with calls > 0 and non-negative time; shares summing to 1), printed in md
// after the results table; without the flag there is none.
TEST(CliBench, ProfileTables) {
  const auto r = run_k3("bench " + m() + " -p 8 -n 4 -r 1 -t 1 -o json --no-progress --no-roofline --profile");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  ASSERT_EQ(doc["results"].size(), 2u);
  for (const auto& res : doc["results"]) {
    ASSERT_TRUE(res.contains("profile")) << res.dump();
    const auto& p = res["profile"];
    // pp8: one step (8 <= --ubatch); tg4: four decode steps
    EXPECT_EQ(p["steps"].get<int64_t>(), res["n_prompt"].get<int64_t>() > 0 ? 1 : 4) << p.dump();
    double share = 0;
    std::vector<std::string> ops;
    for (const auto& o : p["ops"]) {
      EXPECT_GT(o["calls"].get<int64_t>(), 0) << o.dump();
      EXPECT_GE(o["ms"].get<double>(), 0.0) << o.dump();
      share += o["share"].get<double>();
      ops.push_back(o["op"].get<std::string>());
    }
    EXPECT_NEAR(share, 1.0, 1e-9);
    for (const char* want : {"matmul", "kda", "mla_attend", "moe_routed", "attnres_mix", "rmsnorm", "router_topk"})
      EXPECT_NE(std::find(ops.begin(), ops.end(), want), ops.end()) << want << " missing from " << p.dump();
  }
  // --ubatch above the CPU's 512 step rows: a 1000-token piece is one step, not two.
  for (const char* ub : {"512", "1000"}) {
    const auto big = run_k3("bench " + m() + " -p 1000 -n 0 -r 1 -t 1 --ubatch " + ub +
                            " -o json --no-progress --no-roofline --profile");
    ASSERT_EQ(big.code, 0) << big.err;
    const auto bd = nlohmann::json::parse(big.out);
    EXPECT_EQ(bd["results"][0]["profile"]["steps"].get<int64_t>(), std::string(ub) == "512" ? 2 : 1) << ub;
  }
  const auto md = run_k3("bench " + m() + " -p 0 -n 2 -r 1 -t 1 --no-progress --no-roofline --profile");
  ASSERT_EQ(md.code, 0) << md.err;
  EXPECT_NE(md.out.find("profile of tg2 (t=1): 2 steps"), std::string::npos) << md.out;
  EXPECT_NE(md.out.find("| moe_routed |"), std::string::npos) << md.out;
  const auto plain = run_k3("bench " + m() + " -p 8 -n 0 -r 1 -t 1 -o json --no-progress --no-roofline");
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_FALSE(nlohmann::json::parse(plain.out)["results"][0].contains("profile"));
}
