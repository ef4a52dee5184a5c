// k3::Error: the one exception type for bad input (files, configs, flags, requests), public so
// that API users can catch it. Its message is a single line that names the problem; front ends
// print it and exit with exit_code() (2 for bad input). Standard library only; never used for
// programming errors (those are asserts).
#pragma once
#include <stdexcept>
#include <string>

namespace k3 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, int exit_code = 2) : std::runtime_error(msg), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

}  // namespace k3
