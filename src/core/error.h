// Error helpers: fail() and ProblemList around k3::Error, whose definition is public
// (include/k3/error.h: a single-line message naming the problem, exit_code() 2 for bad input).
// Never used for programming errors (those are asserts).
#pragma once
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "k3/error.h"

namespace k3 {

[[noreturn]] void fail(const std::string& msg);

// Collects every problem found (e.g. all missing tensors) before failing once.
class ProblemList {
 public:
  void add(std::string problem) { problems_.push_back(std::move(problem)); }
  bool empty() const { return problems_.empty(); }
  size_t size() const { return problems_.size(); }
  const std::vector<std::string>& items() const { return problems_; }
  // Throws Error("<what>: N problem(s): p1; p2; ...") if any problem was recorded; past 8 problems
  // only the first 8 are listed, then "; and M more".
  void throw_if_any(const std::string& what) const;

 private:
  std::vector<std::string> problems_;
};

}  // namespace k3
