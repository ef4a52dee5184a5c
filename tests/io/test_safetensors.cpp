// Tests for src/io/safetensors: round trips of test-written files, the third-party two-shard
// fixture, checkpoint directories (index + shards, single file, headers only) and one test per
// kind of bad input. Must not: compute expected values with the reader under test.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/error.h"
#include "io/safetensors.h"
#include "io/st_test_util.h"

using k3::DType;
using k3::TensorView;
using k3::io::Checkpoint;
using k3::io::MappedFile;
using k3::io::SafetensorsFile;
using k3test::expect_k3_error;
using k3test::st_image;
using k3test::st_raw;
using k3test::StEntry;
using k3test::TempDir;

namespace {

template <class T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
T load(const uint8_t* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

// Independent oracles for the element formats (IEEE half, OCP E4M3FN), from their definitions.
double half_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -mag : mag;
}
double e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

bool inside(const TensorView& v, const uint8_t* base, size_t size) {
  return v.data >= base && v.data + v.nbytes <= base + size;
}

std::string shared_dir() { return K3_SHARED_DIR; }

// A valid five-tensor image with random non-zero contents, returning what was written.
struct Written {
  std::vector<float> bf16_vals;    // exactly representable in bf16
  std::vector<uint16_t> f16_bits;  // normal halves
  std::vector<uint8_t> u8;
  float scalar = 0;
  std::vector<uint8_t> fp8;
  std::vector<uint8_t> image;
};

Written make_written(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uf(-8.0f, 8.0f);
  Written w;
  std::vector<uint16_t> bf16_bits;
  for (int i = 0; i < 24; ++i) {
    float f = uf(rng);
    if (f == 0.0f) f = 0.5f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u &= 0xffff0000u;  // truncate to a bf16-representable value
    std::memcpy(&f, &u, 4);
    w.bf16_vals.push_back(f);
    bf16_bits.push_back(uint16_t(u >> 16));
  }
  for (int i = 0; i < 13; ++i) {  // odd length
    const uint16_t sign = uint16_t((rng() & 1) << 15);
    const uint16_t exp = uint16_t(1 + rng() % 30);
    const uint16_t man = uint16_t(rng() % 1024);
    w.f16_bits.push_back(uint16_t(sign | (exp << 10) | man));
  }
  for (int i = 0; i < 3 * 5; ++i) w.u8.push_back(uint8_t(1 + rng() % 255));
  w.scalar = uf(rng) + 17.0f;
  for (int i = 0; i < 10; ++i) {
    uint8_t b = uint8_t(1 + rng() % 255);
    if ((b & 0x7f) == 0x7f) b = 0x42;  // avoid the NaN codes
    w.fp8.push_back(b);
  }
  w.image = st_image({{"a.bf16", "BF16", {24}, as_bytes(bf16_bits)},
                      {"b.f16", "F16", {13}, as_bytes(w.f16_bits)},
                      {"c.u8", "U8", {3, 5}, w.u8},
                      {"d.scalar", "F32", {}, as_bytes(std::vector<float>{w.scalar})},
                      {"e.fp8", "F8_E4M3", {2, 5}, w.fp8}},
                     {{"format", "pt"}, {"who", "k3 test"}});
  return w;
}

void check_written(const Written& w, const SafetensorsFile& f) {
  ASSERT_EQ(f.tensors().size(), 5u);
  // Header order is kept.
  EXPECT_EQ(f.tensors()[0].name, "a.bf16");
  EXPECT_EQ(f.tensors()[4].name, "e.fp8");

  const TensorView* a = f.find("a.bf16");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::BF16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{24}));
  EXPECT_EQ(a->nbytes, 48u);
  for (size_t i = 0; i < w.bf16_vals.size(); ++i)
    EXPECT_EQ(k3::bf16_to_f32(load<uint16_t>(a->data, i)), w.bf16_vals[i]) << i;

  const TensorView* b = f.find("b.f16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::F16);
  EXPECT_EQ(b->numel(), 13);
  EXPECT_EQ(b->nbytes, 26u);
  for (size_t i = 0; i < w.f16_bits.size(); ++i) {
    EXPECT_EQ(load<uint16_t>(b->data, i), w.f16_bits[i]);
    EXPECT_EQ(double(k3::f16_to_f32(load<uint16_t>(b->data, i))), half_value(w.f16_bits[i])) << i;
  }

  const TensorView* c = f.find("c.u8");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, DType::U8);
  EXPECT_EQ(c->shape, (std::vector<int64_t>{3, 5}));
  ASSERT_EQ(c->nbytes, 15u);
  EXPECT_EQ(std::vector<uint8_t>(c->data, c->data + 15), w.u8);
  EXPECT_EQ(c->data[1 * 5 + 2], w.u8[7]);  // row-major [1][2]

  const TensorView* d = f.find("d.scalar");
  ASSERT_NE(d, nullptr);
  EXPECT_TRUE(d->shape.empty());
  EXPECT_EQ(d->numel(), 1);
  EXPECT_EQ(d->nbytes, 4u);
  EXPECT_EQ(load<float>(d->data, 0), w.scalar);

  const TensorView* e = f.find("e.fp8");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, DType::F8_E4M3);
  ASSERT_EQ(e->nbytes, 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(e->data[i], w.fp8[i]);
    EXPECT_EQ(double(k3::fp8_e4m3_to_f32(e->data[i])), e4m3_value(w.fp8[i])) << i;
  }

  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_EQ(f.find("__metadata__"), nullptr);
  ASSERT_EQ(f.metadata().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("who"), "k3 test");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Valid files

