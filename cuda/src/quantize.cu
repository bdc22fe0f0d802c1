// Blockwise int8/int4 quantize, dequantize and dequantize-add on a CUDA
// device.
//
// One warp per quantization block, in a grid-stride loop over blocks: the
// warp takes the block's maximum magnitude with shuffles, then encodes or
// decodes the block's elements (a lane per element, or per byte of int4
// codes). Blocks under 32 elements leave lanes idle.
//
// Every operation is an IEEE fp32 one (_rn intrinsics, rintf for round half
// to even), in the order of cpp/src/kernels/quantize_simd.h, so that codes, scales
// and decoded values are the CPU kernels' bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.h"
#include "convert.cuh"
#include "grid.h"
#include "zcore/cuda/quantize.h"
#include "zcore/cuda/runtime.h"
#include "zcore/status.h"

namespace zcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / 32;
constexpr unsigned kInfBits = 0x7F800000u;   // magnitudes' bit patterns from here are Inf or NaN
constexpr unsigned kQuietNan = 0x7FC00000u;  // the CPU kernels' NaN scale
// Inputs per dequantize_add launch: their addresses travel as a kernel
// argument (well under the 4 KiB limit); more inputs take more launches.
constexpr int kMaxInputsPerLaunch = 32;

struct InputBatch {
  const void* codes[kMaxInputsPerLaunch];
  const float* scales[kMaxInputsPerLaunch];
  int count;
};

template <int Bits>
__device__ __forceinline__ float max_code() {
  return Bits == 8 ? 127.0f : 7.0f;
}

template <int Bits>
__device__ __forceinline__ int encode(float x, float scale) {
  const float rounded = rintf(__fdiv_rn(x, scale));
  return static_cast<int>(fminf(fmaxf(rounded, -max_code<Bits>()), max_code<Bits>()));
}

// The code of element i (int8, or the sign-extended nibble of int4).
template <int Bits>
__device__ __forceinline__ int code_at(const void* codes, std::int64_t i) {
  if (Bits == 8) return static_cast<const signed char*>(codes)[i];
  const int byte = static_cast<const unsigned char*>(codes)[i / 2];
  const int nibble = (i % 2 == 0 ? byte : byte >> 4) & 0xF;
  return nibble >= 8 ? nibble - 16 : nibble;
}

struct WarpBlocks {
  std::int64_t first;   // this warp's first block
  std::int64_t stride;  // warps in the grid
  int lane;
};

__device__ __forceinline__ WarpBlocks warp_blocks() {
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  return WarpBlocks{warp, static_cast<std::int64_t>(gridDim.x) * kWarpsPerCta,
                    static_cast<int>(threadIdx.x % 32)};
}

template <int Bits>
__global__ void quantize_kernel(const void* input, int dtype, std::int64_t numel,
                                std::int64_t block, std::int64_t blocks, unsigned char* codes,
                                float* scales) {
  const WarpBlocks w = warp_blocks();
  for (std::int64_t b = w.first; b < blocks; b += w.stride) {
    const std::int64_t begin = b * block;
    const std::int64_t n = min(block, numel - begin);
    unsigned max_bits = 0;
    for (std::int64_t i = w.lane; i < n; i += 32) {
      max_bits = max(max_bits, __float_as_uint(load_as_float(input, begin + i, dtype)) & 0x7FFFFFFFu);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      max_bits = max(max_bits, __shfl_xor_sync(0xFFFFFFFFu, max_bits, offset));
    }
    const float scale = max_bits >= kInfBits ? __uint_as_float(kQuietNan)
                                             : __fdiv_rn(__uint_as_float(max_bits), max_code<Bits>());
    if (w.lane == 0) scales[b] = scale;
    const bool coded = scale > 0.0f;  // zeros, an underflowed scale, or a non-finite block: codes 0
    if (Bits == 8) {
      for (std::int64_t i = w.lane; i < n; i += 32) {
        const int q = coded ? encode<8>(load_as_float(input, begin + i, dtype), scale) : 0;
        codes[begin + i] = static_cast<unsigned char>(static_cast<signed char>(q));
      }
    } else {
      // Lane per byte; a block starts on a byte (block is even).
      for (std::int64_t j = w.lane; 2 * j < n; j += 32) {
        const std::int64_t i = begin + 2 * j;
        const int lo = coded ? encode<4>(load_as_float(input, i, dtype), scale) : 0;
        const int hi = coded && 2 * j + 1 < n ? encode<4>(load_as_float(input, i + 1, dtype), scale) : 0;
        codes[i / 2] = static_cast<unsigned char>((lo & 0xF) | ((hi & 0xF) << 4));
      }
    }
  }
}

