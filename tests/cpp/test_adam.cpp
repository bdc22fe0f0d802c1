#include "zcore/adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "expect_error.h"
#include "half_reference.h"
#include "isa_scope.h"
#include "zcore/cpu_isa.h"
#include "zcore/status.h"

namespace zcore {
namespace {

// Reference conversions, ISA levels and error checks shared by the kernel tests.
using namespace testing_support;

constexpr std::int64_t kOneMillionAndThree = (1 << 20) + 3;

// ---------------------------------------------------------------- helpers --

std::uint16_t to_half_bits(float f, DType dtype) {
  return dtype == DType::kBFloat16 ? reference_bf16(f) : reference_fp16(f);
}

float from_half_bits(std::uint16_t h, DType dtype) {
  return dtype == DType::kBFloat16 ? bf16_to_float(h) : fp16_to_float(h);
}

// One tensor's buffers, owning their memory; grads are stored in grad_dtype.
struct Buffers {
  std::vector<float> params, exp_avg, exp_avg_sq;
  std::vector<float> grads_f32;          // used when grad_dtype is fp32
  std::vector<std::uint16_t> grads_16;   // used when it is bf16/fp16
  std::vector<std::uint16_t> out;
  DType grad_dtype = DType::kFloat32;
  DType out_dtype = DType::kBFloat16;
  bool with_out = false;

  Buffers(std::int64_t n, DType grads, bool copy_out, DType out_type, std::uint32_t seed)
      : params(n), exp_avg(n), exp_avg_sq(n), grad_dtype(grads), out_dtype(out_type),
        with_out(copy_out) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& p : params) p = normal(rng);
    for (auto& m : exp_avg) m = 0.1f * normal(rng);
    for (auto& v : exp_avg_sq) v = 0.01f * std::fabs(normal(rng));
    if (grad_dtype == DType::kFloat32) {
      grads_f32.resize(n);
      for (auto& g : grads_f32) g = normal(rng);
    } else {
      grads_16.resize(n);
      for (auto& g : grads_16) g = to_half_bits(normal(rng), grad_dtype);
    }
    if (with_out) out.assign(n, 0xFFFF);
  }

  float grad(std::int64_t i) const {
    return grad_dtype == DType::kFloat32 ? grads_f32[i] : from_half_bits(grads_16[i], grad_dtype);
  }

  void set_grads(const std::vector<float>& g) {
    if (grad_dtype == DType::kFloat32) {
      grads_f32 = g;
    } else {
      for (std::size_t i = 0; i < g.size(); ++i) grads_16[i] = to_half_bits(g[i], grad_dtype);
    }
  }

  AdamTensor tensor() {
    AdamTensor t;
    t.params = params.data();
    t.grads = grad_dtype == DType::kFloat32 ? static_cast<const void*>(grads_f32.data())
                                            : static_cast<const void*>(grads_16.data());
    t.grad_dtype = grad_dtype;
    t.exp_avg = exp_avg.data();
    t.exp_avg_sq = exp_avg_sq.data();
    t.params_out = with_out ? out.data() : nullptr;
    t.out_dtype = out_dtype;
    t.numel = static_cast<std::int64_t>(params.size());
    return t;
  }
};

// torch.optim.Adam/AdamW written out in double precision.
struct Reference {
  std::vector<double> p, m, v;

  explicit Reference(const Buffers& b)
      : p(b.params.begin(), b.params.end()), m(b.exp_avg.begin(), b.exp_avg.end()),
        v(b.exp_avg_sq.begin(), b.exp_avg_sq.end()) {}

  void step(const AdamOptions& o, const Buffers& b) {
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(o.step));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(o.step));
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = static_cast<double>(b.grad(static_cast<std::int64_t>(i))) *
                 static_cast<double>(static_cast<float>(o.grad_scale));
      if (o.decoupled_weight_decay) {
        p[i] *= 1.0 - o.lr * o.weight_decay;
      } else {
        g += o.weight_decay * p[i];
      }
      m[i] = o.beta1 * m[i] + (1.0 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1.0 - o.beta2) * g * g;
      p[i] -= o.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + o.eps);
    }
  }
};

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol,
                  double atol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int reported = 0;
  for (std::size_t i = 0; i < got.size() && reported < 5; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= rtol * std::fabs(want[i]) + atol)) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", reference " << want[i];
      ++reported;
    }
  }
}