TEST(Safetensors, RoundTripAllKindsAndZeroCopy) {
  TempDir dir;
  for (uint32_t seed : {1u, 2u, 3u}) {
    const Written w = make_written(seed);
    const std::string path = dir.write("t" + std::to_string(seed) + ".safetensors", w.image);
    auto f = SafetensorsFile::open(path);
    check_written(w, *f);
    EXPECT_EQ(f->file_size(), w.image.size());
    EXPECT_EQ(f->path(), path);

    // Zero copy: every view lies inside one mapping of the file, at the offset we wrote it.
    auto m = MappedFile::open(path);
    ASSERT_EQ(m->size(), w.image.size());
    EXPECT_EQ(std::memcmp(m->data(), w.image.data(), w.image.size()), 0);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | w.image[size_t(i)];
    const TensorView* first = f->find("a.bf16");
    const uint8_t* base = first->data - (8 + hlen);  // tensor 0 starts the data section
    for (const TensorView& v : f->tensors()) EXPECT_TRUE(inside(v, base, f->file_size())) << v.name;
    // The mapped bytes of each tensor equal the file bytes at the same position.
    for (const TensorView& v : f->tensors())
      EXPECT_EQ(std::memcmp(v.data, w.image.data() + (v.data - base), v.nbytes), 0) << v.name;
  }
}

TEST(Safetensors, ParseInMemoryMatchesFile) {
  const Written w = make_written(7);
  const auto h = k3::io::parse_safetensors_header(w.image.data(), w.image.size(), w.image.size(), "mem");
  ASSERT_EQ(h.tensors.size(), 5u);
  ASSERT_EQ(h.offsets.size(), 5u);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | w.image[size_t(i)];
  EXPECT_EQ(h.data_start, 8 + hlen);
  // Offsets are back to back in the order written: 48, 26, 15, 4, 10 bytes.
  EXPECT_EQ(h.offsets, (std::vector<uint64_t>{0, 48, 74, 89, 93}));
  for (const TensorView& v : h.tensors) EXPECT_EQ(v.data, nullptr);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, ReadHeaderOnly) {
  TempDir dir;
  const Written w = make_written(11);
  const std::string path = dir.write("h.safetensors", w.image);
  const auto h = SafetensorsFile::read_header(path);
  ASSERT_EQ(h.tensors.size(), 5u);
  EXPECT_EQ(h.tensors[2].name, "c.u8");
  EXPECT_EQ(h.tensors[2].nbytes, 15u);
  for (const TensorView& v : h.tensors) EXPECT_EQ(v.data, nullptr) << v.name;
  EXPECT_EQ(h.metadata.at("who"), "k3 test");
}

TEST(Safetensors, EmptyTensorsHeaderPaddingAndNoMetadata) {
  TempDir dir;
  // Zero-element tensors may share an offset with anything; trailing header spaces are allowed.
  const auto img = st_raw(
      "{\"z\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[2,2]},"
      "\"x\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[0,4]}}      ",
      {9, 8, 7, 6});
  auto f = SafetensorsFile::open(dir.write("e.safetensors", img));
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->find("z")->nbytes, 0u);
  EXPECT_EQ(f->find("z")->numel(), 0);
  EXPECT_EQ(load<int16_t>(f->find("x")->data, 1), int16_t(6 << 8 | 7));
  EXPECT_TRUE(f->metadata().empty());
}

