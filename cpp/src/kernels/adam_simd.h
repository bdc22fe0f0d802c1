// The Adam and sum-of-squares kernels, written once over a SIMD traits class
// V and instantiated by each per-ISA translation unit (adam_scalar.cpp,
// adam_avx2.cpp, adam_avx512.cpp).
//
// Everything here has internal linkage (anonymous namespace, and templates
// instantiated with each file's own traits type): each file is compiled with
// different target flags, and a shared inline symbol would let the linker
// keep an AVX-512 copy for every caller. The files are compiled with
// -ffp-contract=off so that each level performs the same IEEE operations in
// the same order and produces the same bits.
//
// V provides: kWidth (floats per register), kDPerBlock (double registers per
// kBlock floats), F and D register types, load/store, load_bf16/load_fp16,
// store_bf16/store_fp16 (round to nearest even; these from simd_io_*.h), set1,
// add, sub, mul, div, sqrt, fma(a, b, c) = a * b + c rounded once, dzero,
// add_squares(acc, x, part) which adds the exact squares of the kWidth floats
// of x to the double lanes part * kWidth ... of the block, and store_lanes.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam_kernels.h"
#include "simd_elements.h"

namespace zcore::adam_kernels {
namespace {

struct NoOut {};  // no low-precision copy of the parameters

// One register of elements starting at i, in torch's operation order. Element
// types: gradient G, copy-out O, params P, moments S.
template <class V, class G, class O, class P, class S>
void adam_register(const AdamScalars& c, void* p, const void* g, void* m, void* v, void* out,
                   std::int64_t i) {
  using F = typename V::F;
  F grad = V::mul(simd::load_as_float<V, G>(g, i), V::set1(c.grad_scale));
  F param = simd::load_as_float<V, P>(p, i);
  if (c.decay == WeightDecay::kDecoupled) {
    param = V::mul(param, V::set1(c.decay_factor));
  } else if (c.decay == WeightDecay::kL2) {
    grad = V::fma(V::set1(c.weight_decay), param, grad);  // torch's add(alpha=) is an fma
  }
  // torch's vectorized lerp: fma(w, end - start, start) for |w| < 0.5, else
  // fma(w - 1, end - start, end).
  F mom = simd::load_as_float<V, S>(m, i);
  const F diff = V::sub(grad, mom);
  mom = c.lerp_small_weight ? V::fma(V::set1(c.lerp_weight), diff, mom)
                            : V::fma(V::set1(c.lerp_weight - 1.0f), diff, grad);
  // torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2); its
  // addcmul computes fma(value * g, g, self).
  const F sq = V::fma(V::mul(V::set1(c.one_minus_beta2), grad), grad,
                      V::mul(simd::load_as_float<V, S>(v, i), V::set1(c.beta2)));
  // torch: denom = sqrt(v) / bias_correction2_sqrt + eps;
  //        param.addcdiv_(m, denom, value=-step_size) = param + (value * m) / denom
  const F denom =
      V::add(V::div(V::sqrt(sq), V::set1(c.bias_correction2_sqrt)), V::set1(c.eps));
  param = V::add(param, V::div(V::mul(V::set1(c.neg_step_size), mom), denom));
  simd::store_from_float<V, P>(p, i, param);
  simd::store_from_float<V, S>(m, i, mom);
  simd::store_from_float<V, S>(v, i, sq);
  if constexpr (!std::is_same_v<O, NoOut>) simd::store_from_float<V, O>(out, i, param);
}

template <class V, class G, class O, class P, class S>
void adam_range_typed(const AdamScalars& c, const AdamTensor& t, std::int64_t begin,
                      std::int64_t end) {
  const std::int64_t full_end = begin + (end - begin) / kBlock * kBlock;
  for (std::int64_t i = begin; i < full_end; i += V::kWidth) {
    adam_register<V, G, O, P, S>(c, t.params, t.grads, t.exp_avg, t.exp_avg_sq, t.params_out, i);
  }
  const std::int64_t n = end - full_end;
  if (n == 0) return;
  // The last partial block runs through the same vector code on zero-padded
  // copies, so tails get exactly the arithmetic of full blocks.
  constexpr std::int64_t ps = simd::element_size<P>();
  constexpr std::int64_t ss = simd::element_size<S>();
  constexpr std::int64_t gs = simd::element_size<G>();
  alignas(64) unsigned char p[kBlock * 4] = {};
  alignas(64) unsigned char m[kBlock * 4] = {};
  alignas(64) unsigned char v[kBlock * 4] = {};
  alignas(64) unsigned char g[kBlock * 4] = {};
  alignas(64) unsigned char out[kBlock * 2] = {};
  const auto at = [full_end](const void* base, std::int64_t size) {
    return static_cast<const unsigned char*>(base) + full_end * size;
  };
  std::memcpy(p, at(t.params, ps), n * ps);
  std::memcpy(m, at(t.exp_avg, ss), n * ss);
  std::memcpy(v, at(t.exp_avg_sq, ss), n * ss);
  std::memcpy(g, at(t.grads, gs), n * gs);
  for (std::int64_t i = 0; i < kBlock; i += V::kWidth) {
    adam_register<V, G, O, P, S>(c, p, g, m, v, out, i);
  }
  const auto back = [full_end](void* base, std::int64_t size) {
    return static_cast<unsigned char*>(base) + full_end * size;
  };
  std::memcpy(back(t.params, ps), p, n * ps);
  std::memcpy(back(t.exp_avg, ss), m, n * ss);
  std::memcpy(back(t.exp_avg_sq, ss), v, n * ss);
  if constexpr (!std::is_same_v<O, NoOut>) std::memcpy(back(t.params_out, 2), out, n * 2);
}

// Run-time dtypes to compile-time tags, one argument at a time.
template <class V, class G, class O, class P>
void adam_range_state(const AdamScalars& c, const AdamTensor& t, std::int64_t begin,
                      std::int64_t end) {
  if (t.state_dtype == DType::kBFloat16) {
    adam_range_typed<V, G, O, P, simd::Bf16>(c, t, begin, end);
  } else {
    adam_range_typed<V, G, O, P, float>(c, t, begin, end);
  }
}

template <class V, class G, class O>
void adam_range_param(const AdamScalars& c, const AdamTensor& t, std::int64_t begin,
                      std::int64_t end) {
  if (t.param_dtype == DType::kBFloat16) {
    adam_range_state<V, G, O, simd::Bf16>(c, t, begin, end);
  } else {
    adam_range_state<V, G, O, float>(c, t, begin, end);
  }
}

template <class V, class G>
void adam_range_grad(const AdamScalars& c, const AdamTensor& t, std::int64_t begin,
                     std::int64_t end) {
  if (t.params_out == nullptr) {
    adam_range_param<V, G, NoOut>(c, t, begin, end);
  } else if (t.out_dtype == DType::kBFloat16) {
    adam_range_param<V, G, simd::Bf16>(c, t, begin, end);
  } else {
    adam_range_param<V, G, simd::Fp16>(c, t, begin, end);
  }
}

template <class V>
void adam_range(const AdamScalars& c, const AdamTensor& t, std::int64_t begin,
                std::int64_t end) {
  switch (t.grad_dtype) {
    case DType::kFloat32: adam_range_grad<V, float>(c, t, begin, end); break;
    case DType::kBFloat16: adam_range_grad<V, simd::Bf16>(c, t, begin, end); break;
    case DType::kFloat16: adam_range_grad<V, simd::Fp16>(c, t, begin, end); break;
  }
}

template <class V, class T>
double sum_sq_typed(const GradBuffer& b, float scale, bool write_back, std::int64_t begin,
                    std::int64_t end) {
  typename V::D acc[V::kDPerBlock];
  for (auto& a : acc) a = V::dzero();
  const auto block = [&](void* data, std::int64_t i) {
    for (int part = 0; part < kBlock / V::kWidth; ++part) {
      const std::int64_t at = i + part * V::kWidth;
      const typename V::F x = V::mul(simd::load_as_float<V, T>(data, at), V::set1(scale));
      if (write_back) simd::store_from_float<V, T>(data, at, x);
      V::add_squares(acc, x, part);
    }
  };
  const std::int64_t full_end = begin + (end - begin) / kBlock * kBlock;
  for (std::int64_t i = begin; i < full_end; i += kBlock) block(b.data, i);
  const std::int64_t n = end - full_end;
  if (n > 0) {
    // Zero padding adds exact zeros to the lanes.
    alignas(64) unsigned char tail[kBlock * 4] = {};
    unsigned char* src = static_cast<unsigned char*>(b.data) + full_end * simd::element_size<T>();
    std::memcpy(tail, src, n * simd::element_size<T>());
    block(tail, 0);
    if (write_back) std::memcpy(src, tail, n * simd::element_size<T>());
  }
  alignas(64) double lanes[kBlock];
  V::store_lanes(acc, lanes);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

template <class V>
double sum_sq_range(const GradBuffer& b, float scale, bool write_back, std::int64_t begin,
                    std::int64_t end) {
  switch (b.dtype) {
    case DType::kFloat32: return sum_sq_typed<V, float>(b, scale, write_back, begin, end);
    case DType::kBFloat16: return sum_sq_typed<V, simd::Bf16>(b, scale, write_back, begin, end);
    case DType::kFloat16: return sum_sq_typed<V, simd::Fp16>(b, scale, write_back, begin, end);
  }
  return 0.0;
}

template <class V>
Kernels kernels_of() {
  return Kernels{&adam_range<V>, &sum_sq_range<V>};
}

}  // namespace
}  // namespace zcore::adam_kernels
