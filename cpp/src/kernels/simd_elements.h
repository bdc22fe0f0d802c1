// The element types of the kernels' buffers as compile-time tags (float for
// fp32, Bf16, Fp16), and one register's load and store by element type over
// a kernel level's traits class V (see simd_io_*.h). Shared by adam_simd.h
// and quantize_simd.h.
//
// Internal linkage, for the reason given in adam_simd.h.
#pragma once

#include <cstdint>
#include <type_traits>

namespace zcore::simd {
namespace {

struct Bf16 {};  // element tags for the 16-bit formats
struct Fp16 {};

template <class T>
constexpr std::int64_t element_size() {
  return std::is_same_v<T, float> ? 4 : 2;
}

template <class V, class T>
typename V::F load_as_float(const void* base, std::int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return V::load(static_cast<const float*>(base) + i);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return V::load_bf16(static_cast<const std::uint16_t*>(base) + i);
  } else {
    return V::load_fp16(static_cast<const std::uint16_t*>(base) + i);
  }
}

template <class V, class T>
void store_from_float(void* base, std::int64_t i, typename V::F x) {
  if constexpr (std::is_same_v<T, float>) {
    V::store(static_cast<float*>(base) + i, x);
  } else if constexpr (std::is_same_v<T, Bf16>) {
    V::store_bf16(static_cast<std::uint16_t*>(base) + i, x);
  } else {
    static_assert(std::is_same_v<T, Fp16>, "T is float, Bf16 or Fp16");
    V::store_fp16(static_cast<std::uint16_t*>(base) + i, x);
  }
}

}  // namespace
}  // namespace zcore::simd