TEST(Safetensors, ManyTensorsParseInLinearTime) {
  // 20000 tensors: a quadratic parser (e.g. nlohmann parse callbacks) takes seconds here.
  std::string h = "{";
  std::vector<uint8_t> data;
  for (int i = 0; i < 20000; ++i) {
    const size_t off = data.size();
    data.push_back(uint8_t(1 + i % 200));
    data.push_back(uint8_t(2 + i % 100));
    h += (i ? "," : "") + std::string("\"layers.") + std::to_string(i) +
         ".w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[" + std::to_string(off) + "," +
         std::to_string(off + 2) + "]}";
  }
  h += "}";
  const auto img = st_raw(h, data);
  const auto t0 = std::chrono::steady_clock::now();
  const auto hd = k3::io::parse_safetensors_header(img.data(), img.size(), img.size(), "many");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(hd.tensors.size(), 20000u);
  EXPECT_EQ(hd.tensors[12345].name, "layers.12345.w");  // document order kept
  EXPECT_EQ(hd.offsets[12345], 2u * 12345u);
  EXPECT_LT(secs, 3.0);  // ~0.1 s normally, well under a second even with sanitizers
}

TEST(MappedFile, EmptyFileAndMissingFile) {
  TempDir dir;
  const std::string p = dir.write("empty.bin", {});
  auto m = MappedFile::open(p);
  EXPECT_EQ(m->size(), 0u);
  EXPECT_EQ(m->data(), nullptr);
  expect_k3_error([&] { MappedFile::open(dir.file("nope.bin")); },
                  dir.file("nope.bin") + ": cannot open: No such file");
  expect_k3_error([&] { MappedFile::open(dir.path()); }, "not a regular file");
  expect_k3_error([&] { SafetensorsFile::open(p); }, "file too small for a safetensors header (0 bytes");
  expect_k3_error([&] { SafetensorsFile::read_header(p); }, "file too small for a safetensors header (0 bytes");
}

// ---------------------------------------------------------------------------------------------
// Checkpoint directories

namespace {
StEntry u8_entry(const std::string& name, std::vector<uint8_t> bytes) {
  return {name, "U8", {int64_t(bytes.size())}, std::move(bytes)};
}
std::string index_json(const std::vector<std::pair<std::string, std::string>>& map) {
  std::string s = "{\"metadata\":{\"total_size\":123},\"weight_map\":{";
  for (size_t i = 0; i < map.size(); ++i)
    s += (i ? "," : "") + std::string("\"") + map[i].first + "\":\"" + map[i].second + "\"";
  return s + "}}";
}
}  // namespace

TEST(Checkpoint, IndexWithTwoShards) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2, 3}), {"w.b", "BF16", {2}, {0x80, 0x3f, 0x00, 0xc0}}}));
  dir.write("s2.safetensors", st_image({{"w.c", "F32", {1}, as_bytes(std::vector<float>{-2.5f})}}));
  dir.write_text("model.safetensors.index.json",
                 index_json({{"w.a", "s1.safetensors"}, {"w.b", "s1.safetensors"}, {"w.c", "s2.safetensors"}}));
  auto c = Checkpoint::open(dir.path());
  EXPECT_TRUE(c->has_index());
  EXPECT_EQ(c->tensor_count(), 3u);
  EXPECT_EQ(c->names(), (std::vector<std::string>{"w.a", "w.b", "w.c"}));
  ASSERT_EQ(c->shard_paths().size(), 2u);
  EXPECT_TRUE(c->missing_shards().empty());
  ASSERT_NE(c->find("w.b"), nullptr);
  EXPECT_EQ(k3::bf16_to_f32(load<uint16_t>(c->find("w.b")->data, 0)), 1.0f);
  EXPECT_EQ(k3::bf16_to_f32(load<uint16_t>(c->find("w.b")->data, 1)), -2.0f);
  EXPECT_EQ(load<float>(c->find("w.c")->data, 0), -2.5f);
  EXPECT_EQ(c->find("w.a")->data[2], 3);
  EXPECT_EQ(c->find("nope"), nullptr);
  EXPECT_EQ(c->total_tensor_bytes(), 3u + 4u + 4u);
  const auto by = c->bytes_by_dtype();
  EXPECT_EQ(by.at(DType::U8), 3u);
  EXPECT_EQ(by.at(DType::BF16), 4u);
  EXPECT_EQ(by.at(DType::F32), 4u);

  auto h = Checkpoint::open_headers(dir.path());
  EXPECT_EQ(h->tensor_count(), 3u);
  EXPECT_EQ(h->total_tensor_bytes(), 11u);
  EXPECT_EQ(h->find("w.c")->data, nullptr);
  EXPECT_EQ(h->find("w.c")->nbytes, 4u);
}