AdamOptions options(bool adamw, double weight_decay, double grad_scale) {
  AdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = weight_decay;
  o.decoupled_weight_decay = adamw;
  o.grad_scale = grad_scale;
  return o;
}

// ------------------------------------------------ against the reference --

using StepCase = std::tuple<CpuIsa, std::int64_t, DType, int>;

class AdamMatchesReference : public ::testing::TestWithParam<StepCase> {};

TEST_P(AdamMatchesReference, ThreeStepsOfEveryVariant) {
  const auto [isa, n, grad_dtype, out_kind] = GetParam();
  if (!cpu_isa_supported(isa)) GTEST_SKIP() << cpu_isa_name(isa) << " is not supported here";
  IsaScope scope(isa);
  const bool with_out = out_kind != 0;
  const DType out_dtype = out_kind == 2 ? DType::kFloat16 : DType::kBFloat16;
  struct Variant {
    bool adamw;
    double weight_decay;
    double grad_scale;
  };
  for (const Variant& variant : {Variant{false, 0.0, 1.0}, Variant{false, 0.05, 0.25},
                                 Variant{true, 0.1, -0.5}}) {
    Buffers b(n, grad_dtype, with_out, out_dtype, static_cast<std::uint32_t>(n));
    Reference ref(b);
    AdamOptions o = options(variant.adamw, variant.weight_decay, variant.grad_scale);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::int64_t step = 1; step <= 3; ++step) {
      std::vector<float> g(n);
      for (auto& x : g) x = normal(rng);
      b.set_grads(g);
      o.step = step;
      adam_step(o, {b.tensor()}, 2);
      ref.step(o, b);
    }
    expect_close(b.params, ref.p, 1e-6, 1e-7, "params");
    expect_close(b.exp_avg, ref.m, 1e-5, 1e-7, "exp_avg");
    expect_close(b.exp_avg_sq, ref.v, 1e-5, 0.0, "exp_avg_sq");
    if (with_out) {
      for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(b.out[i], to_half_bits(b.params[i], out_dtype)) << "copy-out at " << i;
      }
    }
  }
}

std::string step_case_name(const ::testing::TestParamInfo<StepCase>& info) {
  static const char* const outs[] = {"NoOut", "Bf16Out", "Fp16Out"};
  return std::string(cpu_isa_name(std::get<0>(info.param))) + "_n" +
         std::to_string(std::get<1>(info.param)) + "_" + dtype_name(std::get<2>(info.param)) +
         "Grads_" + outs[std::get<3>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, AdamMatchesReference,
    ::testing::Combine(::testing::ValuesIn(all_isas()),
                       ::testing::Values<std::int64_t>(1, 7, 16, 33, 4099),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(0, 1, 2)),
    step_case_name);

// ------------------------------------------ identical bits on every path --

TEST(Adam, EveryIsaAndThreadCountGivesTheSameBits) {
  for (DType grads : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType out : {DType::kBFloat16, DType::kFloat16}) {
      for (std::int64_t n : {std::int64_t{1}, std::int64_t{7}, kOneMillionAndThree}) {
        AdamOptions o = options(true, 0.01, 0.125);
        o.step = 5;
        const Buffers initial(n, grads, true, out, 11);
        Buffers first = initial;
        {
          IsaScope scope(CpuIsa::kScalar);
          adam_step(o, {first.tensor()}, 1);
        }
        for (CpuIsa isa : supported_isas()) {
          for (int threads : {1, 2, 3}) {
            Buffers b = initial;
            IsaScope scope(isa);
            adam_step(o, {b.tensor()}, threads);
            EXPECT_EQ(b.params, first.params) << cpu_isa_name(isa) << " threads " << threads;
            EXPECT_EQ(b.exp_avg, first.exp_avg) << cpu_isa_name(isa);
            EXPECT_EQ(b.exp_avg_sq, first.exp_avg_sq) << cpu_isa_name(isa);
            EXPECT_EQ(b.out, first.out) << cpu_isa_name(isa);
          }
        }
      }
    }
  }
}

