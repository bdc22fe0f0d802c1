#include "zcore/adam.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernel_checks.h"
#include "kernels/adam_kernels.h"
#include "zcore/cpu_isa.h"
#include "zcore/status.h"
#include "zcore/thread_pool.h"

namespace zcore {
namespace {

using adam_kernels::Kernels;
using kernel_checks::ByteRange;
using kernel_checks::byte_range;
using kernel_checks::check_pointer;
using kernel_checks::check_threads;
using kernel_checks::indexed;
using kernel_checks::invalid;

// Elements per task: large enough that handing out a task costs nothing next
// to running it, small enough to balance two to dozens of threads. A multiple
// of kBlock so that only a buffer's end can be a partial block.
constexpr std::int64_t kChunk = 1 << 16;
static_assert(kChunk % adam_kernels::kBlock == 0);

Kernels kernels_for(CpuIsa isa) {
  switch (isa) {
#if defined(ZCORE_X86_KERNELS)
    case CpuIsa::kAvx512: return adam_kernels::avx512_kernels();
    case CpuIsa::kAvx2: return adam_kernels::avx2_kernels();
#endif
    default: return adam_kernels::scalar_kernels();
  }
}

bool valid_dtype(DType dtype) { return dtype_size(dtype) != 0; }

// Buffers written in place must not share bytes with any other buffer of the
// call: an element would be updated twice, or read after it was written.
// Sorted by start, two ranges can only overlap if neighbours do.
void check_all_disjoint(std::vector<ByteRange> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (std::size_t k = 1; k < ranges.size(); ++k) {
    kernel_checks::check_disjoint(ranges[k - 1], ranges[k]);
  }
}

void check_options(const AdamOptions& o) {
  const auto bad = [](const char* name, double value, const char* rule) {
    invalid(std::string("invalid ") + name + "=" + std::to_string(value) + ": must be " + rule,
            {{"name", std::string(name)}});
  };
  if (!(o.lr >= 0.0) || !std::isfinite(o.lr)) bad("lr", o.lr, "finite and >= 0");
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) bad("beta1", o.beta1, "in [0, 1)");
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) bad("beta2", o.beta2, "in [0, 1)");
  if (!(o.eps >= 0.0) || !std::isfinite(o.eps)) bad("eps", o.eps, "finite and >= 0");
  if (!(o.weight_decay >= 0.0) || !std::isfinite(o.weight_decay)) {
    bad("weight_decay", o.weight_decay, "finite and >= 0");
  }
  if (!std::isfinite(o.grad_scale)) bad("grad_scale", o.grad_scale, "finite");
  if (o.step < 1) {
    invalid("invalid step=" + std::to_string(o.step) +
                ": must be >= 1 (the count of steps including this one)",
            {{"step", o.step}});
  }
}

void check_tensor(const AdamTensor& t, std::size_t i, std::vector<ByteRange>& ranges) {
  if (t.numel < 0) {
    invalid(indexed("tensors", i) + ".numel=" + std::to_string(t.numel) + " is negative",
            {{"index", static_cast<std::int64_t>(i)}, {"numel", t.numel}});
  }
  if (!valid_dtype(t.grad_dtype)) {
    invalid(indexed("tensors", i) + ": unsupported grad dtype " +
                std::to_string(static_cast<int>(t.grad_dtype)) + "; use float32, bfloat16 or float16",
            {{"index", static_cast<std::int64_t>(i)}});
  }
  if (t.params_out != nullptr && t.out_dtype != DType::kBFloat16 &&
      t.out_dtype != DType::kFloat16) {
    invalid(indexed("tensors", i) + ": params_out dtype " + dtype_name(t.out_dtype) +
                " is not supported; the copy-out is bfloat16 or float16",
            {{"index", static_cast<std::int64_t>(i)}});
  }
  for (const auto& [name, dtype] : {std::pair{"param", t.param_dtype}, std::pair{"state", t.state_dtype}}) {
    if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
      invalid(indexed("tensors", i) + ": " + name + " dtype " + dtype_name(dtype) +
                  " is not supported; master weights and moments are float32 or bfloat16",
              {{"index", static_cast<std::int64_t>(i)}});
    }
  }
  if (t.numel == 0) return;
  const std::string prefix = indexed("tensors", i) + ".";
  const std::int64_t param_size = dtype_size(t.param_dtype);
  const std::int64_t state_size = dtype_size(t.state_dtype);
  check_pointer(t.params, param_size, prefix + "params");
  check_pointer(t.grads, dtype_size(t.grad_dtype), prefix + "grads");
  check_pointer(t.exp_avg, state_size, prefix + "exp_avg");
  check_pointer(t.exp_avg_sq, state_size, prefix + "exp_avg_sq");
  ranges.push_back(byte_range(prefix + "params", t.params, t.numel * param_size));
  ranges.push_back(byte_range(prefix + "grads", t.grads, t.numel * dtype_size(t.grad_dtype)));
  ranges.push_back(byte_range(prefix + "exp_avg", t.exp_avg, t.numel * state_size));
  ranges.push_back(byte_range(prefix + "exp_avg_sq", t.exp_avg_sq, t.numel * state_size));
  if (t.params_out != nullptr) {
    check_pointer(t.params_out, 2, prefix + "params_out");
    ranges.push_back(byte_range(prefix + "params_out", t.params_out, t.numel * 2));
  }
}