TEST(Checkpoint, SingleFileAndConfigOnlyDirectory) {
  TempDir dir;
  expect_k3_error([&] { Checkpoint::open(dir.path()); },
                  "no model.safetensors.index.json or model.safetensors in " + dir.path());
  auto empty = Checkpoint::open_headers(dir.path());
  EXPECT_EQ(empty->tensor_count(), 0u);
  EXPECT_EQ(empty->total_tensor_bytes(), 0u);
  EXPECT_FALSE(empty->has_index());

  dir.write("model.safetensors", st_image({u8_entry("only", {5, 6, 7, 8, 9})}));
  auto c = Checkpoint::open(dir.path());
  EXPECT_FALSE(c->has_index());
  ASSERT_EQ(c->tensor_count(), 1u);
  EXPECT_EQ(c->find("only")->data[4], 9);
  EXPECT_EQ(c->bytes_by_dtype().at(DType::U8), 5u);
  EXPECT_EQ(Checkpoint::open_headers(dir.path())->tensor_count(), 1u);

  expect_k3_error([&] { Checkpoint::open(dir.file("does-not-exist")); }, "not a directory");
}

TEST(Checkpoint, HeadersToleratesMissingShard) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2})}));
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "s1.safetensors"}, {"w.b", "s2.safetensors"}}));
  auto h = Checkpoint::open_headers(dir.path());
  ASSERT_EQ(h->missing_shards().size(), 1u);
  EXPECT_EQ(h->missing_shards()[0], dir.file("s2.safetensors"));
  EXPECT_EQ(h->tensor_count(), 1u);
  EXPECT_NE(h->find("w.a"), nullptr);
  EXPECT_EQ(h->find("w.b"), nullptr);
}

TEST(CheckpointErrors, IndexNamesMissingShard) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2})}));
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "s1.safetensors"}, {"w.b", "s2.safetensors"}}));
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "shard 's2.safetensors' named in the index is missing");
}

TEST(CheckpointErrors, IndexNamesTensorAbsentFromShard) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2})}));
  dir.write_text("model.safetensors.index.json",
                 index_json({{"w.a", "s1.safetensors"}, {"w.ghost", "s1.safetensors"}}));
  expect_k3_error([&] { Checkpoint::open(dir.path()); },
                  "tensor mapped to shard 's1.safetensors' is not in that shard (tensor 'w.ghost')");
  expect_k3_error([&] { Checkpoint::open_headers(dir.path()); }, "(tensor 'w.ghost')");
}

TEST(CheckpointErrors, ShardTensorAbsentFromIndex) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2}), u8_entry("w.extra", {3})}));
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "s1.safetensors"}}));
  expect_k3_error([&] { Checkpoint::open(dir.path()); },
                  "tensor in shard 's1.safetensors' is not listed in the index (tensor 'w.extra')");
}

TEST(CheckpointErrors, TensorInTwoShards) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1, 2})}));
  dir.write("s2.safetensors", st_image({u8_entry("w.a", {1, 2}), u8_entry("w.b", {4})}));
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "s1.safetensors"}, {"w.b", "s2.safetensors"}}));
  expect_k3_error([&] { Checkpoint::open(dir.path()); },
                  "tensor in shard 's2.safetensors' is mapped by the index to 's1.safetensors' (tensor 'w.a')");
}

TEST(CheckpointErrors, AllProblemsReportedAtOnce) {
  TempDir dir;
  dir.write("s1.safetensors", st_image({u8_entry("w.a", {1}), u8_entry("w.extra", {3})}));
  dir.write("bad.safetensors", st_raw("{not json", {}));
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "s1.safetensors"},
                                                             {"w.ghost", "s1.safetensors"},
                                                             {"w.x", "gone.safetensors"},
                                                             {"w.y", "../escape.safetensors"},
                                                             {"w.z", "bad.safetensors"}}));
  try {
    Checkpoint::open(dir.path());
    FAIL() << "expected an error";
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(msg.find("5 problems"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unsafe shard file name '../escape.safetensors'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'gone.safetensors' named in the index is missing"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bad.safetensors: bad JSON"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(tensor 'w.ghost')"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(tensor 'w.extra')"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos);
  }
}

