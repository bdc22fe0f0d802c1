#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "zcore native core: allocator, host memory, CUDA runtime queries, optimizer and quantization "
      "kernels, ZeRO-3 parameter coordinator, I/O engine, swap";
  zcore::bindings::bind_errors(m);
  zcore::bindings::bind_build_info(m);
  zcore::bindings::bind_allocator(m);
  zcore::bindings::bind_host_memory(m);
  zcore::bindings::bind_cuda(m);
  zcore::bindings::bind_optim(m);
  zcore::bindings::bind_quantize(m);
  zcore::bindings::bind_coordinator(m);
  zcore::bindings::bind_aio_engine(m);
  zcore::bindings::bind_buffer_pool(m);
  zcore::bindings::bind_swap_manager(m);
}
