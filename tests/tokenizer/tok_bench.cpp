// Single-thread encoding throughput of k3::tok::Tokenizer on the setup corpus (same bytes the
// tiktoken reference timed in reference_stats.json). Usage: k3_tok_bench DATA_DIR [repeats].
// Prints one JSON line; it measures only, it does not check ids (test_kimi_vocab does).
#include <chrono>
#include <cstdio>
#include <string>

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
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      tokens = 0;
      auto a = std::chrono::steady_clock::now();
      for (const auto& d : docs) tokens += tok.encode(d).size();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    std::printf("{\"bytes\": %zu, \"tokens\": %zu, \"best_seconds\": %.4f, \"MBps\": %.2f, \"load_seconds\": %.3f}\n",
                bytes, tokens, best, bytes / best / 1e6, load_s);
    return 0;
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_tok_bench: error: %s\n", e.what());
    return e.exit_code();
  }
}
