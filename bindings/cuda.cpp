#include <pybind11/stl.h>

#include "bindings.h"
#include "zcore/cuda/runtime.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_cuda(py::module_& m) {
  m.def("cuda_built", &cuda::built_with_cuda, "Whether the CUDA sources were compiled in.");
  m.def("cuda_device_count", &cuda::device_count, "Usable CUDA devices (0 without driver/GPU).");
  m.def("cuda_unavailable_reason", &cuda::unavailable_reason,
        "Why CUDA cannot be used, or '' when it can.");
}

}  // namespace zcore::bindings
