// The portable kernel level's register of 16 floats and its loads and stores
// (fp32, and bf16/fp16 through half_convert.h). Each kernel family's scalar
// traits class (adam_scalar.cpp, quantize_scalar.cpp) derives from ScalarIo
// and adds its arithmetic.
//
// Internal linkage, for the reason given in adam_simd.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "half_convert.h"

namespace zcore::simd {
namespace {

struct ScalarIo {
  static constexpr int kWidth = 16;
  struct F {
    float x[16];
  };

  template <class Op>
  static F map(Op op) {
    F r;
    for (int j = 0; j < kWidth; ++j) r.x[j] = op(j);
    return r;
  }

  static F load(const float* p) { return map([&](int j) { return p[j]; }); }
  static void store(float* p, F a) { std::memcpy(p, a.x, sizeof a.x); }
  static F load_bf16(const std::uint16_t* p) {
    return map([&](int j) { return bf16_to_float(p[j]); });
  }
  static F load_fp16(const std::uint16_t* p) {
    return map([&](int j) { return fp16_to_float(p[j]); });
  }
  static void store_bf16(std::uint16_t* p, F a) {
    for (int j = 0; j < kWidth; ++j) p[j] = float_to_bf16(a.x[j]);
  }
  static void store_fp16(std::uint16_t* p, F a) {
    for (int j = 0; j < kWidth; ++j) p[j] = float_to_fp16(a.x[j]);
  }
};

}  // namespace
}  // namespace zcore::simd
