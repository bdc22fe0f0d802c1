#include <pybind11/stl.h>

#include <cstdint>
#include <memory>

#include "bindings.h"
#include "zcore/buffer_pool.h"
#include "zcore/cuda/host_register.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_buffer_pool(py::module_& m) {
  py::class_<HostRegistrar, std::shared_ptr<HostRegistrar>>(
      m, "HostRegistrar", "Registers host buffers with a device runtime.");
  py::class_<cuda::CudaHostRegistrar, HostRegistrar, std::shared_ptr<cuda::CudaHostRegistrar>>(
      m, "CudaHostRegistrar", "cudaHostRegister for pool buffers; needs a usable GPU.")
      .def(py::init<>());

  py::class_<BufferPoolStats>(m, "BufferPoolStats")
      .def_readonly("budget", &BufferPoolStats::budget)
      .def_readonly("held", &BufferPoolStats::held)
      .def_readonly("in_use", &BufferPoolStats::in_use)
      .def_readonly("buffers", &BufferPoolStats::buffers)
      .def_readonly("allocations", &BufferPoolStats::allocations)
      .def_readonly("reuses", &BufferPoolStats::reuses);

  py::class_<PooledBuffer>(m, "PooledBuffer", py::buffer_protocol(),
                           "A pool buffer on loan (writable bytes); returns to the pool when freed.")
      .def_buffer([](PooledBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(b.capacity())}, {py::ssize_t{1}});
      })
      .def_property_readonly("address", [](const PooledBuffer& b) {
        return reinterpret_cast<std::uintptr_t>(b.data());
      })
      .def_property_readonly("nbytes", &PooledBuffer::bytes)
      .def_property_readonly("capacity", &PooledBuffer::capacity)
      .def_property_readonly("locked", &PooledBuffer::locked);

  py::class_<HostBufferPool>(m, "HostBufferPool",
                             "Reusable aligned host staging buffers within a byte budget.")
      .def(py::init<std::int64_t, LockPolicy, std::shared_ptr<HostRegistrar>>(),
           py::arg("budget"), py::arg("lock"), py::arg("registrar") = nullptr)
      .def("acquire", &HostBufferPool::acquire, py::arg("bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("trim", &HostBufferPool::trim)
      .def("stats", &HostBufferPool::stats)
      .def_property_readonly("registered", &HostBufferPool::registered);
}

}  // namespace zcore::bindings
