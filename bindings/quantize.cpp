// Blockwise int8/int4 quantization kernels (CPU and CUDA). Pointers arrive as
// integers (tensor.data_ptr()); zcore.quantization validates the tensors
// before calling.
#include <pybind11/stl.h>

#include "bindings.h"
#include "zcore/cuda/quantize.h"
#include "zcore/quantize.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_quantize(py::module_& m) {
  py::class_<QuantFormat>(m, "QuantFormat", "Bits per code (8 or 4) and elements per scale.")
      .def(py::init([](int bits, std::int64_t block) { return QuantFormat{bits, block}; }),
           py::arg("bits"), py::arg("block"))
      .def_readonly("bits", &QuantFormat::bits)
      .def_readonly("block", &QuantFormat::block);

  py::class_<QuantizedInput>(m, "QuantizedInput", "Addresses of one buffer's codes and scales.")
      .def(py::init([](std::uintptr_t codes, std::uintptr_t scales) {
             return QuantizedInput{reinterpret_cast<const void*>(codes),
                                   reinterpret_cast<const float*>(scales)};
           }),
           py::arg("codes"), py::arg("scales"));

  m.def("check_quant_format", &check_quant_format, py::arg("format"),
        "Raises InvalidArgumentError unless bits is 8 or 4 and block fits it.");
  m.def("quantized_bytes", &quantized_bytes, py::arg("format"), py::arg("numel"),
        "Bytes of codes for numel elements.");
  m.def("scale_count", &scale_count, py::arg("format"), py::arg("numel"),
        "Scales (blocks) for numel elements.");

  m.def(
      "quantize",
      [](const QuantFormat& format, std::uintptr_t input, DType input_dtype, std::int64_t numel,
         std::uintptr_t codes, std::uintptr_t scales, int threads) {
        quantize(format, reinterpret_cast<const void*>(input), input_dtype, numel,
                 reinterpret_cast<void*>(codes), reinterpret_cast<float*>(scales), threads);
      },
      py::arg("format"), py::arg("input"), py::arg("input_dtype"), py::arg("numel"),
      py::arg("codes"), py::arg("scales"), py::arg("threads"),
      py::call_guard<py::gil_scoped_release>(),
      "Quantize a CPU buffer into codes and per-block scales on `threads` threads.");
  m.def(
      "dequantize",
      [](const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
         std::uintptr_t output, DType output_dtype, int threads) {
        dequantize(format, input, numel, reinterpret_cast<void*>(output), output_dtype, threads);
      },
      py::arg("format"), py::arg("input"), py::arg("numel"), py::arg("output"),
      py::arg("output_dtype"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
      "Decode CPU codes and scales into an fp32/bf16/fp16 buffer.");
  m.def(
      "dequantize_add",
      [](const QuantFormat& format, const std::vector<QuantizedInput>& inputs, std::int64_t numel,
         std::uintptr_t acc, int threads) {
        dequantize_add(format, inputs, numel, reinterpret_cast<float*>(acc), threads);
      },
      py::arg("format"), py::arg("inputs"), py::arg("numel"), py::arg("acc"), py::arg("threads"),
      py::call_guard<py::gil_scoped_release>(),
      "Add the decoded inputs, in order, into an fp32 CPU accumulator.");

  m.def(
      "cuda_quantize",
      [](const QuantFormat& format, std::uintptr_t input, DType input_dtype, std::int64_t numel,
         std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t stream) {
        cuda::quantize(format, reinterpret_cast<const void*>(input), input_dtype, numel,
                       reinterpret_cast<void*>(codes), reinterpret_cast<float*>(scales), stream);
      },
      py::arg("format"), py::arg("input"), py::arg("input_dtype"), py::arg("numel"),
      py::arg("codes"), py::arg("scales"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>(), "quantize on device buffers, ordered on `stream`.");
  m.def(
      "cuda_dequantize",
      [](const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
         std::uintptr_t output, DType output_dtype, std::uintptr_t stream) {
        cuda::dequantize(format, input, numel, reinterpret_cast<void*>(output), output_dtype,
                         stream);
      },
      py::arg("format"), py::arg("input"), py::arg("numel"), py::arg("output"),
      py::arg("output_dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "dequantize on device buffers, ordered on `stream`.");
  m.def(
      "cuda_dequantize_add",
      [](const QuantFormat& format, const std::vector<QuantizedInput>& inputs, std::int64_t numel,
         std::uintptr_t acc, std::uintptr_t stream) {
        cuda::dequantize_add(format, inputs, numel, reinterpret_cast<float*>(acc), stream);
      },
      py::arg("format"), py::arg("inputs"), py::arg("numel"), py::arg("acc"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>(),
      "dequantize_add on device buffers, ordered on `stream`.");
}

}  // namespace zcore::bindings
