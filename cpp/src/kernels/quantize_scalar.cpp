// Portable instantiation of the kernels in quantize_simd.h: a "register" is
// 16 elements processed one by one (the compiler may vectorize with the
// baseline ISA); loads and stores, with the bit-exact fp16/bf16 conversions,
// come from simd_io_scalar.h.
#include <cmath>

#include "quantize_simd.h"
#include "simd_io_scalar.h"

namespace zcore::quantize_kernels {
namespace {

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

struct Scalar : simd::ScalarIo {
  struct I {
    std::int32_t x[16];
  };

  template <class Op>
  static I imap(Op op) {
    I r;
    for (int j = 0; j < kWidth; ++j) r.x[j] = op(j);
    return r;
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
      const auto bits = static_cast<std::int32_t>(simd::to_bits(a.x[j]) & 0x7FFFFFFFu);
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