TEST(CheckpointErrors, UnsafeShardNames) {
  TempDir dir;
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", "sub/x.safetensors"}}));
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "unsafe shard file name 'sub/x.safetensors'");
  dir.write_text("model.safetensors.index.json", index_json({{"w.a", ".."}}));
  expect_k3_error([&] { Checkpoint::open_headers(dir.path()); }, "unsafe shard file name '..'");
}

TEST(CheckpointErrors, BadIndexFile) {
  TempDir dir;
  dir.write_text("model.safetensors.index.json", "{\"weight_map\": [1,2]}");
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "'weight_map' is missing or not a JSON object");
  dir.write_text("model.safetensors.index.json", "{\"weight_map\": {\"a\": 3}}");
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "weight_map value is not a string (tensor 'a')");
  dir.write_text("model.safetensors.index.json", "{\"weight_map\": {\"a\": \"x\"");
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "model.safetensors.index.json: bad JSON in index");
  dir.write_text("model.safetensors.index.json", "{\"weight_map\": {\"a\": \"x\", \"a\": \"y\"}}");
  expect_k3_error([&] { Checkpoint::open(dir.path()); }, "duplicate key 'a' in index");
}

// ---------------------------------------------------------------------------------------------
// Bad single files: one test per defect, each through the in-memory parser and the mmap path.

namespace {
void expect_bad(const std::vector<uint8_t>& img, const std::string& fragment) {
  expect_k3_error([&] { k3::io::parse_safetensors_header(img.data(), img.size(), img.size(), "img.safetensors"); },
                  "img.safetensors: " + fragment);
  TempDir dir;
  const std::string p = dir.write("bad.safetensors", img);
  expect_k3_error([&] { SafetensorsFile::open(p); }, p + ": " + fragment);
  expect_k3_error([&] { SafetensorsFile::read_header(p); }, fragment);
}
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}
const std::vector<uint8_t> kData16(16, 0x5a);
}  // namespace

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  std::vector<uint8_t> img = st_raw("{}", {});
  img[0] = 200;  // claims 200 bytes of header in a 10-byte file
  expect_bad(img, "header length 200 beyond file size 10");
  std::vector<uint8_t> huge(16, 0xff);
  expect_bad(huge, "header length 18446744073709551615 exceeds the 104857600-byte limit");
}

TEST(SafetensorsErrors, TooSmallForLength) {
  expect_bad({1, 0, 0}, "file too small for a safetensors header (3 bytes");
}

TEST(SafetensorsErrors, TruncatedData) {
  auto img = st_raw("{" + entry("t", "F32", "[4]", "[0,16]") + "}", kData16);
  img.erase(img.end() - 5, img.end());  // data section now 11 bytes
  expect_bad(img, "data_offsets [0, 16] out of range (data section is 11 bytes) (tensor 't')");
}

TEST(SafetensorsErrors, BadJson) {
  expect_bad(st_raw("{\"t\": {\"dtype\": ", kData16), "bad JSON in header");
  expect_bad(st_raw("[1,2,3]", kData16), "header is not a JSON object");
  expect_bad(st_raw("{\"t\": 5}", kData16), "tensor entry is not a JSON object (tensor 't')");
  expect_bad(st_raw("{\"__metadata__\": {\"k\": 1}}", kData16), "__metadata__ value is not a string (key 'k')");
  expect_bad(st_raw("{\"__metadata__\": []}", kData16), "__metadata__ is not a JSON object");
  std::string bad_utf8 = "{\"\xff\": 1}";
  expect_bad(st_raw(bad_utf8, kData16), "bad JSON in header");
}

TEST(SafetensorsErrors, WrongJsonTypes) {
  expect_bad(st_raw("{\"t\":{\"dtype\":7,\"shape\":[4],\"data_offsets\":[0,16]}}", kData16),
             "dtype is not a string (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "F32", "4", "[0,16]") + "}", kData16), "shape is not an array (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "F32", "[4]", "[0]") + "}", kData16),
             "data_offsets must be two non-negative integers (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "F32", "[4]", "[\"0\",16]") + "}", kData16),
             "data_offsets must be two non-negative integers (tensor 't')");
  expect_bad(st_raw("{\"t\":{\"dtype\":\"F32\",\"shape\":[4]}}", kData16),
             "entry needs dtype, shape and data_offsets (tensor 't')");
  expect_bad(st_raw("{\"t\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16],\"x\":1}}", kData16),
             "unexpected key 'x' (tensor 't')");
}

TEST(SafetensorsErrors, UnknownDtype) {
  expect_bad(st_raw("{" + entry("t", "F12", "[4]", "[0,16]") + "}", kData16), "unknown dtype 'F12' (tensor 't')");
}

