// Page-locks host buffers for the CUDA driver (cudaHostRegister), so copies
// between them and device memory run by DMA at full PCIe/NVLink speed.
// HostBufferPool calls it once per buffer it allocates.
//
// Built without CUDA (host_register_absent.cpp), the constructor throws
// Error(kCudaUnavailable); callers create one only when a GPU is present.
#pragma once

#include <cstdint>

#include "zcore/buffer_pool.h"

namespace zcore::cuda {

class CudaHostRegistrar : public HostRegistrar {
 public:
  CudaHostRegistrar();  // requires a usable device
  void register_range(void* data, std::uint64_t bytes) override;  // kCudaError on failure
  void unregister_range(void* data) override;
};

}  // namespace zcore::cuda
