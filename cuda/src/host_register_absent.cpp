// Host registration in a build without CUDA: it cannot be created.
#include "zcore/cuda/host_register.h"
#include "zcore/cuda/runtime.h"

namespace zcore::cuda {

CudaHostRegistrar::CudaHostRegistrar() { require_available(); }

void CudaHostRegistrar::register_range(void*, std::uint64_t) { require_available(); }

void CudaHostRegistrar::unregister_range(void*) {}

}  // namespace zcore::cuda