TEST(SafetensorsErrors, ShapeByteCountMismatch) {
  expect_bad(st_raw("{" + entry("t", "F32", "[3]", "[0,16]") + "}", kData16),
             "shape [3] of F32 needs 12 bytes but data_offsets span 16 (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "BF16", "[]", "[0,4]") + "}", kData16),
             "shape [] of BF16 needs 2 bytes but data_offsets span 4 (tensor 't')");
}

TEST(SafetensorsErrors, ShapeOverflow) {
  expect_bad(st_raw("{" + entry("t", "U8", "[4294967296,4294967296]", "[0,16]") + "}", kData16),
             "shape [4294967296,4294967296] has too many elements (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "F64", "[2305843009213693952]", "[0,16]") + "}", kData16),
             "shape [2305843009213693952] has too many bytes (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "U8", "[18446744073709551615]", "[0,16]") + "}", kData16),
             "shape entry 18446744073709551615 is not a non-negative integer (tensor 't')");
}

TEST(SafetensorsErrors, OffsetsOutOfRange) {
  expect_bad(st_raw("{" + entry("t", "F32", "[4]", "[8,24]") + "}", kData16),
             "data_offsets [8, 24] out of range (data section is 16 bytes) (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "U8", "[0]", "[18446744073709551615,18446744073709551615]") + "}", kData16),
             "data_offsets [18446744073709551615, 18446744073709551615] out of range (data section is 16 bytes)");
}

TEST(SafetensorsErrors, ReversedOffsets) {
  expect_bad(st_raw("{" + entry("t", "F32", "[1]", "[8,4]") + "}", kData16),
             "reversed data_offsets [8, 4] (tensor 't')");
}

TEST(SafetensorsErrors, OverlappingTensors) {
  expect_bad(st_raw("{" + entry("a", "F32", "[3]", "[0,12]") + "," + entry("b", "F32", "[2]", "[8,16]") + "}", kData16),
             "tensors overlap in the data section (tensor 'a') and (tensor 'b')");
  // Nested inside a larger tensor, listed first.
  expect_bad(
      st_raw("{" + entry("in", "U8", "[2]", "[4,6]") + "," + entry("big", "U8", "[16]", "[0,16]") + "}", kData16),
      "tensors overlap in the data section");
  // Same range twice.
  expect_bad(st_raw("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[4]", "[0,4]") + "}", kData16),
             "tensors overlap in the data section");
}

TEST(SafetensorsErrors, DuplicateName) {
  expect_bad(st_raw("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("a", "U8", "[4]", "[4,8]") + "}", kData16),
             "duplicate name in header (tensor 'a')");
  expect_bad(st_raw("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", kData16),
             "duplicate key 'dtype' in header");
}

TEST(SafetensorsErrors, NegativeOrNonIntegerShape) {
  expect_bad(st_raw("{" + entry("t", "U8", "[-4]", "[0,4]") + "}", kData16),
             "shape entry -4 is not a non-negative integer (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "U8", "[4.0]", "[0,4]") + "}", kData16),
             "shape entry 4.0 is not a non-negative integer (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "U8", "[\"4\"]", "[0,4]") + "}", kData16),
             "shape entry \"4\" is not a non-negative integer (tensor 't')");
  expect_bad(st_raw("{" + entry("t", "U8", "[[4]]", "[0,4]") + "}", kData16),
             "shape entry [4] is not a non-negative integer (tensor 't')");
}

TEST(SafetensorsErrors, ControlCharactersInNamesStayOnOneLine) {
  expect_bad(st_raw("{" + entry("a\\nb", "F12", "[4]", "[0,16]") + "}", kData16),
             "unknown dtype 'F12' (tensor 'a\\x0ab')");
}

TEST(SafetensorsErrors, MissingFile) {
  TempDir dir;
  expect_k3_error([&] { SafetensorsFile::open(dir.file("x.safetensors")); },
                  "x.safetensors: cannot open: No such file or directory");
  expect_k3_error([&] { SafetensorsFile::read_header(dir.file("x.safetensors")); }, "x.safetensors: cannot open");
}

// ---------------------------------------------------------------------------------------------
// Third-party fixture: kimi-k3-in-c-ops/safetensors-edge (two shards, no index file).