TEST(Adam, LowPrecisionGradsGiveTheResultOfUpcastingFirst) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (DType grads : {DType::kBFloat16, DType::kFloat16}) {
      Buffers low(1003, grads, false, DType::kBFloat16, 3);
      Buffers upcast(1003, DType::kFloat32, false, DType::kBFloat16, 3);
      upcast.params = low.params;
      for (std::int64_t i = 0; i < 1003; ++i) upcast.grads_f32[i] = low.grad(i);
      const AdamOptions o = options(false, 0.01, 0.5);
      adam_step(o, {low.tensor()}, 2);
      adam_step(o, {upcast.tensor()}, 2);
      EXPECT_EQ(low.params, upcast.params) << cpu_isa_name(isa);
      EXPECT_EQ(low.exp_avg_sq, upcast.exp_avg_sq) << cpu_isa_name(isa);
    }
  }
}

// bf16 master weights and moments (DeepSpeed's bf16_master_weights_and_grads
// and bf16_optimizer_states): the fp32 step on their upcast values, each
// result rounded to nearest even once.
TEST(Adam, Bf16ParamsAndMomentsGiveTheFp32StepRoundedOnce) {
  const auto bf16_of = [](const std::vector<float>& x) {
    std::vector<std::uint16_t> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = reference_bf16(x[i]);
    return out;
  };
  const auto upcast = [](const std::vector<std::uint16_t>& x) {
    std::vector<float> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_float(x[i]);
    return out;
  };
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (bool bf16_params : {false, true}) {
      for (bool bf16_states : {false, true}) {
        if (!bf16_params && !bf16_states) continue;
        for (std::int64_t n : {std::int64_t{1}, std::int64_t{37}, std::int64_t{70001}}) {
          Buffers reference(n, DType::kBFloat16, true, DType::kBFloat16, 5);
          // Start from values the low-precision buffers hold exactly.
          if (bf16_params) reference.params = upcast(bf16_of(reference.params));
          if (bf16_states) {
            reference.exp_avg = upcast(bf16_of(reference.exp_avg));
            reference.exp_avg_sq = upcast(bf16_of(reference.exp_avg_sq));
          }
          std::vector<std::uint16_t> p16 = bf16_of(reference.params);
          std::vector<std::uint16_t> m16 = bf16_of(reference.exp_avg);
          std::vector<std::uint16_t> v16 = bf16_of(reference.exp_avg_sq);
          Buffers low = reference;
          AdamTensor t = low.tensor();
          if (bf16_params) {
            t.params = p16.data();
            t.param_dtype = DType::kBFloat16;
          }
          if (bf16_states) {
            t.exp_avg = m16.data();
            t.exp_avg_sq = v16.data();
            t.state_dtype = DType::kBFloat16;
          }
          AdamOptions o = options(true, 0.01, 0.25);
          o.step = 3;
          adam_step(o, {reference.tensor()}, 1);
          adam_step(o, {t}, 2);
          const std::string where = std::string(cpu_isa_name(isa)) + " n " + std::to_string(n);
          if (bf16_params) {
            EXPECT_EQ(p16, bf16_of(reference.params)) << where;
          } else {
            EXPECT_EQ(low.params, reference.params) << where;
          }
          if (bf16_states) {
            EXPECT_EQ(m16, bf16_of(reference.exp_avg)) << where;
            EXPECT_EQ(v16, bf16_of(reference.exp_avg_sq)) << where;
          } else {
            EXPECT_EQ(low.exp_avg, reference.exp_avg) << where;
            EXPECT_EQ(low.exp_avg_sq, reference.exp_avg_sq) << where;
          }
          EXPECT_EQ(low.out, reference.out) << where;
        }
      }
    }
  }
}

TEST(Adam, MasterWeightsOtherThanFp32OrBf16AreRefused) {
  Buffers b(8, DType::kFloat32, false, DType::kBFloat16, 1);
  AdamTensor t = b.tensor();
  t.param_dtype = DType::kFloat16;
  expect_invalid([&] { adam_step(options(true, 0.01, 0.0), {t}, 1); },
                 "param dtype float16 is not supported");
}

TEST(Adam, ManyTensorsInOneCallEqualOneCallEach) {
  std::vector<Buffers> together, alone;
  for (std::int64_t n : {1, 7, 70000, 3, 131073}) {
    together.emplace_back(n, DType::kBFloat16, true, DType::kFloat16, static_cast<std::uint32_t>(n));
    alone.emplace_back(n, DType::kBFloat16, true, DType::kFloat16, static_cast<std::uint32_t>(n));
  }
  const AdamOptions o = options(true, 0.1, 1.0);
  std::vector<AdamTensor> tensors;
  for (auto& b : together) tensors.push_back(b.tensor());
  adam_step(o, tensors, 2);
  for (auto& b : alone) adam_step(o, {b.tensor()}, 1);
  for (std::size_t i = 0; i < alone.size(); ++i) {
    EXPECT_EQ(together[i].params, alone[i].params) << i;
    EXPECT_EQ(together[i].out, alone[i].out) << i;
  }
}

