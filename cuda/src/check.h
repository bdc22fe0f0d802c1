// Turns a failed CUDA runtime call into Error(kCudaError), shared by the .cu
// files of zcore_cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "zcore/status.h"

namespace zcore::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(StatusCode::kCudaError,
                std::string(what) + " failed: " + cudaGetErrorName(err) + ": " +
                    cudaGetErrorString(err),
                {{"cuda_error", static_cast<std::int64_t>(err)}});
  }
}

}  // namespace zcore::cuda