namespace {
std::string edge_dir() { return shared_dir() + "/fixtures/third-party/kimi-k3-in-c-ops/safetensors-edge"; }
#define REQUIRE_EDGE()                                                            \
  if (!std::filesystem::exists(edge_dir() + "/model-00001-of-00002.safetensors")) \
  GTEST_SKIP() << "third-party fixture folder absent: " << edge_dir()
}  // namespace

TEST(SafetensorsFixture, FirstShard) {
  REQUIRE_EDGE();
  auto f = SafetensorsFile::open(edge_dir() + "/model-00001-of-00002.safetensors");
  // Header facts of the fixture (10 tensors + __metadata__, data section 1876 bytes).
  const std::vector<std::string> order = {"plain.f32.2d",
                                          "plain.bf16.1d",
                                          "tricky.f16.1d",
                                          "packed.u8.2d",
                                          "scalar.f32",
                                          "empty.f32",
                                          "language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight_packed",
                                          "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed",
                                          "rank3.f32",
                                          "rank4.u8"};
  ASSERT_EQ(f->tensors().size(), order.size());
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(f->tensors()[i].name, order[i]);
  EXPECT_EQ(f->find("__metadata__"), nullptr);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().count("note"), 1u);
  EXPECT_EQ(f->file_size(), 2906u);

  const uint8_t* lo = f->tensors()[0].data;
  for (const TensorView& v : f->tensors()) {
    EXPECT_GE(v.data, lo) << v.name;
    EXPECT_LE(v.data + v.nbytes, lo + 1876) << v.name;  // inside the data section
    EXPECT_EQ(uint64_t(v.numel()) * k3::dtype_size(v.dtype), v.nbytes) << v.name;
  }

  const TensorView* f32 = f->find("plain.f32.2d");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32->shape, (std::vector<int64_t>{16, 16}));
  for (int64_t i = 0; i < f32->numel(); ++i) {
    const float x = load<float>(f32->data, size_t(i));
    EXPECT_TRUE(std::isfinite(x) && std::fabs(x) < 20.0f) << i << " " << x;
  }

  // bf16 edge values: +inf, -inf, NaN, +0, -0, the smallest normal 2^-126.
  const TensorView* bf = f->find("plain.bf16.1d");
  ASSERT_NE(bf, nullptr);
  EXPECT_EQ(bf->dtype, DType::BF16);
  EXPECT_EQ(bf->shape, (std::vector<int64_t>{128}));
  auto bfv = [&](size_t i) { return k3::bf16_to_f32(load<uint16_t>(bf->data, i)); };
  EXPECT_EQ(bfv(0), INFINITY);
  EXPECT_EQ(bfv(1), -INFINITY);
  EXPECT_TRUE(std::isnan(bfv(2)));
  EXPECT_EQ(bfv(3), 0.0f);
  EXPECT_FALSE(std::signbit(bfv(3)));
  EXPECT_EQ(bfv(4), 0.0f);
  EXPECT_TRUE(std::signbit(bfv(4)));
  EXPECT_EQ(double(bfv(5)), std::ldexp(1.0, -126));
  for (size_t i = 6; i < 128; ++i) {
    const uint16_t raw = load<uint16_t>(bf->data, i);
    if (((raw >> 7) & 0xff) == 0xff) continue;  // inf/NaN pattern
    const int e = (raw >> 7) & 0xff, m = raw & 0x7f;
    const double mag = e == 0 ? std::ldexp(m, -133) : std::ldexp(1.0 + m / 128.0, e - 127);
    EXPECT_EQ(double(bfv(i)), (raw & 0x8000) ? -mag : mag) << i;
  }

  // f16 edge values: +inf, -inf, NaN, +0, -0, smallest subnormal, largest subnormal, smallest normal.
  const TensorView* h = f->find("tricky.f16.1d");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->dtype, DType::F16);
  EXPECT_EQ(h->nbytes, 128u);
  auto hv = [&](size_t i) { return k3::f16_to_f32(load<uint16_t>(h->data, i)); };
  EXPECT_EQ(hv(0), INFINITY);
  EXPECT_EQ(hv(1), -INFINITY);
  EXPECT_TRUE(std::isnan(hv(2)));
  EXPECT_TRUE(hv(3) == 0.0f && !std::signbit(hv(3)));
  EXPECT_TRUE(hv(4) == 0.0f && std::signbit(hv(4)));
  EXPECT_EQ(double(hv(5)), std::ldexp(1.0, -24));
  EXPECT_EQ(double(hv(6)), std::ldexp(1023.0, -24));
  EXPECT_EQ(double(hv(7)), std::ldexp(1.0, -14));
  for (size_t i = 8; i < 64; ++i) {
    const uint16_t raw = load<uint16_t>(h->data, i);
    EXPECT_EQ(double(hv(i)), half_value(raw)) << i;
    EXPECT_LT(std::fabs(hv(i)), 10.0f) << i;  // ordinary random values after the edge cases
  }

  const TensorView* u8 = f->find("packed.u8.2d");
  ASSERT_NE(u8, nullptr);
  EXPECT_EQ(u8->shape, (std::vector<int64_t>{7, 32}));
  EXPECT_EQ(u8->nbytes, 224u);

  const TensorView* sc = f->find("scalar.f32");
  ASSERT_NE(sc, nullptr);
  EXPECT_TRUE(sc->shape.empty());
  EXPECT_EQ(sc->numel(), 1);
  EXPECT_EQ(load<float>(sc->data, 0), 3.5f);

  const TensorView* em = f->find("empty.f32");
  ASSERT_NE(em, nullptr);
  EXPECT_EQ(em->shape, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(em->nbytes, 0u);

  EXPECT_EQ(f->find("rank3.f32")->shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(f->find("rank4.u8")->shape, (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(f->find("language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed")->nbytes, 64u);
}

TEST(SafetensorsFixture, SecondShardAndQuotedName) {
  REQUIRE_EDGE();
  auto f = SafetensorsFile::open(edge_dir() + "/model-00002-of-00002.safetensors");
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_TRUE(f->metadata().empty());
  const TensorView* w = f->find("weird\\name.\"with\"quotes");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(load<float>(w->data, 0), 1.0f);
  EXPECT_EQ(load<float>(w->data, 1), 2.0f);
  EXPECT_EQ(load<float>(w->data, 2), 3.0f);
  EXPECT_EQ(f->find("second.shard.f32")->shape, (std::vector<int64_t>{10, 10}));
  EXPECT_EQ(f->find("second.shard.u8")->nbytes, 300u);
  const auto hdr = SafetensorsFile::read_header(edge_dir() + "/model-00002-of-00002.safetensors");
  EXPECT_EQ(hdr.offsets, (std::vector<uint64_t>{0, 400, 700}));
  EXPECT_EQ(hdr.data_start, 8u + 253u);
}

TEST(SafetensorsFixture, AsCheckpointWithGeneratedIndex) {
  REQUIRE_EDGE();
  TempDir dir;  // symlinks to the fixture (nothing copied) plus an index we write
  const std::string s1 = "model-00001-of-00002.safetensors", s2 = "model-00002-of-00002.safetensors";
  std::filesystem::create_symlink(edge_dir() + "/" + s1, dir.file(s1));
  std::filesystem::create_symlink(edge_dir() + "/" + s2, dir.file(s2));
  std::vector<std::pair<std::string, std::string>> map;
  for (const char* n :
       {"plain.f32.2d", "plain.bf16.1d", "tricky.f16.1d", "packed.u8.2d", "scalar.f32", "empty.f32",
        "language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight_packed",
        "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed", "rank3.f32", "rank4.u8"})
    map.emplace_back(n, s1);
  for (const char* n : {"second.shard.f32", "second.shard.u8", "weird\\\\name.\\\"with\\\"quotes"})
    map.emplace_back(n, s2);
  dir.write_text("model.safetensors.index.json", index_json(map));

  auto c = Checkpoint::open(dir.path());
  EXPECT_EQ(c->tensor_count(), 13u);
  EXPECT_EQ(c->shard_paths().size(), 2u);
  // Byte totals from the fixture's header table.
  const auto by = c->bytes_by_dtype();
  EXPECT_EQ(by.at(DType::F32), 1024u + 4u + 0u + 96u + 400u + 12u);
  EXPECT_EQ(by.at(DType::BF16), 256u);
  EXPECT_EQ(by.at(DType::F16), 128u);
  EXPECT_EQ(by.at(DType::U8), 224u + 64u + 64u + 16u + 300u);
  EXPECT_EQ(c->total_tensor_bytes(), 1536u + 256u + 128u + 668u);
  EXPECT_EQ(load<float>(c->find("scalar.f32")->data, 0), 3.5f);

  std::filesystem::remove(dir.file(s2));
  auto h = Checkpoint::open_headers(dir.path());
  EXPECT_EQ(h->tensor_count(), 10u);
  ASSERT_EQ(h->missing_shards().size(), 1u);
  expect_k3_error([&] { Checkpoint::open(dir.path()); },
                  "shard 'model-00002-of-00002.safetensors' named in the index is missing");
}
