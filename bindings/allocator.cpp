#include <pybind11/stl.h>

#include <memory>

#include "bindings.h"
#include "zcore/allocator.h"
#include "zcore/cuda/runtime.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_allocator(py::module_& m) {
  py::class_<Move>(m, "Move", "One compaction move: bytes at src go to dst (dst < src).")
      .def_readonly("src", &Move::src)
      .def_readonly("dst", &Move::dst)
      .def_readonly("bytes", &Move::bytes);

  py::class_<BlockInfo>(m, "BlockInfo", "A live or free range of the arena (handle 0 = free).")
      .def_readonly("offset", &BlockInfo::offset)
      .def_readonly("bytes", &BlockInfo::bytes)
      .def_readonly("handle", &BlockInfo::handle);

  py::class_<AllocatorStats>(m, "AllocatorStats")
      .def_readonly("capacity", &AllocatorStats::capacity)
      .def_readonly("used", &AllocatorStats::used)
      .def_readonly("free", &AllocatorStats::free)
      .def_readonly("largest_free", &AllocatorStats::largest_free)
      .def_readonly("live_blocks", &AllocatorStats::live_blocks)
      .def_readonly("free_blocks", &AllocatorStats::free_blocks)
      .def_readonly("fragmentation", &AllocatorStats::fragmentation)
      .def_readonly("peak_used", &AllocatorStats::peak_used)
      .def_readonly("allocations", &AllocatorStats::allocations)
      .def_readonly("defragmentations", &AllocatorStats::defragmentations)
      .def_readonly("bytes_moved", &AllocatorStats::bytes_moved);

  py::class_<ContiguousAllocator>(m, "ContiguousAllocator",
                                  "Best-fit offset bookkeeping inside one fixed-size arena.")
      .def(py::init<std::int64_t>(), py::arg("capacity"),
           "Bookkeeping only: defragment() returns moves for the caller to apply.")
      .def_static(
          "over_host",
          [](std::int64_t capacity, std::uintptr_t base) {
            return std::make_unique<ContiguousAllocator>(
                capacity, std::make_unique<HostByteMover>(reinterpret_cast<void*>(base)));
          },
          py::arg("capacity"), py::arg("base"),
          "Arena over host memory at address `base`; moves bytes with memmove and "
          "compacts automatically when a request fits only after compaction.")
      .def_static(
          "over_device",
          [](std::int64_t capacity, std::uintptr_t base, std::uintptr_t stream) {
            return std::make_unique<ContiguousAllocator>(
                capacity,
                std::make_unique<cuda::DeviceByteMover>(reinterpret_cast<void*>(base), stream));
          },
          py::arg("capacity"), py::arg("base"), py::arg("stream"),
          "Arena over device memory at `base`; moves are ordered on CUDA `stream`.")
      .def("allocate", &ContiguousAllocator::allocate, py::arg("bytes"), py::arg("alignment"),
           py::call_guard<py::gil_scoped_release>())
      .def("free", &ContiguousAllocator::free, py::arg("handle"))
      .def("offset", &ContiguousAllocator::offset, py::arg("handle"))
      .def("size", &ContiguousAllocator::size, py::arg("handle"))
      .def("defragment", &ContiguousAllocator::defragment,
           py::call_guard<py::gil_scoped_release>())
      .def("stats", &ContiguousAllocator::stats)
      .def("blocks", &ContiguousAllocator::blocks)
      .def_property_readonly("generation", &ContiguousAllocator::generation)
      .def_property_readonly("capacity", &ContiguousAllocator::capacity)
      .def_property_readonly("moves_bytes", &ContiguousAllocator::moves_bytes);
}

}  // namespace zcore::bindings
