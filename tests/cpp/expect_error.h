// Helpers for tests that expect a zcore::Error: run a callable, return what
// it threw, and record a test failure when it threw nothing.
#pragma once

#include <gtest/gtest.h>

#include <functional>

#include "zcore/status.h"

namespace zcore::testing_support {

inline Error error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a zcore::Error";
  return Error(StatusCode::kSystemError, "no error was thrown");
}

inline StatusCode code_of(const std::function<void()>& f) { return error_of(f).code(); }

}  // namespace zcore::testing_support
