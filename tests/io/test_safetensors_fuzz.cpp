// Random-mutation robustness test for the safetensors header parser (fixed seeds, a few seconds).
// Owns: checking that any mutated image either parses with every view inside the buffer or throws
// k3::Error, nothing else. Must not: depend on wall-clock randomness.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error.h"
#include "io/safetensors.h"
#include "io/st_test_util.h"

using k3test::st_image;
using k3test::st_raw;

namespace {

std::vector<std::vector<uint8_t>> seeds() {
  std::vector<std::vector<uint8_t>> out;
  std::mt19937 rng(99);
  auto bytes = [&](size_t n) {
    std::vector<uint8_t> b(n);
    for (auto& x : b) x = uint8_t(1 + rng() % 255);
    return b;
  };
  out.push_back(st_image({{"a", "BF16", {3, 4}, bytes(24)}, {"b", "U8", {5}, bytes(5)}}, {{"format", "pt"}}));
  out.push_back(
      st_image({{"s", "F32", {}, bytes(4)}, {"e", "F32", {0, 3}, {}}, {"f8", "F8_E4M3", {2, 2, 2}, bytes(8)}}));
  out.push_back(st_image({{"x.weight", "F16", {7}, bytes(14)},
                          {"y", "I64", {2}, bytes(16)},
                          {"z", "BOOL", {3}, bytes(3)},
                          {"w", "F64", {1, 1}, bytes(8)}},
                         {{"k", "v"}, {"k2", "v2"}}));
  out.push_back(st_raw("{}", {}));
  out.push_back(st_raw("{\"t\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}  ", bytes(12)));
  return out;
}

// Characters that make JSON mutations likely to stay near-valid.
const char kJsonChars[] = "{}[]\":,-0123456789eE.+ \\u\x00\xff\x7f\nabFUI8_";

void mutate(std::vector<uint8_t>& b, std::mt19937& rng) {
  const int kind = int(rng() % 8);
  auto pos = [&](size_t n) { return n ? size_t(rng() % n) : 0; };
  switch (kind) {
    case 0:  // bit flip anywhere
      if (!b.empty()) b[pos(b.size())] ^= uint8_t(1u << (rng() % 8));
      break;
    case 1:  // overwrite a byte of the 8-byte length
      if (b.size() >= 8) b[pos(8)] = uint8_t(rng());
      break;
    case 2:  // set the length to a nearby or extreme value
      if (b.size() >= 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; --i) n = (n << 8) | b[size_t(i)];
        const uint64_t choices[] = {n + 1,
                                    n - 1,
                                    n + (rng() % 64),
                                    uint64_t(b.size()),
                                    uint64_t(b.size() - 8),
                                    ~uint64_t(0),
                                    uint64_t(1) << 63,
                                    uint64_t(100) << 20};
        n = choices[rng() % 8];
        for (int i = 0; i < 8; ++i) b[size_t(i)] = uint8_t(n >> (8 * i));
      }
      break;
    case 3:  // overwrite a header byte with a JSON-ish character
      if (b.size() > 8) b[8 + pos(b.size() - 8)] = uint8_t(kJsonChars[rng() % (sizeof(kJsonChars) - 1)]);
      break;
    case 4:  // truncate
      b.resize(pos(b.size() + 1));
      break;
    case 5: {  // insert random bytes
      const size_t at = pos(b.size() + 1);
      const size_t n = 1 + rng() % 4;
      for (size_t i = 0; i < n; ++i)
        b.insert(b.begin() + long(at), uint8_t(kJsonChars[rng() % (sizeof(kJsonChars) - 1)]));
      break;
    }
    case 6: {  // replace a digit run with a big or negative number
      if (b.size() > 8) {
        const size_t at = 8 + pos(b.size() - 8);
        if (b[at] >= '0' && b[at] <= '9') {
          const char* reps[] = {"99999999999999999999", "-1", "18446744073709551615", "4294967296", "1.5", "1e3"};
          const std::string r = reps[rng() % 6];
          b.erase(b.begin() + long(at));
          b.insert(b.begin() + long(at), r.begin(), r.end());
        }
      }
      break;
    }
    default:  // erase a byte
      if (!b.empty()) b.erase(b.begin() + long(pos(b.size())));
      break;
  }
}

// Parses with the whole buffer and (if it is long enough) with only the header available.
void check_one(const std::vector<uint8_t>& b, size_t& ok, size_t& rejected) {
  const uint8_t* p = b.empty() ? nullptr : b.data();
  try {
    const auto h = k3::io::parse_safetensors_header(p, b.size(), b.size(), "fuzz");
    ASSERT_EQ(h.tensors.size(), h.offsets.size());
    ASSERT_LE(h.data_start, b.size());
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const auto& v = h.tensors[i];
      ASSERT_LE(h.offsets[i], b.size() - h.data_start);
      ASSERT_LE(v.nbytes, b.size() - h.data_start - h.offsets[i]) << v.name;
      ASSERT_EQ(uint64_t(v.numel()) * k3::dtype_size(v.dtype), v.nbytes) << v.name;
    }
    // Header-only view of the same file must give the same answer.
    const auto h2 = k3::io::parse_safetensors_header(p, h.data_start, b.size(), "fuzz");
    ASSERT_EQ(h2.tensors.size(), h.tensors.size());
    ++ok;
  } catch (const k3::Error& e) {
    ASSERT_EQ(e.exit_code(), 2);
    ASSERT_EQ(std::string(e.what()).rfind("fuzz: ", 0), 0u) << e.what();
    ASSERT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    ++rejected;
  } catch (const std::exception& e) {
    FAIL() << "non-k3 exception: " << e.what();
  }
}

}  // namespace

TEST(SafetensorsFuzz, RandomMutationsNeverEscape) {
  const auto base = seeds();
  size_t ok = 0, rejected = 0;
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    std::mt19937 rng(seed);
    for (int iter = 0; iter < 2500; ++iter) {
      std::vector<uint8_t> b = base[rng() % base.size()];
      const int rounds = 1 + int(rng() % 4);
      for (int r = 0; r < rounds; ++r) mutate(b, rng);
      check_one(b, ok, rejected);
      if (HasFatalFailure()) return;
    }
  }
  // Both outcomes must actually occur, or the mutations are not exercising the parser.
  EXPECT_GT(ok, 100u);
  EXPECT_GT(rejected, 1000u);
  RecordProperty("accepted", int(ok));
  RecordProperty("rejected", int(rejected));
}

TEST(SafetensorsFuzz, MutatedFilesThroughMmapAndHeaderReader) {
  const auto base = seeds();
  k3test::TempDir dir;
  std::mt19937 rng(2024);
  size_t opened = 0;
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<uint8_t> b = base[rng() % base.size()];
    mutate(b, rng);
    const std::string path = dir.write("m.safetensors", b);
    try {
      auto f = k3::io::SafetensorsFile::open(path);
      for (const auto& v : f->tensors()) {
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < v.nbytes; ++i) sink = sink ^ v.data[i];  // ASan/segv would catch a bad view
        (void)sink;
      }
      ++opened;
    } catch (const k3::Error&) {
    }
    try {
      (void)k3::io::SafetensorsFile::read_header(path);
    } catch (const k3::Error&) {
    }
  }
  EXPECT_GT(opened, 10u);
}
