// The fused optimizer kernels on a CUDA device, with the semantics of
// zcore/adam.h: the same update in the same fp32 operation order (so the same
// bits as the CPU levels), the same validation, the same errors.
//
// Pointers are device pointers (the caller, Python, checks the device of
// every tensor); work is ordered on `stream` (torch's Stream.cuda_stream).
// Built without CUDA, both throw Error(kCudaUnavailable).
#pragma once

#include <cstdint>
#include <vector>

#include "zcore/adam.h"

namespace zcore::cuda {

// One launch for the whole list of tensors, whatever their number and sizes
// (their addresses travel to the device in one small copy).
void adam_step(const AdamOptions& options, const std::vector<AdamTensor>& tensors,
               std::uintptr_t stream);

// One launch for all buffers; waits for the stream to return the sums. The
// per-chunk partial sums are added on the host in a fixed order, so the
// result does not depend on scheduling (it may differ from the CPU's in the
// last bits: the order of the additions differs).
GradStats unscale_and_check(const std::vector<GradBuffer>& buffers, double scale,
                            bool write_back, std::uintptr_t stream);

}  // namespace zcore::cuda
