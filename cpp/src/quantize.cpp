#include "zcore/quantize.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "kernel_checks.h"
#include "kernels/quantize_kernels.h"
#include "zcore/cpu_isa.h"
#include "zcore/status.h"
#include "zcore/thread_pool.h"

namespace zcore {
namespace {

using kernel_checks::ByteRange;
using kernel_checks::byte_range;
using kernel_checks::check_disjoint;
using kernel_checks::check_pointer;
using kernel_checks::check_threads;
using kernel_checks::indexed;
using kernel_checks::invalid;
using quantize_kernels::Kernels;

// Elements per task, rounded to whole blocks (at least one): as in adam.cpp,
// large next to the cost of handing out a task, small enough to balance.
constexpr std::int64_t kChunk = 1 << 16;

Kernels kernels_for(CpuIsa isa) {
  switch (isa) {
#if defined(ZCORE_X86_KERNELS)
    case CpuIsa::kAvx512: return quantize_kernels::avx512_kernels();
    case CpuIsa::kAvx2: return quantize_kernels::avx2_kernels();
#endif
    default: return quantize_kernels::scalar_kernels();
  }
}

void check_numel(std::int64_t numel) {
  if (numel < 0) invalid("numel=" + std::to_string(numel) + " is negative", {{"numel", numel}});
}

void check_dtype(DType dtype, const std::string& name) {
  if (dtype_size(dtype) == 0) {
    invalid(name + ": unsupported dtype " + std::to_string(static_cast<int>(dtype)) +
                "; use float32, bfloat16 or float16",
            {{"name", name}});
  }
}

// The codes and scales of one quantized buffer, checked and named.
std::pair<ByteRange, ByteRange> check_quantized(const QuantFormat& format, const void* codes,
                                                const float* scales, std::int64_t numel,
                                                const std::string& name) {
  check_pointer(codes, 1, name + ".codes");
  check_pointer(scales, 4, name + ".scales");
  return {byte_range(name + ".codes", codes, quantized_bytes(format, numel)),
          byte_range(name + ".scales", scales, scale_count(format, numel) * 4)};
}

// Runs kernel(first_block, last_block) over every block, whole blocks per task.
template <class Kernel>
void for_blocks(const QuantFormat& format, std::int64_t numel, int threads, Kernel kernel) {
  const std::int64_t blocks = scale_count(format, numel);
  const std::int64_t per_task = std::max<std::int64_t>(1, kChunk / format.block);
  const std::int64_t tasks = (blocks + per_task - 1) / per_task;
  parallel_for(tasks, threads, [&](std::int64_t k) {
    kernel(k * per_task, std::min(blocks, (k + 1) * per_task));
  });
}

}  // namespace

void check_quant_format(const QuantFormat& format) {
  if (format.bits != 8 && format.bits != 4) {
    invalid("bits=" + std::to_string(format.bits) + " is not supported; use 8 (int8) or 4 (int4)",
            {{"bits", std::int64_t{format.bits}}});
  }
  if (format.block < 1) {
    invalid("block=" + std::to_string(format.block) + " must be >= 1 (elements per scale)",
            {{"block", format.block}});
  }
  if (format.bits == 4 && format.block % 2 != 0) {
    invalid("block=" + std::to_string(format.block) +
                " must be even for 4 bits: two codes share a byte and every block starts on one",
            {{"block", format.block}, {"bits", std::int64_t{4}}});
  }
}

std::int64_t quantized_bytes(const QuantFormat& format, std::int64_t numel) {
  check_quant_format(format);
  check_numel(numel);
  return format.bits == 8 ? numel : numel / 2 + numel % 2;
}

std::int64_t scale_count(const QuantFormat& format, std::int64_t numel) {
  check_quant_format(format);
  check_numel(numel);
  return numel / format.block + (numel % format.block != 0 ? 1 : 0);
}

// In the checks below, what a call writes must not share bytes with what it
// reads: a block would read codes, scales or inputs that another block has
// already overwritten.
void check_quantize_arguments(const QuantFormat& format, const void* input, DType input_dtype,
                              std::int64_t numel, const void* codes, const float* scales) {
  check_quant_format(format);
  check_numel(numel);
  check_dtype(input_dtype, "input");
  if (numel == 0) return;
  check_pointer(input, dtype_size(input_dtype), "input");
  const auto [codes_range, scales_range] = check_quantized(format, codes, scales, numel, "output");
  const ByteRange input_range = byte_range("input", input, numel * dtype_size(input_dtype));
  check_disjoint(codes_range, input_range);
  check_disjoint(scales_range, input_range);
  check_disjoint(codes_range, scales_range);
}

void check_dequantize_arguments(const QuantFormat& format, const QuantizedInput& input,
                                std::int64_t numel, const void* output, DType output_dtype) {
  check_quant_format(format);
  check_numel(numel);
  check_dtype(output_dtype, "output");
  if (numel == 0) return;
  const auto [codes_range, scales_range] =
      check_quantized(format, input.codes, input.scales, numel, "input");
  check_pointer(output, dtype_size(output_dtype), "output");
  const ByteRange output_range = byte_range("output", output, numel * dtype_size(output_dtype));
  check_disjoint(output_range, codes_range);
  check_disjoint(output_range, scales_range);
}

void check_dequantize_add_arguments(const QuantFormat& format,
                                    const std::vector<QuantizedInput>& inputs,
                                    std::int64_t numel, const float* acc) {
  check_quant_format(format);
  check_numel(numel);
  if (numel == 0 || inputs.empty()) return;
  check_pointer(acc, 4, "acc");
  const ByteRange acc_range = byte_range("acc", acc, numel * 4);
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const auto [codes_range, scales_range] =
        check_quantized(format, inputs[k].codes, inputs[k].scales, numel, indexed("inputs", k));
    check_disjoint(acc_range, codes_range);
    check_disjoint(acc_range, scales_range);
  }
}

void quantize(const QuantFormat& format, const void* input, DType input_dtype,
              std::int64_t numel, void* codes, float* scales, int threads) {
  check_threads(threads);
  check_quantize_arguments(format, input, input_dtype, numel, codes, scales);
  const Kernels kernels = kernels_for(active_cpu_isa());
  for_blocks(format, numel, threads, [&](std::int64_t first, std::int64_t last) {
    kernels.quantize(format, input, input_dtype, numel, codes, scales, first, last);
  });
}

void dequantize(const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
                void* output, DType output_dtype, int threads) {
  check_threads(threads);
  check_dequantize_arguments(format, input, numel, output, output_dtype);
  const Kernels kernels = kernels_for(active_cpu_isa());
  for_blocks(format, numel, threads, [&](std::int64_t first, std::int64_t last) {
    kernels.dequantize(format, input, numel, output, output_dtype, first, last);
  });
}

void dequantize_add(const QuantFormat& format, const std::vector<QuantizedInput>& inputs,
                    std::int64_t numel, float* acc, int threads) {
  check_threads(threads);
  check_dequantize_add_arguments(format, inputs, numel, acc);
  if (inputs.empty()) return;
  const Kernels kernels = kernels_for(active_cpu_isa());
  for_blocks(format, numel, threads, [&](std::int64_t first, std::int64_t last) {
    kernels.dequantize_add(format, inputs, numel, acc, first, last);
  });
}

}  // namespace zcore
