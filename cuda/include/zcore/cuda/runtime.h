// The CUDA side of the native core as seen from plain C++: whether CUDA can
// be used in this process, and byte movement on device memory. Streams cross
// this boundary as integers (torch's `Stream.cuda_stream`).
//
// When zcore is built without CUDA these functions still exist: the queries
// answer "unavailable" and every entry point that needs a GPU throws
// Error(kCudaUnavailable), so the Python layer raises instead of crashing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zcore/allocator.h"

namespace zcore::cuda {

bool built_with_cuda();

// Number of usable devices; 0 when built without CUDA, without a driver, or
// without a GPU. Never throws.
int device_count();

// Why CUDA cannot be used here, or an empty string when it can.
std::string unavailable_reason();

// Throws Error(kCudaUnavailable) carrying unavailable_reason().
void require_available();

// Applies defragmentation moves inside a device arena, ordered on `stream`.
// Overlapping moves are split or staged so that no copy reads bytes an
// earlier copy of the same move has overwritten.
class DeviceByteMover : public ByteMover {
 public:
  DeviceByteMover(void* base, std::uintptr_t stream);
  void apply(const std::vector<Move>& moves) override;

 private:
  unsigned char* base_;
  std::uintptr_t stream_;
};

}  // namespace zcore::cuda
