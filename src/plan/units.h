// Units of `k3 plan`: rates in bytes/s with decimal K/M/G/T suffixes ("55G" = 55e9 B/s, the way
// datasheets quote GB/s), latencies in microseconds, and the short human forms the report prints.
// Sizes are not parsed here: they use k3::parse_size (runtime/memory.h, binary units, as --ram-budget).
// Must not: know about models or machines.
#pragma once
#include <cstdint>
#include <string>

namespace k3::plan {

// "55G", "4.8T", "400G", "7.5GB/s", "900M/s": bytes per second, decimal units (K/M/G/T = 1e3..1e12),
// an optional "B", "/s" or "B/s" after the unit. k3::Error "<what> must be a rate like 55G or 4.8T
// (bytes/s, decimal units), got '<text>'" on junk, on zero and on negative values.
double parse_rate(const std::string& text, const std::string& what);

// A positive decimal number of microseconds ("15", "2.5"); k3::Error naming `what` otherwise.
double parse_micros(const std::string& text, const std::string& what);

// "4.80 TB/s", "55.0 GB/s", "640 MB/s" (decimal, 3 significant digits).
std::string human_rate(double bytes_per_s);
// "1.56 TB", "111.2 GB", "17.5 MB" (decimal bytes, as rates are; the report also prints GiB where
// sizes are compared with parse_size budgets).
std::string human_dec_bytes(double bytes);
// "989 TFLOP/s", "53.1 TFLOP/s", "120 GFLOP/s".
std::string human_flops(double flops_per_s);
// "42.1 ms", "310 us", "1.25 s".
std::string human_seconds(double s);

}  // namespace k3::plan
