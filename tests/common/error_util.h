// k3::Error capture for tests: the message of the error f() throws, checked to be a k3::Error
// with exit code 2 (bad input). Test-only.
#pragma once
#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "core/error.h"

namespace k3test {

// The k3::Error message of f(), or a test failure (with `when_nothing`) when f() throws nothing,
// or something other than a k3::Error.
template <class F>
std::string error_of_call(F&& f, const char* when_nothing = "no k3::Error was thrown") {
  try {
    f();
  } catch (const k3::Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << when_nothing;
  return "";
}

}  // namespace k3test
