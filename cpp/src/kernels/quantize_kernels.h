// Internal interface between quantize.cpp (validation, threading, dispatch)
// and the per-ISA translation units quantize_scalar.cpp, quantize_avx2.cpp
// and quantize_avx512.cpp, each compiled with its own target flags.
#pragma once

#include <cstdint>
#include <vector>

#include "zcore/quantize.h"

namespace zcore::quantize_kernels {

// Each function runs the quantization blocks [first_block, last_block) of
// one validated call; the last block of the buffer may be partial.
using QuantizeFn = void (*)(const QuantFormat&, const void* input, DType input_dtype,
                            std::int64_t numel, void* codes, float* scales,
                            std::int64_t first_block, std::int64_t last_block);
using DequantizeFn = void (*)(const QuantFormat&, const QuantizedInput&, std::int64_t numel,
                              void* output, DType output_dtype, std::int64_t first_block,
                              std::int64_t last_block);
using DequantizeAddFn = void (*)(const QuantFormat&, const std::vector<QuantizedInput>&,
                                 std::int64_t numel, float* acc, std::int64_t first_block,
                                 std::int64_t last_block);

struct Kernels {
  QuantizeFn quantize;
  DequantizeFn dequantize;
  DequantizeAddFn dequantize_add;
};

Kernels scalar_kernels();
#if defined(ZCORE_X86_KERNELS)
Kernels avx2_kernels();
Kernels avx512_kernels();
#endif

}  // namespace zcore::quantize_kernels
