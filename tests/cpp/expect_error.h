// Helpers for tests that expect a zcore::Error: run a callable, return what
// it threw (or its code, or check it is an invalid argument), and record a
// test failure when it threw nothing.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

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

// Expects kInvalidArgument with `fragment` in the message.
inline void expect_invalid(const std::function<void()>& f, const std::string& fragment) {
  const Error e = error_of(f);
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
      << "message '" << e.what() << "' lacks '" << fragment << "'";
}

}  // namespace zcore::testing_support
