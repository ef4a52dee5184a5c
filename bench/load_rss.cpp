// Measures that loading a checkpoint does not copy the weights: resident memory (VmRSS) before
// and after Model::load, and after one short forward pass, against the bytes of the safetensors
// files. Prints one JSON object (docs/data/load_rss.json is written from it).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"

namespace {
long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: k3_load_rss CHECKPOINT_DIR\n");
    return 2;
  }
  try {
    uint64_t file_bytes = 0;
    for (const auto& e : std::filesystem::directory_iterator(argv[1]))
      if (e.path().extension() == ".safetensors") file_bytes += e.file_size();
    const long before = rss_kib();
    const auto t0 = std::chrono::steady_clock::now();
    auto m = k3::Model::load(argv[1]);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const long after = rss_kib();
    k3::Session s(*m);
    std::vector<int32_t> ids = {1, 2, 3, 4};
    std::vector<float> logits(static_cast<size_t>(m->dims().vocab));
    m->forward(s, ids.data(), int64_t(ids.size()), false, logits.data());
    const long after_fwd = rss_kib();
    std::printf(
        "{\"checkpoint\": \"%s\", \"safetensors_bytes\": %llu, \"rss_before_load_kib\": %ld, "
        "\"rss_after_load_kib\": %ld, \"rss_growth_load_bytes\": %lld, \"load_growth_over_file\": %.5f, "
        "\"load_seconds\": %.3f, \"rss_after_4_token_forward_kib\": %ld}\n",
        argv[1], (unsigned long long)file_bytes, before, after, (long long)(after - before) * 1024,
        double(after - before) * 1024.0 / double(file_bytes), load_s, after_fwd);
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_load_rss: error: %s\n", e.what());
    return e.exit_code();
  }
  return 0;
}
