// Portable instantiation of the kernels in quantize_simd.h: a "register" is
// 16 elements processed one by one (the compiler may vectorize with the
// baseline ISA). The fp16 conversions are bit-exact software versions of
// F16C's, as in adam_scalar.cpp.
#include <cmath>

#include "quantize_simd.h"

namespace zcore::quantize_kernels {
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

// Half to even by exact arithmetic (floor and the fraction are exact), so
// the result does not depend on the FP environment's rounding mode, like the
// SIMD levels' explicit-rounding instructions.
float round_half_even(float t) {
  if (!(std::fabs(t) < 0x1.0p23f)) return t;  // already integral (or nan)
  const float down = std::floor(t);
  const float fraction = t - down;
  if (fraction > 0.5f) return down + 1.0f;
  if (fraction < 0.5f) return down;
  return std::fmod(down, 2.0f) == 0.0f ? down : down + 1.0f;
}

struct Scalar {
  static constexpr int kWidth = 16;
  struct F {
    float x[16];
  };
  struct I {
    std::int32_t x[16];
  };

  template <class Op>
  static F map(Op op) {
    F r;
    for (int j = 0; j < kWidth; ++j) r.x[j] = op(j);
    return r;
  }
  template <class Op>
  static I imap(Op op) {
    I r;
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
  static F mul(F a, F b) { return map([&](int j) { return a.x[j] * b.x[j]; }); }
  static F div(F a, F b) { return map([&](int j) { return a.x[j] / b.x[j]; }); }
  static F round_even(F a) { return map([&](int j) { return round_half_even(a.x[j]); }); }
  static F clamp(F a, float lo, float hi) {
    return map([&](int j) { return a.x[j] < lo ? lo : (a.x[j] > hi ? hi : a.x[j]); });
  }
  static I to_int(F a) { return imap([&](int j) { return static_cast<std::int32_t>(a.x[j]); }); }
  static F to_float(I a) { return map([&](int j) { return static_cast<float>(a.x[j]); }); }

  static I izero() { return imap([](int) { return 0; }); }
  // Magnitudes' bit patterns are non-negative as int32, ordered as the floats.
  static I max_abs_bits(I acc, F a) {
    return imap([&](int j) {
      const auto bits = static_cast<std::int32_t>(to_bits(a.x[j]) & 0x7FFFFFFFu);
      return acc.x[j] > bits ? acc.x[j] : bits;
    });
  }
  static std::int32_t reduce_max(I a) {
    std::int32_t m = a.x[0];
    for (int j = 1; j < kWidth; ++j) m = a.x[j] > m ? a.x[j] : m;
    return m;
  }

  static I load_int8(const std::int8_t* p) { return imap([&](int j) { return p[j]; }); }
  static void store_int8(std::int8_t* p, I q) {
    for (int j = 0; j < kWidth; ++j) p[j] = static_cast<std::int8_t>(q.x[j]);
  }
  // A nibble n in [0, 16) is the two's complement value n - 16 when n >= 8.
  static I load_int4(const std::uint8_t* p) {
    return imap([&](int j) {
      const int nibble = (p[j / 2] >> (4 * (j % 2))) & 0xF;
      return nibble >= 8 ? nibble - 16 : nibble;
    });
  }
  static void store_int4(std::uint8_t* p, I q) {
    for (int k = 0; k < kWidth / 2; ++k) {
      p[k] = static_cast<std::uint8_t>((q.x[2 * k] & 0xF) | ((q.x[2 * k + 1] & 0xF) << 4));
    }
  }
};

}  // namespace

Kernels scalar_kernels() { return kernels_of<Scalar>(); }

}  // namespace zcore::quantize_kernels
