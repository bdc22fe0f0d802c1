// Portable instantiation of the kernels in adam_simd.h: a "register" is 16
// floats processed one by one (the compiler may vectorize with the baseline
// ISA). The fp16 conversions are the bit-exact software versions of F16C's
// (round to nearest even, subnormals kept, nan payload kept and made quiet).
#include <cmath>

#include "adam_simd.h"

namespace zcore::adam_kernels {
namespace {

float from_bits(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

std::uint32_t to_bits(float f) {
  std::uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// After Marat Dukhan's FP16 library (MIT): exact, with float arithmetic doing
// the renormalisation of subnormals.
float fp16_to_float(std::uint16_t h) {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const std::uint32_t magnitude =
      two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized);
  return from_bits(sign | magnitude);
}

// Rounds to nearest even through float arithmetic: adding a power of two
// chosen from the exponent leaves exactly the fp16 mantissa bits, rounded.
std::uint16_t float_to_fp16(float f) {
  const float scaled = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const std::uint32_t w = to_bits(f);
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const std::uint32_t bits = to_bits(from_bits((bias >> 1) + 0x07800000u) + scaled);
  const std::uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const std::uint32_t nan = 0x7E00u | ((w >> 13) & 0x03FFu);  // F16C: quiet, payload truncated
  return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

std::uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const std::uint32_t w = to_bits(f);
  return static_cast<std::uint16_t>((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

struct Scalar {
  static constexpr int kWidth = 16;
  static constexpr int kDPerBlock = 16;
  struct F {
    float x[16];
  };
  using D = double;

  template <class Op>
  static F map(Op op) {
    F r;
    for (int j = 0; j < kWidth; ++j) r.x[j] = op(j);
    return r;
  }

  static F load(const float* p) { return map([&](int j) { return p[j]; }); }
  static void store(float* p, F a) { std::memcpy(p, a.x, sizeof a.x); }
  static F load_bf16(const std::uint16_t* p) {
    return map([&](int j) { return from_bits(static_cast<std::uint32_t>(p[j]) << 16); });
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
