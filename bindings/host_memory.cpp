#include <pybind11/stl.h>

#include "bindings.h"
#include "zcore/host_memory.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_host_memory(py::module_& m) {
  py::enum_<LockPolicy>(m, "LockPolicy")
      .value("NONE", LockPolicy::kNone)
      .value("TRY", LockPolicy::kTry)
      .value("REQUIRE", LockPolicy::kRequire);

  py::class_<HostMemoryStats>(m, "HostMemoryStats")
      .def_readonly("budget", &HostMemoryStats::budget)
      .def_readonly("used", &HostMemoryStats::used)
      .def_readonly("locked", &HostMemoryStats::locked)
      .def_readonly("peak", &HostMemoryStats::peak);

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol(),
                         "Aligned host memory owned by zcore; a writable 1-D byte buffer.")
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes())}, {py::ssize_t{1}});
      })
      .def_property_readonly("address", [](const HostBuffer& b) {
        return reinterpret_cast<std::uintptr_t>(b.data());
      })
      .def_property_readonly("nbytes", &HostBuffer::bytes)
      .def_property_readonly("locked", &HostBuffer::locked);

  py::class_<HostMemory>(m, "HostMemory", "Source of aligned host buffers within a byte budget.")
      .def(py::init<std::int64_t, LockPolicy>(), py::arg("budget"), py::arg("lock"))
      .def("allocate", &HostMemory::allocate, py::arg("bytes"), py::arg("alignment"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", &HostMemory::stats)
      .def_property_readonly("lock_policy", &HostMemory::lock_policy);
}

}  // namespace zcore::bindings
