// Rate / latency parsing and short human forms (see units.h).
// Must not: accept a unit it does not name in its error message.
#include "plan/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace k3::plan {

namespace {

// Leading decimal number of `text` (digits and one '.'), or NaN when there is none; `used` its length.
double leading_number(const std::string& text, size_t* used) {
  size_t i = 0;
  bool dot = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || (text[i] == '.' && !dot))) {
    dot = dot || text[i] == '.';
    ++i;
  }
  *used = i;
  if (i == 0 || (i == 1 && dot)) return NAN;
  return std::stod(text.substr(0, i));
}

std::string three_digits(double v, const char* unit) {
  char buf[64];
  const double a = std::fabs(v);
  std::snprintf(buf, sizeof buf, a >= 100 ? "%.0f %s" : a >= 10 ? "%.1f %s" : "%.2f %s", v, unit);
  return buf;
}

std::string scaled(double v, const char* const* units, const char* suffix) {
  static const double kScale[] = {1, 1e3, 1e6, 1e9, 1e12, 1e15};
  int u = 0;
  while (u < 5 && std::fabs(v) >= 1000 * kScale[u]) ++u;
  return three_digits(v / kScale[u], (std::string(units[u]) + suffix).c_str());
}

}  // namespace

double parse_rate(const std::string& text, const std::string& what) {
  const auto bad = [&]() -> double {
    fail(what + " must be a rate like 55G or 4.8T (bytes/s, decimal units K/M/G/T), got '" + text + "'");
  };
  if (!text.empty() && text[0] == '-') fail(what + " must be positive (bytes/s), got '" + text + "'");
  size_t used = 0;
  const double v = leading_number(text, &used);
  if (!std::isfinite(v) || v <= 0) return bad();
  std::string u = text.substr(used);
  for (auto& c : u) c = char(std::toupper(static_cast<unsigned char>(c)));
  for (const char* tail : {"B/S", "/S", "B"})
    if (u.size() >= std::char_traits<char>::length(tail) &&
        u.compare(u.size() - std::char_traits<char>::length(tail), std::string::npos, tail) == 0) {
      u.resize(u.size() - std::char_traits<char>::length(tail));
      break;
    }
  double mul = 0;
  if (u.empty())
    mul = 1;
  else if (u == "K")
    mul = 1e3;
  else if (u == "M")
    mul = 1e6;
  else if (u == "G")
    mul = 1e9;
  else if (u == "T")
    mul = 1e12;
  else
    return bad();
  const double r = v * mul;
  if (!std::isfinite(r) || r > 1e16) return bad();
  return r;
}

double parse_micros(const std::string& text, const std::string& what) {
  if (!text.empty() && text[0] == '-') fail(what + " must be positive (microseconds), got '" + text + "'");
  size_t used = 0;
  const double v = leading_number(text, &used);
  std::string rest = text.substr(used);
  if (rest == "us") rest.clear();
  if (!std::isfinite(v) || v <= 0 || !rest.empty() || v > 1e7)
    fail(what + " must be a positive number of microseconds like 15 or 2.5, got '" + text + "'");
  return v;
}

std::string human_rate(double bps) {
  static const char* const kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  return scaled(bps, kUnits, "/s");
}

std::string human_dec_bytes(double b) {
  static const char* const kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  return scaled(b, kUnits, "");
}

std::string human_flops(double f) {
  static const char* const kUnits[] = {"FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"};
  return scaled(f, kUnits, "/s");
}

std::string human_seconds(double s) {
  if (s >= 1) return three_digits(s, "s");
  if (s >= 1e-3) return three_digits(s * 1e3, "ms");
  return three_digits(s * 1e6, "us");
}

}  // namespace k3::plan
