// One bind_* function per native component; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace zcore::bindings {

void bind_errors(pybind11::module_& m);
void bind_build_info(pybind11::module_& m);
void bind_allocator(pybind11::module_& m);
void bind_host_memory(pybind11::module_& m);
void bind_cuda(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_quantize(pybind11::module_& m);
void bind_coordinator(pybind11::module_& m);
void bind_aio_engine(pybind11::module_& m);
void bind_buffer_pool(pybind11::module_& m);
void bind_swap_manager(pybind11::module_& m);

}  // namespace zcore::bindings
