// The CUDA optimizer kernels of a build without CUDA: they report why and throw.
#include "zcore/cuda/adam.h"
#include "zcore/cuda/runtime.h"

namespace zcore::cuda {

void adam_step(const AdamOptions&, const std::vector<AdamTensor>&, std::uintptr_t) {
  require_available();
}

GradStats unscale_and_check(const std::vector<GradBuffer>&, double, bool, std::uintptr_t) {
  require_available();
  return {};
}

}  // namespace zcore::cuda
