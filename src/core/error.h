// k3::Error: the one exception type for bad input (files, configs, flags, requests).
// Its message is a single line that names the problem; front ends print it and exit with
// exit_code() (2 for bad input). Never used for programming errors (those are asserts).
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

namespace k3 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, int exit_code = 2) : std::runtime_error(msg), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

[[noreturn]] void fail(const std::string& msg);

// Collects every problem found (e.g. all missing tensors) before failing once.
class ProblemList {
 public:
  void add(std::string problem) { problems_.push_back(std::move(problem)); }
  bool empty() const { return problems_.empty(); }
  size_t size() const { return problems_.size(); }
  const std::vector<std::string>& items() const { return problems_; }
  // Throws Error("<what>: N problem(s): p1; p2; ...") if any problem was recorded.
  void throw_if_any(const std::string& what) const;

 private:
  std::vector<std::string> problems_;
};

}  // namespace k3
