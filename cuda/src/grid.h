// Grid sizing for the grid-stride kernels of zcore_cuda: one CTA per unit of
// work, capped at a few CTAs per multiprocessor of the current device (the
// kernels loop over the rest).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.h"

namespace zcore::cuda {

inline int grid_size(std::int64_t ctas, int max_ctas_per_sm) {
  int device = 0;
  int sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(multiProcessorCount)");
  return static_cast<int>(std::min<std::int64_t>(ctas, std::int64_t{sms} * max_ctas_per_sm));
}

}  // namespace zcore::cuda
