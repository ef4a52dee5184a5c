// Helpers for the CUDA device tests: skip when no GPU is usable, upload/download of vectors and
// weight matrices, and fixture paths that can be moved at run time (the test binary is built here
// and run on the GPU machine from another folder: K3_SOURCE_DIR / K3_SHARED_DIR env override).
// Owns: nothing the engine uses; test-only.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "ops/cuda/runtime.h"
#include "ops/weight.h"

namespace k3test {

#define K3_REQUIRE_GPU()                                                                         \
  do {                                                                                           \
    if (k3::cuda::device_count() == 0)                                                           \
      GTEST_SKIP() << "no usable CUDA GPU (" << k3::cuda::unavailable_reason() << "); skipping"; \
  } while (0)

inline std::filesystem::path env_or(const char* var, const char* compiled) {
  if (const char* e = std::getenv(var); e && *e) return e;
  return compiled;
}
inline std::filesystem::path source_dir() { return env_or("K3_SOURCE_DIR", K3_SOURCE_DIR); }
inline std::filesystem::path shared_dir_rt() { return env_or("K3_SHARED_DIR", K3_SHARED_DIR); }

// A device copy of a host vector (freed with the DevBuf).
template <class T>
k3::cuda::DevBuf to_dev(const std::vector<T>& v, const char* what = "test buffer") {
  k3::cuda::DevBuf b(v.size() * sizeof(T), what);
  k3::cuda::h2d(b.get(), v.data(), v.size() * sizeof(T));
  k3::cuda::sync();
  return b;
}
// A device buffer of n floats filled with NaN (to check every output element gets written).
inline k3::cuda::DevBuf dev_nan(size_t n) {
  return to_dev(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()), "nan-filled output");
}
template <class T>
std::vector<T> from_dev(const k3::cuda::DevBuf& b, size_t n) {
  std::vector<T> v(n);
  k3::cuda::d2h(v.data(), b.get(), n * sizeof(T));
  return v;
}

// A device copy of a host WeightMat (data + MXFP4 scales); keeps its buffers alive.
struct DevWeight {
  k3::cuda::DevBuf data, scales;
  k3::WeightMat view;
};
inline size_t weight_data_bytes(const k3::WeightMat& w) {
  switch (w.fmt) {
    case k3::WFormat::F32:
      return size_t(w.rows * w.cols) * 4;
    case k3::WFormat::F16:
    case k3::WFormat::BF16:
      return size_t(w.rows * w.cols) * 2;
    case k3::WFormat::MXFP4:
      return size_t(w.rows * w.cols / 2);
    case k3::WFormat::FP8:  // the codes (the GPU form's scales: upload_weight)
      return size_t(w.rows * w.cols);
  }
  return 0;
}
inline DevWeight upload_weight(const k3::WeightMat& w) {
  DevWeight d;
  const size_t n = weight_data_bytes(w);
  d.data = k3::cuda::DevBuf(n, "test weight");
  k3::cuda::h2d(d.data.get(), w.data, n);
  d.view = w;
  d.view.data = d.data.get();
  if (w.fmt == k3::WFormat::MXFP4) {
    const size_t ns = size_t(w.rows * (w.cols / 32));
    d.scales = k3::cuda::DevBuf(ns, "test weight scales");
    k3::cuda::h2d(d.scales.get(), w.scales, ns);
    d.view.scales = d.scales.as<uint8_t>();
  }
  if (w.fmt == k3::WFormat::FP8) {  // the GPU form (weight.h): fp32 scales per row and 128 columns
    std::vector<float> table(size_t(w.rows * k3::fp8_block_cols(w.cols)));
    k3::fp8_row_scale_table(w, table.data());
    d.scales = k3::cuda::DevBuf(table.size() * 4, "test weight scales");
    k3::cuda::h2d(d.scales.get(), table.data(), table.size() * 4);
    k3::cuda::sync();
    d.view.scales = d.scales.as<uint8_t>();
    d.view.block_scales = nullptr;
    d.view.row0 = 0;
  }
  k3::cuda::sync();
  return d;
}

}  // namespace k3test
