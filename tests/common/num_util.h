// Small numeric helpers shared by tests: seeded random fills (non-zero), NaN pre-fill checks,
// relative-L2 error and elementwise abs+rel closeness with a readable report of the worst element.
// Owns: nothing the engine uses; test-only.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace k3test {

inline float qnan() { return std::numeric_limits<float>::quiet_NaN(); }

// Uniform in ±[lo, hi] with a random sign: never zero, never denormal.
inline std::vector<float> rand_vec(std::mt19937& rng, size_t n, float lo = 0.05f, float hi = 1.0f) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = sign(rng) ? mag(rng) : -mag(rng);
  return v;
}

inline std::vector<float> nan_vec(size_t n) { return std::vector<float>(n, qnan()); }

// Number of NaN entries (an output still NaN after the call was never written).
inline size_t count_nan(const std::vector<float>& v) {
  size_t n = 0;
  for (float x : v) n += std::isnan(x) ? 1 : 0;
  return n;
}

// ||a - b|| / ||b||, computed in double. b is the reference.
inline double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_l2(a.data(), b.data(), std::min(a.size(), b.size()));
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// Elementwise |a - e| <= abs_tol + rel_tol·|e| (e = expected). Returns a failure message naming the
// worst offender, or success. NaN in `a` always fails.
inline ::testing::AssertionResult all_close(const float* a, const float* e, size_t n, double abs_tol, double rel_tol) {
  size_t bad = 0, worst = 0;
  double worst_ratio = 0, max_err = 0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(double(a[i]) - double(e[i]));
    const double allow = abs_tol + rel_tol * std::fabs(double(e[i]));
    const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity() : err / allow;
    max_err = std::max(max_err, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
    if (!(err <= allow)) ++bad;
    if (ratio > worst_ratio || i == 0) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess() << "max abs err " << max_err;
  std::ostringstream os;
  os.precision(9);
  os << bad << "/" << n << " elements outside abs " << abs_tol << " + rel " << rel_tol << "; worst at [" << worst
     << "]: got " << a[worst] << " expected " << e[worst] << " (max abs err " << max_err << ", rel-L2 "
     << rel_l2(a, e, n) << ")";
  return ::testing::AssertionFailure() << os.str();
}
inline ::testing::AssertionResult all_close(const std::vector<float>& a, const std::vector<float>& e, double abs_tol,
                                            double rel_tol) {
  if (a.size() != e.size())
    return ::testing::AssertionFailure() << "size mismatch: got " << a.size() << " expected " << e.size();
  return all_close(a.data(), e.data(), a.size(), abs_tol, rel_tol);
}

}  // namespace k3test
