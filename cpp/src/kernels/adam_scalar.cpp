// Portable instantiation of the kernels in adam_simd.h: a "register" is 16
// floats processed one by one (the compiler may vectorize with the baseline
// ISA); loads and stores, with the bit-exact fp16/bf16 conversions, come
// from simd_io_scalar.h.
#include <cmath>

#include "adam_simd.h"
#include "simd_io_scalar.h"

namespace zcore::adam_kernels {
namespace {

struct Scalar : simd::ScalarIo {
  static constexpr int kDPerBlock = 16;
  using D = double;

  static F set1(float a) { return map([&](int) { return a; }); }
  static F add(F a, F b) { return map([&](int j) { return a.x[j] + b.x[j]; }); }
  static F sub(F a, F b) { return map([&](int j) { return a.x[j] - b.x[j]; }); }
  static F mul(F a, F b) { return map([&](int j) { return a.x[j] * b.x[j]; }); }
  static F div(F a, F b) { return map([&](int j) { return a.x[j] / b.x[j]; }); }
  static F sqrt(F a) { return map([&](int j) { return std::sqrt(a.x[j]); }); }
  static F fma(F a, F b, F c) { return map([&](int j) { return std::fma(a.x[j], b.x[j], c.x[j]); }); }

  static D dzero() { return 0.0; }
  static void add_squares(D* acc, F a, int /*part: always 0, one register per block*/) {
    for (int j = 0; j < kWidth; ++j) {
      const double d = a.x[j];
      acc[j] += d * d;
    }
  }
  static void store_lanes(const D* acc, double* lanes) {
    for (int j = 0; j < kDPerBlock; ++j) lanes[j] = acc[j];
  }
};

}  // namespace

Kernels scalar_kernels() { return kernels_of<Scalar>(); }

}  // namespace zcore::adam_kernels
