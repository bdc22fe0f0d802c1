#include <pybind11/stl.h>

#include <cstdint>

#include "bindings.h"
#include "zcore/swap_manager.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_swap_manager(py::module_& m) {
  py::enum_<SwapState>(m, "SwapState")
      .value("WRITING", SwapState::kWriting)
      .value("ON_DISK", SwapState::kOnDisk)
      .value("READING", SwapState::kReading);

  py::class_<SwapConfig>(m, "SwapConfig", "Settings of a swap manager (see zcore/swap_manager.h).")
      .def(py::init<>())
      .def_readwrite("directory", &SwapConfig::directory)
      .def_readwrite("rank", &SwapConfig::rank)
      .def_readwrite("name", &SwapConfig::name,
                     "Purpose tag in the swap file's name ([A-Za-z0-9_], may be empty).")
      .def_readwrite("capacity", &SwapConfig::capacity)
      .def_readwrite("io", &SwapConfig::io);

  py::class_<SwapExtent>(m, "SwapExtent")
      .def_readonly("offset", &SwapExtent::offset)
      .def_readonly("bytes", &SwapExtent::bytes);

  py::class_<SwapStats>(m, "SwapStats")
      .def_readonly("capacity", &SwapStats::capacity)
      .def_readonly("used", &SwapStats::used)
      .def_readonly("largest_free", &SwapStats::largest_free)
      .def_readonly("entries", &SwapStats::entries)
      .def_readonly("bytes_swapped_out", &SwapStats::bytes_swapped_out)
      .def_readonly("bytes_swapped_in", &SwapStats::bytes_swapped_in)
      .def_readonly("leftover_bytes_removed", &SwapStats::leftover_bytes_removed);

  py::class_<SwapManager>(m, "SwapManager", "Swap file of one rank: extents and async I/O by id.")
      .def(py::init<const SwapConfig&>(), py::arg("config"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "swap_out",
          [](SwapManager& s, SwapId id, std::uintptr_t data, std::int64_t bytes) {
            s.swap_out(id, reinterpret_cast<const void*>(data), bytes);
          },
          py::arg("id"), py::arg("data"), py::arg("bytes"),
          py::call_guard<py::gil_scoped_release>(),
          "Starts writing `bytes` at host address `data` to the extent of `id`.")
      .def(
          "swap_in",
          [](SwapManager& s, SwapId id, std::uintptr_t data, std::int64_t bytes) {
            s.swap_in(id, reinterpret_cast<void*>(data), bytes);
          },
          py::arg("id"), py::arg("data"), py::arg("bytes"),
          py::call_guard<py::gil_scoped_release>(),
          "Starts reading the bytes of `id` into host address `data`.")
      .def("poll", &SwapManager::poll, py::arg("id"))
      .def("wait", &SwapManager::wait, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &SwapManager::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("release", &SwapManager::release, py::arg("id"))
      .def("contains", &SwapManager::contains, py::arg("id"))
      .def("state", &SwapManager::state, py::arg("id"))
      .def("extent", &SwapManager::extent, py::arg("id"))
      .def("ids", &SwapManager::ids)
      .def("stats", &SwapManager::stats)
      .def_property_readonly("path", &SwapManager::path)
      .def_property_readonly("leftovers_removed", &SwapManager::leftovers_removed,
                             "Leftover swap files of dead processes removed by the constructor.")
      .def_property_readonly("backend", [](const SwapManager& s) { return s.engine().backend(); })
      .def("close", &SwapManager::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace zcore::bindings