TEST(Adam, CopyOutRoundsToNearestEvenIncludingSpecialValues) {
  // Parameters that an update with lr = 0 leaves as they are: ties, values
  // that overflow to inf in fp16 or bf16, subnormals, infinities, signed zero.
  const std::vector<float> values = {
      0.0f, -0.0f, 1.0f, bits_to_float(0x3F808000), bits_to_float(0x3F818000),
      bits_to_float(0x3F807FFF), 65504.0f, 65520.0f, 1e-7f, -3e-8f, 6e-5f,
      std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::denorm_min(), 1.00048828125f, 1.000732421875f};
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (DType out : {DType::kBFloat16, DType::kFloat16}) {
      const auto n = static_cast<std::int64_t>(values.size());
      Buffers b(n, DType::kFloat32, true, out, 1);
      b.params = values;
      std::fill(b.grads_f32.begin(), b.grads_f32.end(), 0.0f);
      std::fill(b.exp_avg.begin(), b.exp_avg.end(), 0.0f);
      std::fill(b.exp_avg_sq.begin(), b.exp_avg_sq.end(), 0.0f);
      AdamOptions o = options(true, 0.0, 1.0);
      o.lr = 0.0;
      adam_step(o, {b.tensor()}, 1);
      for (std::int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(b.out[i], to_half_bits(values[i], out))
            << cpu_isa_name(isa) << " " << dtype_name(out) << " value " << values[i];
      }
    }
  }
}

// ------------------------------------------------------ unscale / check --

struct GradSet {
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<std::uint16_t>> half;
  std::vector<GradBuffer> buffers;
  std::vector<DType> dtypes;

  GradSet(const std::vector<std::pair<DType, std::int64_t>>& spec, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    f32.resize(spec.size());
    half.resize(spec.size());
    for (std::size_t k = 0; k < spec.size(); ++k) {
      const auto [dtype, n] = spec[k];
      dtypes.push_back(dtype);
      if (dtype == DType::kFloat32) {
        f32[k].resize(n);
        for (auto& x : f32[k]) x = normal(rng);
        buffers.push_back(GradBuffer{f32[k].data(), dtype, n});
      } else {
        half[k].resize(n);
        for (auto& x : half[k]) x = to_half_bits(normal(rng), dtype);
        buffers.push_back(GradBuffer{half[k].data(), dtype, n});
      }
    }
  }

  float value(std::size_t k, std::int64_t i) const {
    return dtypes[k] == DType::kFloat32 ? f32[k][i] : from_half_bits(half[k][i], dtypes[k]);
  }

  void set(std::size_t k, std::int64_t i, float x) {
    if (dtypes[k] == DType::kFloat32) {
      f32[k][i] = x;
    } else {
      half[k][i] = to_half_bits(x, dtypes[k]);
    }
  }
};

const std::vector<std::pair<DType, std::int64_t>> kGradSpec = {
    {DType::kFloat32, 1}, {DType::kBFloat16, 7}, {DType::kFloat16, 1000},
    {DType::kFloat32, kOneMillionAndThree}, {DType::kBFloat16, 65537}, {DType::kFloat16, 17}};

TEST(UnscaleAndCheck, NormsMatchFloat64OnEveryIsa) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    GradSet set(kGradSpec, 5);
    const double scale = 1.0 / 3.0;
    std::vector<double> want(kGradSpec.size(), 0.0);
    double total = 0.0;
    for (std::size_t k = 0; k < kGradSpec.size(); ++k) {
      for (std::int64_t i = 0; i < kGradSpec[k].second; ++i) {
        const double x = static_cast<double>(set.value(k, i)) * scale;
        want[k] += x * x;
      }
      total += want[k];
    }
    const GradStats stats = unscale_and_check(set.buffers, scale, false, 2);
    EXPECT_FALSE(stats.nonfinite);
    EXPECT_NEAR(stats.sum_sq, total, 1e-6 * total) << cpu_isa_name(isa);
    ASSERT_EQ(stats.buffer_sum_sq.size(), want.size());
    for (std::size_t k = 0; k < want.size(); ++k) {
      EXPECT_NEAR(stats.buffer_sum_sq[k], want[k], 1e-6 * want[k]) << cpu_isa_name(isa) << " " << k;
    }
  }
}

