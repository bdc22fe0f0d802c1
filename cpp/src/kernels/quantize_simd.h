// The quantization kernels, written once over a SIMD traits class V and
// instantiated by each per-ISA translation unit (quantize_scalar.cpp,
// quantize_avx2.cpp, quantize_avx512.cpp).
//
// Internal linkage throughout, for the reason given in adam_simd.h: each file
// is compiled with its own target flags. The files are compiled with
// -ffp-contract=off, and every element goes through the same IEEE operations
// (divide, round half to even, clamp, multiply, add) on every level; the
// block maximum is an integer maximum over the magnitudes' bit patterns,
// which does not depend on the order of the lanes. So every level gives the
// same bits.
//
// V provides: kWidth (elements per register, even), F (kWidth floats) and I
// (kWidth int32) register types; load/load_bf16/load_fp16 and
// store/store_bf16/store_fp16 (round to nearest even; these from
// simd_io_*.h); set1, div, mul, add; round_even (half to even, whatever the
// FP environment's rounding mode), clamp(x, lo, hi), to_int (of an integral
// float), to_float;
// izero, max_abs_bits(acc, x) (lane-wise max of acc and x's bits with the
// sign cleared), reduce_max; load_int8/store_int8 (kWidth codes) and
// load_int4/store_int4 (kWidth / 2 bytes, low nibble first).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "quantize_kernels.h"
#include "simd_elements.h"

