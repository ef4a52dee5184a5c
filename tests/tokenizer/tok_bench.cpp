// Single-thread encoding throughput of k3::tok::Tokenizer on the setup corpus (same bytes the
// tiktoken reference timed in reference_stats.json). Usage: k3_tok_bench DATA_DIR [repeats].
// Prints one JSON line with every run's seconds (scripts/measure_tokenizer_throughput.sh takes the
// median and range); it measures only, it does not check ids (test_kimi_vocab does).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/tok_test_util.h"
#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: k3_tok_bench DATA_DIR [repeats]\n");
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
    auto t0 = std::chrono::steady_clock::now();
    const auto tok = k3::tok::Tokenizer::load_dir(dir + "/kimi");
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto docs = k3test::read_records(dir + "/corpus.bin");
    size_t bytes = 0, tokens = 0;
    for (const auto& d : docs) bytes += d.size();
    std::vector<double> runs;
    for (int r = 0; r < repeats; ++r) {
      tokens = 0;
      auto a = std::chrono::steady_clock::now();
      for (const auto& d : docs) tokens += tok.encode(d).size();
      runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    std::string secs;
    for (double s : runs) secs += (secs.empty() ? "" : ", ") + std::to_string(s);
    std::printf("{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": [%s], \"load_seconds\": %.3f}\n", bytes, tokens,
                secs.c_str(), load_s);
    return 0;
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_tok_bench: error: %s\n", e.what());
    return e.exit_code();
  }
}