TEST(UnscaleAndCheck, SumsAreBitwiseIdenticalAcrossIsasAndThreads) {
  GradSet set(kGradSpec, 9);
  GradStats first;
  {
    IsaScope scope(CpuIsa::kScalar);
    first = unscale_and_check(set.buffers, 0.7, false, 1);
  }
  for (CpuIsa isa : supported_isas()) {
    for (int threads : {1, 2, 5}) {
      IsaScope scope(isa);
      const GradStats stats = unscale_and_check(set.buffers, 0.7, false, threads);
      EXPECT_EQ(stats.sum_sq, first.sum_sq) << cpu_isa_name(isa) << " threads " << threads;
      EXPECT_EQ(stats.buffer_sum_sq, first.buffer_sum_sq) << cpu_isa_name(isa);
    }
  }
}

TEST(UnscaleAndCheck, FindsASingleInfOrNanAnywhere) {
  GradSet set(kGradSpec, 13);
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    EXPECT_FALSE(unscale_and_check(set.buffers, 0.5, false, 2).nonfinite);
    for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      for (std::size_t k = 0; k < kGradSpec.size(); ++k) {
        const std::int64_t n = kGradSpec[k].second;
        for (std::int64_t i : {std::int64_t{0}, n / 2, n - 1}) {
          const float saved = set.value(k, i);
          set.set(k, i, bad);
          const GradStats stats = unscale_and_check(set.buffers, 0.5, false, 2);
          set.set(k, i, saved);
          EXPECT_TRUE(stats.nonfinite) << cpu_isa_name(isa) << " buffer " << k << " index " << i;
          for (std::size_t j = 0; j < kGradSpec.size(); ++j) {
            EXPECT_EQ(std::isfinite(stats.buffer_sum_sq[j]), j != k) << "buffer " << j;
          }
        }
      }
    }
  }
}

TEST(UnscaleAndCheck, WriteBackStoresTheScaledValuesRounded) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    GradSet set(kGradSpec, 21);
    const GradSet before = set;
    const float scale = 0.3f;
    unscale_and_check(set.buffers, scale, true, 2);
    for (std::size_t k = 0; k < kGradSpec.size(); ++k) {
      for (std::int64_t i = 0; i < kGradSpec[k].second; ++i) {
        const float want = before.value(k, i) * scale;
        if (set.dtypes[k] == DType::kFloat32) {
          ASSERT_EQ(float_bits(set.f32[k][i]), float_bits(want)) << k << " " << i;
        } else {
          ASSERT_EQ(set.half[k][i], to_half_bits(want, set.dtypes[k]))
              << cpu_isa_name(isa) << " " << k << " " << i;
        }
      }
    }
  }
}

TEST(UnscaleAndCheck, EveryFp16ValueConvertsLikeTheCompiler) {
  // All 65536 fp16 bit patterns in, scaled by 0.3 and rounded back: exercises
  // subnormals, overflow to inf and every exponent in both conversions.
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    std::vector<std::uint16_t> h = all;
    unscale_and_check({GradBuffer{h.data(), DType::kFloat16, 65536}}, 0.3, true, 1);
    for (std::uint32_t i = 0; i < 65536; ++i) {
      const float want = fp16_to_float(all[i]) * 0.3f;
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(fp16_to_float(h[i]))) << i;
      } else {
        ASSERT_EQ(h[i], reference_fp16(want)) << cpu_isa_name(isa) << " input " << i;
      }
    }
  }
}

// ------------------------------------------------------------- bad input --

