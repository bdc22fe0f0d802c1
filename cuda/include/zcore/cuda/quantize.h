// Blockwise int8/int4 quantization on a CUDA device, with the format,
// special blocks, validation and errors of zcore/quantize.h.
//
// Codes and scales are the same bits as the CPU kernels' (the same IEEE fp32
// operations, the block maximum taken on bit patterns), and so are decoded
// values, except the bits of a NaN: a GPU rank and a CPU rank agree.
//
// Pointers are device pointers (the caller, Python, checks the device of
// every tensor); work is ordered on `stream` (torch's Stream.cuda_stream) and
// the calls return without waiting for it. Built without CUDA, or without a
// usable GPU, every call throws Error(kCudaUnavailable).
#pragma once

#include <cstdint>
#include <vector>

#include "zcore/quantize.h"

namespace zcore::cuda {

void quantize(const QuantFormat& format, const void* input, DType input_dtype,
              std::int64_t numel, void* codes, float* scales, std::uintptr_t stream);

void dequantize(const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
                void* output, DType output_dtype, std::uintptr_t stream);

// One launch for every input; their addresses travel to the device in one
// small stream-ordered copy.
void dequantize_add(const QuantFormat& format, const std::vector<QuantizedInput>& inputs,
                    std::int64_t numel, float* acc, std::uintptr_t stream);

}  // namespace zcore::cuda
