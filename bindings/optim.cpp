// Fused optimizer kernels (CPU and CUDA). Pointers arrive as integers
// (tensor.data_ptr()); zcore.optim validates the tensors before calling.
#include <pybind11/stl.h>

#include "bindings.h"
#include "zcore/adam.h"
#include "zcore/cpu_isa.h"
#include "zcore/cuda/adam.h"

namespace py = pybind11;

namespace zcore::bindings {
namespace {

template <class T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void bind_optim(py::module_& m) {
  py::enum_<DType>(m, "DType")
      .value("FLOAT32", DType::kFloat32)
      .value("BFLOAT16", DType::kBFloat16)
      .value("FLOAT16", DType::kFloat16);

  py::enum_<CpuIsa>(m, "CpuIsa")
      .value("SCALAR", CpuIsa::kScalar)
      .value("AVX2", CpuIsa::kAvx2)
      .value("AVX512", CpuIsa::kAvx512);
  m.def("cpu_isa_name", &cpu_isa_name, py::arg("isa"));
  m.def("parse_cpu_isa", &parse_cpu_isa, py::arg("name"));
  m.def("cpu_isa_supported", &cpu_isa_supported, py::arg("isa"),
        "Whether this build and CPU can run the level.");
  m.def("best_cpu_isa", &best_cpu_isa, "The highest level this CPU supports.");
  m.def("active_cpu_isa", &active_cpu_isa,
        "The level the CPU kernels use (ZCORE_CPU_ISA or the best one).");
  m.def("set_cpu_isa", &set_cpu_isa, py::arg("isa"), "Forces a level for later kernel calls.");

  py::class_<AdamOptions>(m, "AdamOptions", "Hyper-parameters of one Adam/AdamW step.")
      .def(py::init<>())
      .def_readwrite("lr", &AdamOptions::lr)
      .def_readwrite("beta1", &AdamOptions::beta1)
      .def_readwrite("beta2", &AdamOptions::beta2)
      .def_readwrite("eps", &AdamOptions::eps)
      .def_readwrite("weight_decay", &AdamOptions::weight_decay)
      .def_readwrite("decoupled_weight_decay", &AdamOptions::decoupled_weight_decay)
      .def_readwrite("step", &AdamOptions::step)
      .def_readwrite("grad_scale", &AdamOptions::grad_scale);

  py::class_<AdamTensor>(m, "AdamTensor", "Addresses of one tensor's buffers (0 = no copy-out).")
      .def(py::init([](std::uintptr_t params, std::uintptr_t grads, DType grad_dtype,
                       std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::int64_t numel,
                       std::uintptr_t params_out, DType out_dtype, DType param_dtype,
                       DType state_dtype) {
             AdamTensor t;
             t.params = as_ptr<void>(params);
             t.param_dtype = param_dtype;
             t.grads = as_ptr<const void>(grads);
             t.grad_dtype = grad_dtype;
             t.exp_avg = as_ptr<void>(exp_avg);
             t.exp_avg_sq = as_ptr<void>(exp_avg_sq);
             t.state_dtype = state_dtype;
             t.params_out = as_ptr<void>(params_out);
             t.out_dtype = out_dtype;
             t.numel = numel;
             return t;
           }),
           py::arg("params"), py::arg("grads"), py::arg("grad_dtype"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("numel"), py::arg("params_out") = 0,
           py::arg("out_dtype") = DType::kBFloat16, py::arg("param_dtype") = DType::kFloat32,
           py::arg("state_dtype") = DType::kFloat32);

  py::class_<GradBuffer>(m, "GradBuffer", "Address, dtype and length of a gradient buffer.")
      .def(py::init([](std::uintptr_t data, DType dtype, std::int64_t numel) {
             return GradBuffer{as_ptr<void>(data), dtype, numel};
           }),
           py::arg("data"), py::arg("dtype"), py::arg("numel"));

  py::class_<GradStats>(m, "GradStats")
      .def_readonly("nonfinite", &GradStats::nonfinite)
      .def_readonly("sum_sq", &GradStats::sum_sq)
      .def_readonly("buffer_sum_sq", &GradStats::buffer_sum_sq);

  m.def("adam_step", &adam_step, py::arg("options"), py::arg("tensors"), py::arg("threads"),
        py::call_guard<py::gil_scoped_release>(),
        "One fused Adam/AdamW step over CPU buffers on `threads` threads.");
  m.def("unscale_and_check", &unscale_and_check, py::arg("buffers"), py::arg("scale"),
        py::arg("write_back"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
        "Scale CPU gradients, detect inf/nan and sum squares in double.");
  m.def("cuda_adam_step", &cuda::adam_step, py::arg("options"), py::arg("tensors"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "One multi-tensor Adam/AdamW launch over device buffers, ordered on `stream`.");
  m.def("cuda_unscale_and_check", &cuda::unscale_and_check, py::arg("buffers"), py::arg("scale"),
        py::arg("write_back"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "unscale_and_check on device buffers; waits for `stream`.");
}

}  // namespace zcore::bindings