TEST(Adam, BadInputIsRejectedBeforeAnyByteIsWritten) {
  Buffers good(100, DType::kFloat32, true, DType::kBFloat16, 1);
  const Buffers pristine = good;
  const AdamOptions o = options(true, 0.1, 1.0);
  // The bad tensor comes last: nothing of the good one may change.
  const auto with = [&](const std::function<void(AdamTensor&)>& spoil) {
    return [&, spoil] {
      Buffers bad(100, DType::kFloat32, true, DType::kBFloat16, 2);
      AdamTensor t = bad.tensor();
      spoil(t);
      adam_step(o, {good.tensor(), t}, 2);
    };
  };
  expect_invalid(with([](AdamTensor& t) { t.numel = -1; }), "negative");
  expect_invalid(with([](AdamTensor& t) { t.exp_avg = nullptr; }), "tensors[1].exp_avg is null");
  expect_invalid(with([](AdamTensor& t) { t.grads = static_cast<const char*>(t.grads) + 1; }),
                 "not aligned");
  expect_invalid(with([](AdamTensor& t) { t.grad_dtype = static_cast<DType>(9); }),
                 "unsupported grad dtype");
  expect_invalid(with([](AdamTensor& t) { t.out_dtype = DType::kFloat32; }), "copy-out");
  expect_invalid(with([](AdamTensor& t) { t.exp_avg_sq = static_cast<float*>(t.exp_avg) + 50; }),
                 "overlap");
  expect_invalid(with([&](AdamTensor& t) { t.params = good.params.data(); }), "overlap");
  AdamOptions bad_beta = o;
  bad_beta.beta2 = 1.0;
  expect_invalid([&] { adam_step(bad_beta, {good.tensor()}, 1); }, "beta2");
  AdamOptions bad_step = o;
  bad_step.step = 0;
  expect_invalid([&] { adam_step(bad_step, {good.tensor()}, 1); }, "step");
  AdamOptions bad_lr = o;
  bad_lr.lr = std::nan("");
  expect_invalid([&] { adam_step(bad_lr, {good.tensor()}, 1); }, "lr");
  expect_invalid([&] { adam_step(o, {good.tensor()}, 0); }, "threads");
  EXPECT_EQ(good.params, pristine.params);
  EXPECT_EQ(good.exp_avg, pristine.exp_avg);
  EXPECT_EQ(good.exp_avg_sq, pristine.exp_avg_sq);
  EXPECT_EQ(good.out, pristine.out);
  EXPECT_NO_THROW(adam_step(o, {good.tensor(), AdamTensor{}}, 2)) << "an empty tensor is fine";
}

TEST(UnscaleAndCheck, BadInputIsRejectedBeforeAnyByteIsWritten) {
  std::vector<float> a(64, 2.0f), b(64, 2.0f);
  const auto good = GradBuffer{a.data(), DType::kFloat32, 64};
  expect_invalid([&] { unscale_and_check({good, GradBuffer{a.data() + 10, DType::kFloat32, 5}}, 0.5, true, 1); },
                 "overlap");
  expect_invalid([&] { unscale_and_check({good, GradBuffer{nullptr, DType::kBFloat16, 5}}, 0.5, true, 1); },
                 "buffers[1] is null");
  expect_invalid([&] { unscale_and_check({good, GradBuffer{b.data(), DType::kFloat32, -2}}, 0.5, true, 1); },
                 "negative");
  expect_invalid([&] { unscale_and_check({good}, std::numeric_limits<double>::infinity(), true, 1); },
                 "scale");
  EXPECT_EQ(a, std::vector<float>(64, 2.0f));
  // Reading overlapping buffers without writing is harmless and allowed.
  EXPECT_NO_THROW(unscale_and_check({good, GradBuffer{a.data() + 10, DType::kFloat32, 5}}, 0.5, false, 1));
}

// -------------------------------------------------------------- dispatch --

TEST(CpuIsa, NamesRoundTripAndUnknownNamesAreRejected) {
  for (CpuIsa isa : all_isas()) EXPECT_EQ(parse_cpu_isa(cpu_isa_name(isa)), isa);
  expect_invalid([] { parse_cpu_isa("sse9"); }, "sse9");
}

TEST(CpuIsa, BestIsTheHighestSupportedAndUnsupportedLevelsCannotBeForced) {
  EXPECT_TRUE(cpu_isa_supported(CpuIsa::kScalar));
  const CpuIsa best = best_cpu_isa();
  EXPECT_TRUE(cpu_isa_supported(best));
  for (CpuIsa isa : all_isas()) {
    if (static_cast<int>(isa) > static_cast<int>(best)) {
      EXPECT_FALSE(cpu_isa_supported(isa));
      expect_invalid([isa] { set_cpu_isa(isa); }, "not supported");
    }
  }
  if (cpu_isa_supported(CpuIsa::kAvx512)) EXPECT_TRUE(cpu_isa_supported(CpuIsa::kAvx2));
  const CpuIsa before = active_cpu_isa();
  set_cpu_isa(CpuIsa::kScalar);
  EXPECT_EQ(active_cpu_isa(), CpuIsa::kScalar);
  set_cpu_isa(before);
}

}  // namespace
}  // namespace zcore
