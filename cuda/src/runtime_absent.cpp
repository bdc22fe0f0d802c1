// The CUDA entry points of a build without CUDA: they report why and throw.
#include <string>

#include "zcore/cuda/runtime.h"
#include "zcore/status.h"

namespace zcore::cuda {

bool built_with_cuda() { return false; }

int device_count() { return 0; }

std::string unavailable_reason() {
  return "zcore was built without CUDA (no nvcc at build time); rebuild with nvcc on PATH "
         "or -DZCORE_CUDA=ON";
}

void require_available() {
  throw Error(StatusCode::kCudaUnavailable, "CUDA is unavailable: " + unavailable_reason());
}

DeviceByteMover::DeviceByteMover(void* base, std::uintptr_t stream)
    : base_(static_cast<unsigned char*>(base)), stream_(stream) {
  require_available();
}

void DeviceByteMover::apply(const std::vector<Move>&) { require_available(); }

}  // namespace zcore::cuda
