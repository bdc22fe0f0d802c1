#include "bindings.h"
#include "zcore/build_info.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_build_info(py::module_& m) {
  m.def("io_backend", &io_backend, "Backend of the I/O engine: 'libaio' or 'threadpool'.");
  m.def("compiler", &compiler, "Compiler the native core was built with.");
}

}  // namespace zcore::bindings