namespace zcore::quantize_kernels {
namespace {

// Bit patterns at or above this (with the sign cleared) are Inf or NaN.
constexpr std::uint32_t kInfBits = 0x7F800000u;

template <int Bits>
constexpr float max_code() {
  return Bits == 8 ? 127.0f : 7.0f;
}

// Bytes holding `count` codes that start at an even element.
template <int Bits>
constexpr std::int64_t code_bytes(std::int64_t count) {
  return Bits == 8 ? count : (count + 1) / 2;
}

template <int Bits>
unsigned char* codes_at(void* codes, std::int64_t element) {
  return static_cast<unsigned char*>(codes) + (Bits == 8 ? element : element / 2);
}

template <int Bits>
const unsigned char* codes_at(const void* codes, std::int64_t element) {
  return static_cast<const unsigned char*>(codes) + (Bits == 8 ? element : element / 2);
}

template <class V, int Bits>
typename V::I load_codes(const unsigned char* p) {
  if constexpr (Bits == 8) {
    return V::load_int8(reinterpret_cast<const std::int8_t*>(p));
  } else {
    return V::load_int4(p);
  }
}

template <class V, int Bits>
void store_codes(unsigned char* p, typename V::I q) {
  if constexpr (Bits == 8) {
    V::store_int8(reinterpret_cast<std::int8_t*>(p), q);
  } else {
    V::store_int4(p, q);
  }
}

// The codes of the `count` (< kWidth) elements at `element`, zero-padded to
// a register: tails run through the same vector code as full registers.
template <class V, int Bits>
typename V::I load_codes_partial(const void* codes, std::int64_t element, std::int64_t count) {
  alignas(64) unsigned char padded[V::kWidth] = {};
  std::memcpy(padded, codes_at<Bits>(codes, element), code_bytes<Bits>(count));
  return load_codes<V, Bits>(padded);
}

// Elements [begin, begin + n) of one block of `input`.
template <class V, class T, int Bits>
void quantize_block(const void* input, std::int64_t begin, std::int64_t n, void* codes,
                    float* scale_out) {
  using F = typename V::F;
  const std::int64_t full = n / V::kWidth * V::kWidth;
  const std::int64_t tail = n - full;
  alignas(64) unsigned char padded_input[V::kWidth * 4] = {};  // zeros leave the maximum alone
  if (tail > 0) {
    std::memcpy(padded_input,
                static_cast<const unsigned char*>(input) + (begin + full) * simd::element_size<T>(),
                tail * simd::element_size<T>());
  }

  typename V::I acc = V::izero();
  for (std::int64_t i = 0; i < full; i += V::kWidth) {
    acc = V::max_abs_bits(acc, simd::load_as_float<V, T>(input, begin + i));
  }
  if (tail > 0) acc = V::max_abs_bits(acc, simd::load_as_float<V, T>(padded_input, 0));
  const auto max_bits = static_cast<std::uint32_t>(V::reduce_max(acc));

  float scale = 0.0f;
  if (max_bits >= kInfBits) {
    scale = std::numeric_limits<float>::quiet_NaN();
  } else {
    float max_abs;
    std::memcpy(&max_abs, &max_bits, 4);
    scale = max_abs / max_code<Bits>();
  }
  *scale_out = scale;
  if (!(scale > 0.0f)) {  // zeros, an underflowed scale, or a non-finite block
    std::memset(codes_at<Bits>(codes, begin), 0, code_bytes<Bits>(n));
    return;
  }

  const F divisor = V::set1(scale);
  const auto encode = [&](F x) {
    const F rounded = V::round_even(V::div(x, divisor));
    return V::to_int(V::clamp(rounded, -max_code<Bits>(), max_code<Bits>()));
  };
  for (std::int64_t i = 0; i < full; i += V::kWidth) {
    store_codes<V, Bits>(codes_at<Bits>(codes, begin + i),
                         encode(simd::load_as_float<V, T>(input, begin + i)));
  }
  if (tail > 0) {
    alignas(64) unsigned char padded_codes[V::kWidth] = {};
    store_codes<V, Bits>(padded_codes, encode(simd::load_as_float<V, T>(padded_input, 0)));
    std::memcpy(codes_at<Bits>(codes, begin + full), padded_codes, code_bytes<Bits>(tail));
  }
}

template <class V, class T, int Bits>
void quantize_typed(const QuantFormat& f, const void* input, std::int64_t numel, void* codes,
                    float* scales, std::int64_t first_block, std::int64_t last_block) {
  for (std::int64_t b = first_block; b < last_block; ++b) {
    const std::int64_t begin = b * f.block;
    const std::int64_t n = numel - begin < f.block ? numel - begin : f.block;
    quantize_block<V, T, Bits>(input, begin, n, codes, scales + b);
  }
}

template <class V, class T>
void quantize_input(const QuantFormat& f, const void* input, std::int64_t numel, void* codes,
                    float* scales, std::int64_t first_block, std::int64_t last_block) {
  if (f.bits == 8) {
    quantize_typed<V, T, 8>(f, input, numel, codes, scales, first_block, last_block);
  } else {
    quantize_typed<V, T, 4>(f, input, numel, codes, scales, first_block, last_block);
  }
}

template <class V>
void quantize_range(const QuantFormat& f, const void* input, DType input_dtype,
                    std::int64_t numel, void* codes, float* scales, std::int64_t first_block,
                    std::int64_t last_block) {
  switch (input_dtype) {
    case DType::kFloat32:
      quantize_input<V, float>(f, input, numel, codes, scales, first_block, last_block);
      break;
    case DType::kBFloat16:
      quantize_input<V, simd::Bf16>(f, input, numel, codes, scales, first_block, last_block);
      break;
    case DType::kFloat16:
      quantize_input<V, simd::Fp16>(f, input, numel, codes, scales, first_block, last_block);
      break;
  }
}

template <class V, class O, int Bits>
void dequantize_block(const void* codes, float scale, std::int64_t begin, std::int64_t n,
                      void* output) {
  using F = typename V::F;
  const F factor = V::set1(scale);
  const auto decode = [&](typename V::I q) { return V::mul(V::to_float(q), factor); };
  const std::int64_t full = n / V::kWidth * V::kWidth;
  for (std::int64_t i = 0; i < full; i += V::kWidth) {
    simd::store_from_float<V, O>(output, begin + i,
                                 decode(load_codes<V, Bits>(codes_at<Bits>(codes, begin + i))));
  }
  const std::int64_t tail = n - full;
  if (tail == 0) return;
  alignas(64) unsigned char padded_output[V::kWidth * 4];
  simd::store_from_float<V, O>(padded_output, 0,
                               decode(load_codes_partial<V, Bits>(codes, begin + full, tail)));
  std::memcpy(static_cast<unsigned char*>(output) + (begin + full) * simd::element_size<O>(),
              padded_output, tail * simd::element_size<O>());
}

template <class V, class O, int Bits>
void dequantize_typed(const QuantFormat& f, const QuantizedInput& in, std::int64_t numel,
                      void* output, std::int64_t first_block, std::int64_t last_block) {
  for (std::int64_t b = first_block; b < last_block; ++b) {
    const std::int64_t begin = b * f.block;
    const std::int64_t n = numel - begin < f.block ? numel - begin : f.block;
    dequantize_block<V, O, Bits>(in.codes, in.scales[b], begin, n, output);
  }
}

template <class V, class O>
void dequantize_output(const QuantFormat& f, const QuantizedInput& in, std::int64_t numel,
                       void* output, std::int64_t first_block, std::int64_t last_block) {
  if (f.bits == 8) {
    dequantize_typed<V, O, 8>(f, in, numel, output, first_block, last_block);
  } else {
    dequantize_typed<V, O, 4>(f, in, numel, output, first_block, last_block);
  }
}

template <class V>
void dequantize_range(const QuantFormat& f, const QuantizedInput& in, std::int64_t numel,
                      void* output, DType output_dtype, std::int64_t first_block,
                      std::int64_t last_block) {
  switch (output_dtype) {
    case DType::kFloat32:
      dequantize_output<V, float>(f, in, numel, output, first_block, last_block);
      break;
    case DType::kBFloat16:
      dequantize_output<V, simd::Bf16>(f, in, numel, output, first_block, last_block);
      break;
    case DType::kFloat16:
      dequantize_output<V, simd::Fp16>(f, in, numel, output, first_block, last_block);
      break;
  }
}

// One block of the accumulator: each register is loaded once, gets every
// input added in input order, and is stored once.
template <class V, int Bits>
void dequantize_add_block(const std::vector<QuantizedInput>& inputs, std::int64_t b,
                          std::int64_t begin, std::int64_t n, float* acc) {
  using F = typename V::F;
  const auto add_inputs = [&](F sum, std::int64_t element, std::int64_t count) {
    for (const QuantizedInput& in : inputs) {
      const typename V::I q = count == V::kWidth
                                  ? load_codes<V, Bits>(codes_at<Bits>(in.codes, element))
                                  : load_codes_partial<V, Bits>(in.codes, element, count);
      sum = V::add(sum, V::mul(V::to_float(q), V::set1(in.scales[b])));
    }
    return sum;
  };
  const std::int64_t full = n / V::kWidth * V::kWidth;
  for (std::int64_t i = 0; i < full; i += V::kWidth) {
    V::store(acc + begin + i, add_inputs(V::load(acc + begin + i), begin + i, V::kWidth));
  }
  const std::int64_t tail = n - full;
  if (tail == 0) return;
  alignas(64) float padded_acc[V::kWidth] = {};
  std::memcpy(padded_acc, acc + begin + full, tail * 4);
  V::store(padded_acc, add_inputs(V::load(padded_acc), begin + full, tail));
  std::memcpy(acc + begin + full, padded_acc, tail * 4);
}

template <class V, int Bits>
void dequantize_add_typed(const QuantFormat& f, const std::vector<QuantizedInput>& inputs,
                          std::int64_t numel, float* acc, std::int64_t first_block,
                          std::int64_t last_block) {
  for (std::int64_t b = first_block; b < last_block; ++b) {
    const std::int64_t begin = b * f.block;
    const std::int64_t n = numel - begin < f.block ? numel - begin : f.block;
    dequantize_add_block<V, Bits>(inputs, b, begin, n, acc);
  }
}

template <class V>
void dequantize_add_range(const QuantFormat& f, const std::vector<QuantizedInput>& inputs,
                          std::int64_t numel, float* acc, std::int64_t first_block,
                          std::int64_t last_block) {
  if (f.bits == 8) {
    dequantize_add_typed<V, 8>(f, inputs, numel, acc, first_block, last_block);
  } else {
    dequantize_add_typed<V, 4>(f, inputs, numel, acc, first_block, last_block);
  }
}

template <class V>
Kernels kernels_of() {
  static_assert(V::kWidth % 2 == 0, "int4 registers hold whole bytes");
  return Kernels{&quantize_range<V>, &dequantize_range<V>, &dequantize_add_range<V>};
}

}  // namespace
}  // namespace zcore::quantize_kernels