struct Task {
  std::size_t tensor;
  std::int64_t begin;
  std::int64_t end;
};

template <class Numel>
std::vector<Task> split(std::size_t count, Numel numel_of) {
  std::vector<Task> tasks;
  for (std::size_t i = 0; i < count; ++i) {
    const std::int64_t n = numel_of(i);
    for (std::int64_t begin = 0; begin < n; begin += kChunk) {
      tasks.push_back(Task{i, begin, begin + kChunk < n ? begin + kChunk : n});
    }
  }
  return tasks;
}

}  // namespace

// Mirrors torch/optim/adam.py (_single_tensor_adam): Python doubles, rounded
// to fp32 where they become kernel scalars.
AdamScalars adam_scalars(const AdamOptions& o) {
  AdamScalars c{};
  c.grad_scale = static_cast<float>(o.grad_scale);
  c.decay = o.weight_decay == 0.0 ? WeightDecay::kNone
            : o.decoupled_weight_decay ? WeightDecay::kDecoupled
                                       : WeightDecay::kL2;
  c.weight_decay = static_cast<float>(o.weight_decay);
  c.decay_factor = static_cast<float>(1.0 - o.lr * o.weight_decay);
  const double lerp_weight = 1.0 - o.beta1;
  c.lerp_small_weight = std::fabs(static_cast<float>(lerp_weight)) < 0.5f;
  c.lerp_weight = static_cast<float>(lerp_weight);
  c.beta2 = static_cast<float>(o.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  const double step = static_cast<double>(o.step);
  const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
  c.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  c.eps = static_cast<float>(o.eps);
  c.neg_step_size = static_cast<float>(-(o.lr / bias_correction1));
  return c;
}

void check_adam_arguments(const AdamOptions& options, const std::vector<AdamTensor>& tensors) {
  check_options(options);
  std::vector<ByteRange> ranges;
  for (std::size_t i = 0; i < tensors.size(); ++i) check_tensor(tensors[i], i, ranges);
  check_all_disjoint(std::move(ranges));
}

void adam_step(const AdamOptions& options, const std::vector<AdamTensor>& tensors, int threads) {
  check_threads(threads);
  check_adam_arguments(options, tensors);
  const Kernels kernels = kernels_for(active_cpu_isa());
  const AdamScalars constants = adam_scalars(options);
  const std::vector<Task> tasks =
      split(tensors.size(), [&](std::size_t i) { return tensors[i].numel; });
  parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t k) {
    const Task& task = tasks[static_cast<std::size_t>(k)];
    kernels.adam(constants, tensors[task.tensor], task.begin, task.end);
  });
}

void check_grad_buffers(const std::vector<GradBuffer>& buffers, double scale, bool write_back) {
  if (!std::isfinite(scale)) {
    invalid("invalid scale=" + std::to_string(scale) + ": must be finite");
  }
  std::vector<ByteRange> ranges;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const GradBuffer& b = buffers[i];
    if (b.numel < 0) {
      invalid(indexed("buffers", i) + ".numel=" + std::to_string(b.numel) + " is negative",
              {{"index", static_cast<std::int64_t>(i)}, {"numel", b.numel}});
    }
    if (!valid_dtype(b.dtype)) {
      invalid(indexed("buffers", i) + ": unsupported dtype " +
                  std::to_string(static_cast<int>(b.dtype)) + "; use float32, bfloat16 or float16",
              {{"index", static_cast<std::int64_t>(i)}});
    }
    if (b.numel == 0) continue;
    check_pointer(b.data, dtype_size(b.dtype), indexed("buffers", i));
    ranges.push_back(byte_range(indexed("buffers", i), b.data, b.numel * dtype_size(b.dtype)));
  }
  if (write_back) check_all_disjoint(std::move(ranges));
}

GradStats unscale_and_check(const std::vector<GradBuffer>& buffers, double scale,
                            bool write_back, int threads) {
  check_threads(threads);
  check_grad_buffers(buffers, scale, write_back);
  const Kernels kernels = kernels_for(active_cpu_isa());
  const float scale32 = static_cast<float>(scale);
  const bool write = write_back && scale32 != 1.0f;
  const std::vector<Task> tasks =
      split(buffers.size(), [&](std::size_t i) { return buffers[i].numel; });
  std::vector<double> partial(tasks.size(), 0.0);
  parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t k) {
    const Task& task = tasks[static_cast<std::size_t>(k)];
    partial[static_cast<std::size_t>(k)] =
        kernels.sum_sq(buffers[task.tensor], scale32, write, task.begin, task.end);
  });
  // Summed in task order, which depends only on the buffer sizes.
  GradStats stats;
  stats.buffer_sum_sq.assign(buffers.size(), 0.0);
  for (std::size_t k = 0; k < tasks.size(); ++k) stats.buffer_sum_sq[tasks[k].tensor] += partial[k];
  for (double s : stats.buffer_sum_sq) stats.sum_sq += s;
  stats.nonfinite = !std::isfinite(stats.sum_sq);
  return stats;
}

}  // namespace zcore
