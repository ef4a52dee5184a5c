// Prints how far each decode path of the engine is from the fp64 reference logits committed with
// a fixture (tests/fixtures/<name>/reference.json + logits.f32), as rel-L2 over all logits.
// docs/data/model_gates.txt is written from it (scripts/measure_gates.sh).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/model.h"

namespace {
double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double n = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    n += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    d += double(b[i]) * b[i];
  }
  return std::sqrt(n / d);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: k3_gate_report FIXTURE_DIR\n");
    return 2;
  }
  try {
    const std::string dir = argv[1];
    auto m = k3::Model::load(dir);
    std::ifstream jf(dir + "/reference.json");
    const auto j = nlohmann::json::parse(jf);
    const auto ids = j["ids"].get<std::vector<int32_t>>();
    const size_t V = size_t(m->dims().vocab), T = ids.size();
    std::vector<float> ref(T * V);
    std::ifstream lf(dir + "/" + j["logits_file"].get<std::string>(), std::ios::binary);
    lf.read(reinterpret_cast<char*>(ref.data()), std::streamsize(ref.size() * 4));
    if (!lf) k3::fail(dir + ": reference logits file too short");
    // Prefill `split` tokens, then decode the rest one at a time.
    auto run = [&](const k3::ForwardOptions& o, size_t split) {
      std::vector<float> a(T * V);
      k3::Session s(*m);
      m->forward(s, ids.data(), int64_t(split), true, a.data(), o);
      for (size_t t = split; t < T; ++t) m->forward(s, &ids[t], 1, true, a.data() + t * V, o);
      return a;
    };
    k3::ForwardOptions chunked, rec, expanded;
    rec.kda_algo = k3::KdaAlgo::Recurrent;
    expanded.mla_algo = k3::MlaAlgo::Expanded;
    const auto a = run(chunked, T), b = run(rec, T), c = run(expanded, T), d = run(chunked, 1), e = run(rec, 1);
    std::printf("%s (T=%zu, vocab %zu), rel-L2 over all logits\n", dir.c_str(), T, V);
    std::printf(
        "  vs fp64 reference: full pass chunked KDA + absorbed MLA %.2e | recurrent KDA %.2e | expanded MLA %.2e | "
        "prefill 1 + decode %.2e\n",
        rel_l2(a, ref), rel_l2(b, ref), rel_l2(c, ref), rel_l2(d, ref));
    std::printf(
        "  between paths:     chunked vs recurrent %.2e | absorbed vs expanded %.2e | incremental vs full pass "
        "(recurrent) %.2e\n",
        rel_l2(a, b), rel_l2(c, a), rel_l2(e, b));
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_gate_report: error: %s\n", e.what());
    return e.exit_code();
  }
  return 0;
}
