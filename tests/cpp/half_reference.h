// Reference fp16/bf16 conversions for the kernel tests, written independently
// of the kernels' bit tricks: bf16 by exact arithmetic on the value, fp16 by
// the compiler's IEEE conversion (_Float16).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zcore::testing_support {

inline std::uint32_t float_bits(float f) {
  std::uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

inline float bits_to_float(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

inline float bf16_to_float(std::uint16_t h) {
  return bits_to_float(static_cast<std::uint32_t>(h) << 16);
}

// Round to nearest even by exact arithmetic on the value: the two bf16
// neighbours and the distance to each.
inline std::uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const std::uint32_t w = float_bits(f);
  const auto down = static_cast<std::uint16_t>(w >> 16);
  const auto up = static_cast<std::uint16_t>(down + 1);
  if ((w & 0xFFFF) == 0) return down;
  const double lo = bf16_to_float(down);
  const double hi = std::isinf(lo) ? lo : static_cast<double>(bf16_to_float(up));
  const double x = f;
  const double d_lo = std::fabs(x - lo);
  const double d_hi = std::isinf(hi) ? std::ldexp(1.0, 128) - std::fabs(x) : std::fabs(hi - x);
  if (d_lo < d_hi) return down;
  if (d_hi < d_lo) return up;
  return (down & 1) ? up : down;
}

inline float fp16_to_float(std::uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline std::uint16_t reference_fp16(float f) {
  const _Float16 x = static_cast<_Float16>(f);  // the compiler's IEEE conversion
  std::uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

}  // namespace zcore::testing_support
