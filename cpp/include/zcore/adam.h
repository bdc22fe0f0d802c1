// Fused optimizer kernels on the CPU: the Adam/AdamW step and the gradient
// check that precedes it (unscale, inf/nan detection, squared L2 norm).
//
// Both work on flat buffers given as raw pointers and run the SIMD level of
// cpu_isa.h on `threads` threads of the pool in thread_pool.h. Every argument
// is validated before any byte is written: a bad call throws
// Error(kInvalidArgument) naming the tensor index and the values involved.
//
// Semantics follow torch.optim.Adam / AdamW (single-tensor path), element by
// element, in fp32 arithmetic with the same operation order:
//   g  = grad * grad_scale                     (grad upcast to fp32 first)
//   AdamW: p = p * (1 - lr * weight_decay)     Adam: g = g + weight_decay * p
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   out = round_to_nearest_even(p)             (optional bf16/fp16 copy)
// params and the two moments may each be bf16 instead of fp32 (DeepSpeed's
// bf16 master weights and bf16 optimizer states): they are upcast, the step
// runs in fp32 as above, and each is rounded to nearest even once, on store.
// amsgrad is not implemented. Results are bitwise identical across SIMD
// levels and thread counts.
#pragma once

#include <cstdint>
#include <vector>

#include "zcore/dtype.h"

namespace zcore {

// The hyper-parameters of one step, as a torch param_group holds them.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // false: Adam (L2 in the gradient); true: AdamW
  std::int64_t step = 1;   // 1-based, counting this step (torch's state["step"] after += 1)
  // Every gradient is multiplied by this (rounded to fp32) before use: the
  // product of 1/loss_scale and the clipping coefficient; negated to maximize.
  double grad_scale = 1.0;
};

// One tensor's buffers, all `numel` elements long. params (param_dtype),
// exp_avg and exp_avg_sq (both state_dtype) are fp32 or bf16 and updated in
// place; params_out, when not null, receives the updated params in out_dtype
// (bf16 or fp16) in the same pass.
struct AdamTensor {
  void* params = nullptr;
  DType param_dtype = DType::kFloat32;
  const void* grads = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType state_dtype = DType::kFloat32;
  void* params_out = nullptr;
  DType out_dtype = DType::kBFloat16;
  std::int64_t numel = 0;
};

// One Adam/AdamW step over every tensor, on up to `threads` threads.
void adam_step(const AdamOptions& options, const std::vector<AdamTensor>& tensors, int threads);

// Throws what adam_step throws for bad options or tensors (shared with the
// CUDA launcher, which sees the same arguments).
void check_adam_arguments(const AdamOptions& options, const std::vector<AdamTensor>& tensors);

enum class WeightDecay { kNone, kL2, kDecoupled };

// The fp32 scalars of one step that every implementation (CPU ISA levels,
// CUDA) applies, derived from AdamOptions in double the way torch derives
// them in Python, then rounded to fp32 where torch's kernels receive them.
struct AdamScalars {
  float grad_scale;
  WeightDecay decay;
  float weight_decay;      // kL2: g += weight_decay * p
  float decay_factor;      // kDecoupled: p *= 1 - lr * weight_decay
  bool lerp_small_weight;  // torch's lerp picks its formula by |weight| < 0.5
  float lerp_weight;       // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;     // -lr / (1 - beta1^step)
};

AdamScalars adam_scalars(const AdamOptions& options);

// A gradient buffer for unscale_and_check; fp32, bf16 or fp16.
struct GradBuffer {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t numel = 0;
};

struct GradStats {
  bool nonfinite = false;          // some scaled element is inf or nan
  double sum_sq = 0.0;             // sum over all buffers of (element * scale)^2
  std::vector<double> buffer_sum_sq;  // the same per buffer, in input order
};

// Multiplies every element by `scale` (1/loss_scale) in fp32 and sums the
// squares of the results in double. With write_back, the scaled values are
// stored back in place (rounded to nearest even for bf16/fp16); scale == 1
// never writes. The sums are bitwise identical across SIMD levels and thread
// counts; a sum is inf or nan exactly when its buffer holds an element whose
// scaled value is inf or nan.
GradStats unscale_and_check(const std::vector<GradBuffer>& buffers, double scale,
                            bool write_back, int threads);

// Throws what unscale_and_check throws for bad buffers or scale.
void check_grad_buffers(const std::vector<GradBuffer>& buffers, double scale, bool write_back);

}  // namespace zcore
