// Element loads and stores by run-time dtype (a DType as int) for the device
// kernels of adam.cu and quantize.cu: the conversions give the CPU kernels'
// bits (bf16 and fp16 round to nearest even, bf16 nan is 0x7FC0).
//
// Internal linkage: each .cu file gets its own copy, inlined.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "zcore/dtype.h"

namespace zcore::cuda {
namespace {

__device__ __forceinline__ float load_as_float(const void* base, std::int64_t i, int dtype) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat32): return static_cast<const float*>(base)[i];
    case static_cast<int>(DType::kBFloat16):
      return __uint_as_float(static_cast<unsigned>(static_cast<const unsigned short*>(base)[i]) << 16);
    default: return __half2float(static_cast<const __half*>(base)[i]);
  }
}

// Round to nearest even as c10::BFloat16 (and the CPU kernels) do.
__device__ __forceinline__ unsigned short to_bf16(float x) {
  if (isnan(x)) return 0x7FC0;
  const unsigned w = __float_as_uint(x);
  return static_cast<unsigned short>((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

// Any other dtype (adam.cu's "no copy-out") stores nothing.
__device__ __forceinline__ void store_from_float(void* base, std::int64_t i, int dtype, float x) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat32): static_cast<float*>(base)[i] = x; break;
    case static_cast<int>(DType::kBFloat16): static_cast<unsigned short*>(base)[i] = to_bf16(x); break;
    case static_cast<int>(DType::kFloat16): static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    default: break;
  }
}

// Four consecutive elements from index i (a multiple of 4) in one access:
// 16 bytes of fp32 or 8 of bf16/fp16, so base must be aligned to that.
__device__ __forceinline__ void load4_as_float(const void* base, std::int64_t i, int dtype,
                                               float (&x)[4]) {
  if (dtype == static_cast<int>(DType::kFloat32)) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    return;
  }
  const ushort4 v = *reinterpret_cast<const ushort4*>(static_cast<const unsigned short*>(base) + i);
  const unsigned short h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = dtype == static_cast<int>(DType::kBFloat16)
               ? __uint_as_float(static_cast<unsigned>(h[k]) << 16)
               : __half2float(__ushort_as_half(h[k]));
  }
}

// The store of load4_as_float's layout; any other dtype stores nothing.
__device__ __forceinline__ void store4_from_float(void* base, std::int64_t i, int dtype,
                                                  const float (&x)[4]) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat32):
      *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = make_float4(x[0], x[1], x[2], x[3]);
      break;
    case static_cast<int>(DType::kBFloat16):
      *reinterpret_cast<ushort4*>(static_cast<unsigned short*>(base) + i) =
          make_ushort4(to_bf16(x[0]), to_bf16(x[1]), to_bf16(x[2]), to_bf16(x[3]));
      break;
    case static_cast<int>(DType::kFloat16):
      *reinterpret_cast<ushort4*>(static_cast<unsigned short*>(base) + i) =
          make_ushort4(__half_as_ushort(__float2half_rn(x[0])), __half_as_ushort(__float2half_rn(x[1])),
                       __half_as_ushort(__float2half_rn(x[2])), __half_as_ushort(__float2half_rn(x[3])));
      break;
    default: break;
  }
}

}  // namespace
}  // namespace zcore::cuda