template <int Bits>
__global__ void dequantize_kernel(const void* codes, const float* scales, std::int64_t numel,
                                  std::int64_t block, std::int64_t blocks, void* output,
                                  int dtype) {
  const WarpBlocks w = warp_blocks();
  for (std::int64_t b = w.first; b < blocks; b += w.stride) {
    const std::int64_t begin = b * block;
    const std::int64_t n = min(block, numel - begin);
    const float scale = scales[b];
    for (std::int64_t i = begin + w.lane; i < begin + n; i += 32) {
      store_from_float(output, i, dtype, __fmul_rn(static_cast<float>(code_at<Bits>(codes, i)), scale));
    }
  }
}

template <int Bits>
__global__ void dequantize_add_kernel(InputBatch inputs, std::int64_t numel, std::int64_t block,
                                      std::int64_t blocks, float* acc) {
  const WarpBlocks w = warp_blocks();
  for (std::int64_t b = w.first; b < blocks; b += w.stride) {
    const std::int64_t begin = b * block;
    const std::int64_t n = min(block, numel - begin);
    for (std::int64_t i = begin + w.lane; i < begin + n; i += 32) {
      float sum = acc[i];
      for (int k = 0; k < inputs.count; ++k) {
        const float x = __fmul_rn(static_cast<float>(code_at<Bits>(inputs.codes[k], i)),
                                  inputs.scales[k][b]);
        sum = __fadd_rn(sum, x);
      }
      acc[i] = sum;
    }
  }
}

// Enough warps to cover every block, up to 16 CTAs per multiprocessor.
int grid_for(std::int64_t blocks) {
  return grid_size((blocks + kWarpsPerCta - 1) / kWarpsPerCta, 16);
}

}  // namespace

void quantize(const QuantFormat& format, const void* input, DType input_dtype,
              std::int64_t numel, void* codes, float* scales, std::uintptr_t stream) {
  require_available();
  check_quantize_arguments(format, input, input_dtype, numel, codes, scales);
  if (numel == 0) return;
  const std::int64_t blocks = scale_count(format, numel);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* out = static_cast<unsigned char*>(codes);
  const int dtype = static_cast<int>(input_dtype);
  if (format.bits == 8) {
    quantize_kernel<8><<<grid_for(blocks), kThreads, 0, s>>>(input, dtype, numel, format.block,
                                                             blocks, out, scales);
  } else {
    quantize_kernel<4><<<grid_for(blocks), kThreads, 0, s>>>(input, dtype, numel, format.block,
                                                             blocks, out, scales);
  }
  check(cudaGetLastError(), "quantize_kernel launch");
}

void dequantize(const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
                void* output, DType output_dtype, std::uintptr_t stream) {
  require_available();
  check_dequantize_arguments(format, input, numel, output, output_dtype);
  if (numel == 0) return;
  const std::int64_t blocks = scale_count(format, numel);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const int dtype = static_cast<int>(output_dtype);
  if (format.bits == 8) {
    dequantize_kernel<8><<<grid_for(blocks), kThreads, 0, s>>>(
        input.codes, input.scales, numel, format.block, blocks, output, dtype);
  } else {
    dequantize_kernel<4><<<grid_for(blocks), kThreads, 0, s>>>(
        input.codes, input.scales, numel, format.block, blocks, output, dtype);
  }
  check(cudaGetLastError(), "dequantize_kernel launch");
}

void dequantize_add(const QuantFormat& format, const std::vector<QuantizedInput>& inputs,
                    std::int64_t numel, float* acc, std::uintptr_t stream) {
  require_available();
  check_dequantize_add_arguments(format, inputs, numel, acc);
  if (numel == 0) return;
  const std::int64_t blocks = scale_count(format, numel);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  // Batches in input order keep the additions in input order.
  for (std::size_t first = 0; first < inputs.size(); first += kMaxInputsPerLaunch) {
    InputBatch batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(kMaxInputsPerLaunch, inputs.size() - first));
    for (int k = 0; k < batch.count; ++k) {
      batch.codes[k] = inputs[first + k].codes;
      batch.scales[k] = inputs[first + k].scales;
    }
    if (format.bits == 8) {
      dequantize_add_kernel<8><<<grid_for(blocks), kThreads, 0, s>>>(batch, numel, format.block,
                                                                     blocks, acc);
    } else {
      dequantize_add_kernel<4><<<grid_for(blocks), kThreads, 0, s>>>(batch, numel, format.block,
                                                                     blocks, acc);
    }
    check(cudaGetLastError(), "dequantize_add_kernel launch");
  }
}

}  // namespace zcore::cuda
