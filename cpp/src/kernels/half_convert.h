// Bit-exact software conversions between fp32 and the 16-bit formats, used
// by the portable kernel level (simd_io_scalar.h). They give F16C's results
// (round to nearest even, subnormals kept, nan payload kept and made quiet)
// and c10::BFloat16's, so the scalar level matches the SIMD levels bit for bit.
//
// Internal linkage, for the reason given in adam_simd.h: the kernels' files
// are compiled with different target flags.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zcore::simd {
namespace {

inline float from_bits(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

inline std::uint32_t to_bits(float f) {
  std::uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// After Marat Dukhan's FP16 library (MIT): exact, with float arithmetic doing
// the renormalisation of subnormals.
inline float fp16_to_float(std::uint16_t h) {
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
inline std::uint16_t float_to_fp16(float f) {
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

inline float bf16_to_float(std::uint16_t h) {
  return from_bits(static_cast<std::uint32_t>(h) << 16);
}

// Round to nearest even as c10::BFloat16 does; every nan becomes 0x7FC0.
inline std::uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const std::uint32_t w = to_bits(f);
  return static_cast<std::uint16_t>((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

}  // namespace
}  // namespace zcore::simd
