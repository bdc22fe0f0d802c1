#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "zcore/aio_engine.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_aio_engine(py::module_& m) {
  py::enum_<IoBackend>(m, "IoBackend")
      .value("AUTO", IoBackend::kAuto)
      .value("LIBAIO", IoBackend::kLibaio)
      .value("THREADPOOL", IoBackend::kThreadPool);

  py::class_<AioConfig>(m, "AioConfig", "Settings of an I/O engine (see zcore/aio_engine.h).")
      .def(py::init<>())
      .def_readwrite("block_size", &AioConfig::block_size)
      .def_readwrite("queue_depth", &AioConfig::queue_depth)
      .def_readwrite("threads", &AioConfig::threads)
      .def_readwrite("backend", &AioConfig::backend)
      .def_readwrite("probe_directory", &AioConfig::probe_directory);

  py::class_<AioStats>(m, "AioStats")
      .def_readonly("requests", &AioStats::requests)
      .def_readonly("bytes_read", &AioStats::bytes_read)
      .def_readonly("bytes_written", &AioStats::bytes_written)
      .def_readonly("bounce_bytes", &AioStats::bounce_bytes)
      .def_readonly("page_cache_bytes", &AioStats::page_cache_bytes);

  py::class_<AioEngine>(m, "AioEngine", "Asynchronous file I/O on libaio or a thread pool.")
      .def(py::init(&AioEngine::create), py::arg("config"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](AioEngine& e, bool write, std::uintptr_t buffer, std::int64_t bytes,
             const std::string& path, std::int64_t offset) {
            return e.submit({write ? IoOp::kWrite : IoOp::kRead, reinterpret_cast<void*>(buffer),
                             bytes, path, offset});
          },
          py::arg("write"), py::arg("buffer"), py::arg("bytes"), py::arg("path"),
          py::arg("offset"), py::call_guard<py::gil_scoped_release>(),
          "Queues a read or write of `bytes` at host address `buffer`; returns a handle.")
      .def("poll", &AioEngine::poll, py::arg("handle"), "Whether the request has finished.")
      .def("wait", &AioEngine::wait, py::arg("handle"), py::call_guard<py::gil_scoped_release>(),
           "Waits for the request and raises its error.")
      .def("wait_all", &AioEngine::wait_all, py::call_guard<py::gil_scoped_release>(),
           "Waits for every request; raises the first error.")
      .def_property_readonly("pending", &AioEngine::pending)
      .def_property_readonly("backend", &AioEngine::backend)
      .def_property_readonly("backend_reason", &AioEngine::backend_reason)
      .def_property_readonly("config", &AioEngine::config)
      .def("stats", &AioEngine::stats);

  m.def("io_alignment", [] { return kIoAlignment; }, "O_DIRECT alignment of buffers and offsets.");
  m.def("libaio_compiled", &libaio_compiled, "Whether the libaio backend is compiled in.");
  m.def("direct_io_unsupported_reason", &direct_io_unsupported_reason, py::arg("directory"),
        py::call_guard<py::gil_scoped_release>(),
        "Why O_DIRECT cannot be used in `directory`, or '' when it can.");
}

}  // namespace zcore::bindings
