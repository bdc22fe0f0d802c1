#include <cuda_runtime.h>

#include <string>

#include "zcore/cuda/host_register.h"
#include "zcore/cuda/runtime.h"
#include "zcore/status.h"

namespace zcore::cuda {

CudaHostRegistrar::CudaHostRegistrar() { require_available(); }

void CudaHostRegistrar::register_range(void* data, std::uint64_t bytes) {
  const cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(StatusCode::kCudaError,
                std::string("cudaHostRegister of ") + std::to_string(bytes) +
                    " bytes failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err) +
                    "; lower the host buffer budget or raise the locked-memory limit (ulimit -l)",
                {{"cuda_error", static_cast<std::int64_t>(err)},
                 {"bytes", static_cast<std::int64_t>(bytes)}});
  }
}

void CudaHostRegistrar::unregister_range(void* data) {
  // Called while buffers are freed, where there is nobody to report to; a
  // failure here only means the driver already dropped the registration.
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

}  // namespace zcore::cuda
