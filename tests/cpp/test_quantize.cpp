#include "zcore/quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
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
#include "zcore/cuda/quantize.h"
#include "zcore/cuda/runtime.h"
#include "zcore/status.h"

namespace zcore {
namespace {

// Reference conversions, ISA levels and error checks shared by the kernel tests.
using namespace testing_support;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kFp16Max = 65504.0f;

// ---------------------------------------------------------------- helpers --

constexpr DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// A buffer of one dtype and the exact fp32 value of each element.
struct Buffer {
  DType dtype = DType::kFloat32;
  std::vector<float> values;
  std::vector<float> f32;            // storage when dtype is fp32
  std::vector<std::uint16_t> half;   // storage otherwise

  Buffer(DType type, std::int64_t n) : dtype(type), values(n) {
    if (dtype == DType::kFloat32) {
      f32.assign(n, 0.0f);
    } else {
      half.assign(n, 0);
    }
  }

  // Rounds `wanted` to the dtype.
  static Buffer from(const std::vector<float>& wanted, DType type) {
    Buffer b(type, static_cast<std::int64_t>(wanted.size()));
    for (std::size_t i = 0; i < wanted.size(); ++i) {
      if (type == DType::kFloat32) {
        b.f32[i] = wanted[i];
      } else {
        b.half[i] = type == DType::kBFloat16 ? reference_bf16(wanted[i]) : reference_fp16(wanted[i]);
      }
    }
    b.refresh();
    return b;
  }

  void refresh() {
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = at(static_cast<std::int64_t>(i));
  }

  float at(std::int64_t i) const {
    switch (dtype) {
      case DType::kFloat32: return f32[i];
      case DType::kBFloat16: return bf16_to_float(half[i]);
      default: return fp16_to_float(half[i]);
    }
  }

  bool same_bits(const Buffer& other) const {
    // memcmp's pointers must not be null, even for no bytes: an empty fp32 buffer compares by size.
    return dtype == other.dtype && f32.size() == other.f32.size() && half == other.half &&
           (f32.empty() || std::memcmp(f32.data(), other.f32.data(), f32.size() * 4) == 0);
  }

  void* data() {
    return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : static_cast<void*>(half.data());
  }
  std::int64_t numel() const { return static_cast<std::int64_t>(values.size()); }
};

// Codes and scales of one quantized buffer, owning their memory.
struct Quantized {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;

  Quantized(const QuantFormat& f, std::int64_t n)
      : codes(quantized_bytes(f, n), 0xAB), scales(scale_count(f, n), -1.0f) {}
  QuantizedInput input() const { return QuantizedInput{codes.data(), scales.data()}; }
};

float max_code(int bits) { return bits == 8 ? 127.0f : 7.0f; }

std::int64_t block_size(const QuantFormat& f, std::int64_t numel, std::int64_t b) {
  return std::min(f.block, numel - b * f.block);
}

// --------------------------------------------------- the scalar reference --
// Written from the contract in quantize.h, sharing nothing with the kernels:
// std::isfinite and std::fabs for the maximum, std::nearbyint (the default
// rounding mode is to nearest even) for the codes.

int reference_code(const Quantized& q, int bits, std::int64_t i) {
  if (bits == 8) return static_cast<std::int8_t>(q.codes[i]);
  const int nibble = (q.codes[i / 2] >> (4 * (i % 2))) & 0xF;
  return nibble >= 8 ? nibble - 16 : nibble;
}

Quantized reference_quantize(const QuantFormat& f, const std::vector<float>& x) {
  const auto n = static_cast<std::int64_t>(x.size());
  Quantized q(f, n);
  std::fill(q.codes.begin(), q.codes.end(), 0);
  const float qmax = max_code(f.bits);
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(q.scales.size()); ++b) {
    const std::int64_t begin = b * f.block;
    const std::int64_t end = begin + block_size(f, n, b);
    bool finite = true;
    float max_abs = 0.0f;
    for (std::int64_t i = begin; i < end; ++i) {
      finite = finite && std::isfinite(x[i]);
      max_abs = std::max(max_abs, std::fabs(x[i]));
    }
    const float scale = finite ? max_abs / qmax : kNan;
    q.scales[b] = scale;
    if (!finite || scale == 0.0f) continue;
    for (std::int64_t i = begin; i < end; ++i) {
      const float code = std::min(qmax, std::max(-qmax, std::nearbyint(x[i] / scale)));
      const int c = static_cast<int>(code);
      if (f.bits == 8) {
        q.codes[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(c));
      } else {
        q.codes[i / 2] |= static_cast<std::uint8_t>((c & 0xF) << (4 * (i % 2)));
      }
    }
  }
  return q;
}

float reference_decode(const QuantFormat& f, const Quantized& q, std::int64_t i) {
  return static_cast<float>(reference_code(q, f.bits, i)) * q.scales[i / f.block];
}

// The fp32 value `value` as stored in `dtype` (rounded to nearest even).
float reference_round(float value, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return value;
    case DType::kBFloat16: return bf16_to_float(reference_bf16(value));
    default: return fp16_to_float(reference_fp16(value));
  }
}

bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || float_bits(a) == float_bits(b);
}

// Test data: blocks of normal values at magnitudes from subnormal to 1e30,
// zero blocks, blocks whose scale underflows, and blocks of exact ties
// (scale 2^-2, values at half-integer multiples of it).
std::vector<float> block_values(const QuantFormat& f, std::int64_t n, DType dtype,
                                std::uint32_t seed) {
  const std::vector<float> wide = {1.0f, 3e-3f, 250.0f, 1e-30f, 1e30f, 0x1p-140f, 0.0f, 0x1p-148f};
  const std::vector<float> fp16 = {1.0f, 3e-3f, 250.0f, 1e-6f, 0.0f};  // fp16's range
  const std::vector<float>& magnitudes = dtype == DType::kFloat16 ? fp16 : wide;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  const std::int64_t blocks = scale_count(f, n);
  const int qmax = static_cast<int>(max_code(f.bits));
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t begin = b * f.block;
    const std::int64_t end = begin + block_size(f, n, b);
    if (b % 5 == 4) {
      for (std::int64_t i = begin; i < end; ++i) {
        const auto k = static_cast<int>(i - begin);
        x[i] = ((k % qmax) + 0.5f) * 0.25f * (k % 2 == 0 ? 1.0f : -1.0f);
      }
      x[begin] = static_cast<float>(qmax) * 0.25f;
      continue;
    }
    const float magnitude = magnitudes[rng() % magnitudes.size()];
    for (std::int64_t i = begin; i < end; ++i) x[i] = normal(rng) * magnitude;
  }
  return x;
}

// |x - decoded| <= scale/2 + 2^-21 max|x| + 2^-142 (quantize.h), plus the
// rounding of the output dtype: half an ulp (bf16: 2^-8 relative, 2^-134
// absolute below its normal range; fp16: 2^-11 relative, 2^-25 absolute).
void expect_error_bound(const QuantFormat& f, const Buffer& x, const Quantized& q,
                        const Buffer& out, const std::string& what) {
  const std::int64_t n = x.numel();
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(q.scales.size()); ++b) {
    const float scale = q.scales[b];
    if (std::isnan(scale)) continue;  // non-finite blocks: checked on their own
    const std::int64_t begin = b * f.block;
    const std::int64_t end = begin + block_size(f, n, b);
    double max_abs = 0.0;
    for (std::int64_t i = begin; i < end; ++i) max_abs = std::max(max_abs, std::fabs(double{x.values[i]}));
    const double bound = scale / 2.0 + std::ldexp(max_abs, -21) + std::ldexp(1.0, -142);
    for (std::int64_t i = begin; i < end; ++i) {
      const double decoded = out.values[i];
      double rounding = 0.0;
      if (out.dtype == DType::kBFloat16) {
        rounding = std::ldexp(std::fabs(decoded), -8) + std::ldexp(1.0, -134);
      }
      if (out.dtype == DType::kFloat16) {
        if (std::fabs(x.values[i]) > kFp16Max) continue;  // overflows fp16 whatever the codes
        rounding = std::ldexp(std::fabs(decoded), -11) + std::ldexp(1.0, -25);
      }
      ASSERT_LE(std::fabs(double{x.values[i]} - decoded), bound + rounding)
          << what << ": element " << i << " of block " << b << ", x=" << x.values[i]
          << " decoded=" << decoded << " scale=" << scale;
    }
  }
}

// ------------------------------------------- kernels against the reference --

using QuantCase = std::tuple<CpuIsa, int, DType>;

class QuantizeMatchesReference : public ::testing::TestWithParam<QuantCase> {};

TEST_P(QuantizeMatchesReference, CodesScalesDecodedValuesAndTheErrorBound) {
  const auto [isa, bits, input_dtype] = GetParam();
  if (!cpu_isa_supported(isa)) GTEST_SKIP() << cpu_isa_name(isa) << " is not supported here";
  IsaScope scope(isa);
  for (std::int64_t block : {2, 16, 30, 256, 2048}) {
    const QuantFormat f{bits, block};
    for (std::int64_t n : {1, 2, 31, 257, 4099, 200003}) {
      const std::string what = "block=" + std::to_string(block) + " n=" + std::to_string(n);
      Buffer x = Buffer::from(block_values(f, n, input_dtype, static_cast<std::uint32_t>(n + block)),
                              input_dtype);
      Quantized q(f, n);
      quantize(f, x.data(), input_dtype, n, q.codes.data(), q.scales.data(), 2);
      const Quantized ref = reference_quantize(f, x.values);
      for (std::size_t b = 0; b < ref.scales.size(); ++b) {
        ASSERT_TRUE(same_value(q.scales[b], ref.scales[b]))
            << what << ": scale of block " << b << " is " << q.scales[b] << ", expected " << ref.scales[b];
      }
      ASSERT_EQ(q.codes, ref.codes) << what;
      for (DType out_dtype : kDtypes) {
        Buffer out(out_dtype, n);
        dequantize(f, q.input(), n, out.data(), out_dtype, 2);
        out.refresh();
        for (std::int64_t i = 0; i < n; ++i) {
          const float expected = reference_round(reference_decode(f, ref, i), out_dtype);
          ASSERT_TRUE(same_value(out.values[i], expected))
              << what << " out=" << dtype_name(out_dtype) << ": element " << i << " is "
              << out.values[i] << ", expected " << expected;
        }
        expect_error_bound(f, x, q, out, what + " out=" + dtype_name(out_dtype));
      }
    }
  }
}

std::string quant_case_name(const ::testing::TestParamInfo<QuantCase>& info) {
  return std::string(cpu_isa_name(std::get<0>(info.param))) + "_int" +
         std::to_string(std::get<1>(info.param)) + "_" + dtype_name(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Isas, QuantizeMatchesReference,
                         ::testing::Combine(::testing::ValuesIn(all_isas()), ::testing::Values(8, 4),
                                            ::testing::ValuesIn(kDtypes)),
                         quant_case_name);

TEST(Quantize, RoundsHalfToEvenAndClampsToTheCodeRange) {
  // max|x| = 127 * 2^-3 (int8) or 7 * 2^-3 (int4): scale 2^-3, so x / scale
  // is exact and the halves are true ties.
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (int bits : {8, 4}) {
      const float qmax = max_code(bits);
      const std::vector<float> halves = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.5f, -3.5f};
      const std::vector<int> expected_codes = {0, 2, 2, 0, -2, -2, 4, -4};
      std::vector<float> x = {qmax * 0.125f, -qmax * 0.125f};
      for (float h : halves) x.push_back(h * 0.125f);
      const QuantFormat f{bits, static_cast<std::int64_t>(x.size())};
      Quantized q(f, static_cast<std::int64_t>(x.size()));
      quantize(f, x.data(), DType::kFloat32, static_cast<std::int64_t>(x.size()), q.codes.data(),
               q.scales.data(), 1);
      EXPECT_EQ(q.scales[0], 0.125f);
      EXPECT_EQ(reference_code(q, bits, 0), static_cast<int>(qmax));
      EXPECT_EQ(reference_code(q, bits, 1), -static_cast<int>(qmax));
      for (std::size_t k = 0; k < halves.size(); ++k) {
        EXPECT_EQ(reference_code(q, bits, static_cast<std::int64_t>(k + 2)), expected_codes[k])
            << cpu_isa_name(isa) << " int" << bits << ": " << halves[k];
      }
    }
  }
}

TEST(Quantize, PacksInt4LowNibbleFirstAndZeroesThePadNibble) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    // Block 0 has scale 1; block 1 is one element, coded 7, and a pad nibble.
    const std::vector<float> x = {7.0f, -1.0f, 3.0f, -7.0f, 2.0f};
    const QuantFormat f{4, 4};
    Quantized q(f, 5);
    quantize(f, x.data(), DType::kFloat32, 5, q.codes.data(), q.scales.data(), 1);
    EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0xF7, 0x93, 0x07})) << cpu_isa_name(isa);
  }
}

TEST(Quantize, ZeroBlocksHaveScaleZeroAndDecodeToZeros) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (int bits : {8, 4}) {
      const QuantFormat f{bits, 32};
      std::vector<float> x(100, 0.0f);  // blocks 0 and 3 (partial) zero, block 1 -0.0
      for (int i = 32; i < 64; ++i) x[i] = -0.0f;
      for (int i = 64; i < 96; ++i) x[i] = 0.01f * static_cast<float>(i - 80);
      Quantized q(f, 100);
      quantize(f, x.data(), DType::kFloat32, 100, q.codes.data(), q.scales.data(), 1);
      EXPECT_EQ(q.scales, (std::vector<float>{0.0f, 0.0f, q.scales[2], 0.0f}));
      EXPECT_GT(q.scales[2], 0.0f);
      for (std::int64_t i : {0, 40, 96, 99}) EXPECT_EQ(reference_code(q, bits, i), 0);
      std::vector<float> out(100, 1.0f);
      dequantize(f, q.input(), 100, out.data(), DType::kFloat32, 1);
      for (std::int64_t i : {0, 31, 32, 63, 96, 99}) EXPECT_EQ(float_bits(out[i]), 0u) << i;
    }
  }
}

TEST(Quantize, ScalesThatUnderflowGiveZeroBlocksWithinTheBound) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (int bits : {8, 4}) {
      const QuantFormat f{bits, 4};
      // max|x| = 2^-149: its scale rounds to 0; then a subnormal scale.
      const std::vector<float> x = {0x1p-149f, -0x1p-149f, 0.0f, 0x1p-149f,
                                    0x1p-130f, -0x1p-131f, 0x1p-149f, 0x1p-135f};
      Quantized q(f, 8);
      quantize(f, x.data(), DType::kFloat32, 8, q.codes.data(), q.scales.data(), 1);
      EXPECT_EQ(q.scales[0], 0.0f);
      EXPECT_GT(q.scales[1], 0.0f);
      Buffer in = Buffer::from(x, DType::kFloat32);
      Buffer out(DType::kFloat32, 8);
      dequantize(f, q.input(), 8, out.data(), DType::kFloat32, 1);
      out.refresh();
      expect_error_bound(f, in, q, out, std::string(cpu_isa_name(isa)) + " int" + std::to_string(bits));
    }
  }
}

// ------------------------------------------------------ non-finite inputs --

TEST(Quantize, BlocksWithNanOrInfDecodeToNanAndLeaveOtherBlocksAlone) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (int bits : {8, 4}) {
      for (DType input_dtype : kDtypes) {
        const QuantFormat f{bits, 8};
        std::vector<float> wanted(38);
        for (std::size_t i = 0; i < wanted.size(); ++i) wanted[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
        wanted[3] = kNan;    // block 0
        wanted[8] = kInf;    // block 1
        wanted[23] = -kInf;  // block 2
        wanted[37] = kNan;   // block 4, the partial one
        Buffer x = Buffer::from(wanted, input_dtype);
        Quantized q(f, 38);
        quantize(f, x.data(), input_dtype, 38, q.codes.data(), q.scales.data(), 1);
        const std::string what = std::string(cpu_isa_name(isa)) + " int" + std::to_string(bits) +
                                 " " + dtype_name(input_dtype);
        for (int b : {0, 1, 2, 4}) {
          EXPECT_TRUE(std::isnan(q.scales[b])) << what << " block " << b;
          for (std::int64_t i = b * 8; i < std::min<std::int64_t>(38, b * 8 + 8); ++i) {
            EXPECT_EQ(reference_code(q, bits, i), 0) << what << " element " << i;
          }
        }
        EXPECT_TRUE(std::isfinite(q.scales[3]) && q.scales[3] > 0.0f) << what;
        for (DType out_dtype : kDtypes) {
          Buffer out(out_dtype, 38);
          dequantize(f, q.input(), 38, out.data(), out_dtype, 1);
          out.refresh();
          for (std::int64_t i = 0; i < 38; ++i) {
            EXPECT_EQ(std::isnan(out.values[i]), i / 8 != 3)
                << what << " out=" << dtype_name(out_dtype) << " element " << i;
          }
        }
        std::vector<float> acc(38, 1.0f);
        dequantize_add(f, {q.input()}, 38, acc.data(), 1);
        for (std::int64_t i = 0; i < 38; ++i) {
          EXPECT_EQ(std::isnan(acc[i]), i / 8 != 3) << what << " acc element " << i;
        }
      }
    }
  }
}

// --------------------------------------------------------- dequantize_add --

TEST(DequantizeAdd, SeveralInputsEqualOneCallPerInputAndTheReference) {
  for (CpuIsa isa : supported_isas()) {
    IsaScope scope(isa);
    for (int bits : {8, 4}) {
      for (std::int64_t block : {30, 128}) {
        const QuantFormat f{bits, block};
        const std::int64_t n = 70001;
        std::vector<Quantized> parts;
        for (std::uint32_t k = 0; k < 5; ++k) {
          std::vector<float> x = block_values(f, n, DType::kFloat32, 100 + k);
          for (float& v : x) v = std::fabs(v) > 1e6f ? 1.0f : v;  // keep the sums finite
          parts.push_back(reference_quantize(f, x));
        }
        std::vector<QuantizedInput> inputs;
        for (const Quantized& p : parts) inputs.push_back(p.input());
        std::vector<float> acc(n);
        std::mt19937 rng(3);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& a : acc) a = normal(rng);
        std::vector<float> one_call = acc;
        std::vector<float> per_input = acc;
        dequantize_add(f, inputs, n, one_call.data(), 2);
        for (const QuantizedInput& in : inputs) dequantize_add(f, {in}, n, per_input.data(), 2);
        for (std::int64_t i = 0; i < n; ++i) {
          float expected = acc[i];
          for (const Quantized& p : parts) expected = expected + reference_decode(f, p, i);
          ASSERT_EQ(float_bits(one_call[i]), float_bits(expected))
              << cpu_isa_name(isa) << " int" << bits << " block=" << block << " element " << i;
          ASSERT_EQ(float_bits(per_input[i]), float_bits(expected)) << "element " << i;
        }
      }
    }
  }
}

TEST(DequantizeAdd, NoInputsLeavesTheAccumulatorAlone) {
  std::vector<float> acc = {1.0f, 2.0f};
  dequantize_add(QuantFormat{8, 2}, {}, 2, acc.data(), 1);
  EXPECT_EQ(acc, (std::vector<float>{1.0f, 2.0f}));
}

// ------------------------------------------ identical bits on every path --

TEST(Quantize, EveryIsaAndThreadCountGivesTheSameBits) {
  const std::int64_t n = 300001;
  for (int bits : {8, 4}) {
    for (std::int64_t block : {2, 96, 4096}) {
      const QuantFormat f{bits, block};
      for (DType input_dtype : kDtypes) {
        std::vector<float> wanted = block_values(f, n, input_dtype, 42);
        wanted[5] = kNan;
        wanted[n / 2] = -kInf;
        Buffer x = Buffer::from(wanted, input_dtype);
        // Everything one path computes: codes, scales, each output dtype, a sum.
        struct Result {
          Quantized q;
          std::vector<Buffer> outs;
          std::vector<float> acc;
        };
        const auto run = [&](CpuIsa isa, int threads) {
          IsaScope scope(isa);
          Result r{Quantized(f, n), {}, std::vector<float>(n, 0.5f)};
          quantize(f, x.data(), input_dtype, n, r.q.codes.data(), r.q.scales.data(), threads);
          for (DType out_dtype : kDtypes) {
            r.outs.emplace_back(out_dtype, n);
            dequantize(f, r.q.input(), n, r.outs.back().data(), out_dtype, threads);
          }
          dequantize_add(f, {r.q.input(), r.q.input()}, n, r.acc.data(), threads);
          return r;
        };
        const Result expected = run(CpuIsa::kScalar, 1);
        for (CpuIsa isa : supported_isas()) {
          for (int threads : {1, 2, 5}) {
            const Result got = run(isa, threads);
            const std::string what = std::string(cpu_isa_name(isa)) + " threads=" +
                                     std::to_string(threads) + " int" + std::to_string(bits) +
                                     " block=" + std::to_string(block) + " " + dtype_name(input_dtype);
            ASSERT_EQ(got.q.codes, expected.q.codes) << what;
            ASSERT_EQ(0, std::memcmp(got.q.scales.data(), expected.q.scales.data(),
                                     expected.q.scales.size() * 4))
                << what;
            for (std::size_t k = 0; k < expected.outs.size(); ++k) {
              ASSERT_TRUE(got.outs[k].same_bits(expected.outs[k]))
                  << what << " out=" << dtype_name(expected.outs[k].dtype);
            }
            ASSERT_EQ(0, std::memcmp(got.acc.data(), expected.acc.data(), n * 4)) << what;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------- bad arguments --

TEST(QuantizeArguments, BadCallsThrowInvalidArgumentAndWriteNothing) {
  std::vector<float> x(64, 1.0f);
  std::vector<std::uint8_t> codes(64, 0xAB);
  std::vector<float> scales(64, -1.0f);
  std::vector<float> acc(64, 2.0f);
  const QuantFormat good{8, 16};
  const auto quantize_with = [&](QuantFormat f) {
    return [&, f] { quantize(f, x.data(), DType::kFloat32, 64, codes.data(), scales.data(), 1); };
  };
  expect_invalid(quantize_with({8, 0}), "block=0");
  expect_invalid(quantize_with({8, -4}), "block=-4");
  expect_invalid(quantize_with({3, 16}), "bits=3");
  expect_invalid(quantize_with({4, 15}), "must be even");
  expect_invalid([&] { quantize(good, nullptr, DType::kFloat32, 64, codes.data(), scales.data(), 1); },
                 "input is null");
  expect_invalid([&] { quantize(good, x.data(), DType::kFloat32, 64, nullptr, scales.data(), 1); },
                 "codes is null");
  expect_invalid([&] { quantize(good, x.data(), DType::kFloat32, 64, codes.data(), nullptr, 1); },
                 "scales is null");
  expect_invalid([&] { quantize(good, x.data(), DType::kFloat32, -1, codes.data(), scales.data(), 1); },
                 "numel=-1");
  expect_invalid([&] { quantize(good, x.data(), DType::kFloat32, 64, codes.data(), scales.data(), 0); },
                 "threads=0");
  expect_invalid([&] { quantize(good, x.data(), static_cast<DType>(7), 64, codes.data(), scales.data(), 1); },
                 "unsupported dtype");
  expect_invalid(
      [&] {
        quantize(good, reinterpret_cast<unsigned char*>(x.data()) + 2, DType::kFloat32, 8, codes.data(),
                 scales.data(), 1);
      },
      "not aligned");
  expect_invalid([&] { quantize(good, x.data(), DType::kFloat32, 64, x.data(), scales.data(), 1); },
                 "overlap");
  EXPECT_EQ(codes, std::vector<std::uint8_t>(64, 0xAB));
  EXPECT_EQ(scales, std::vector<float>(64, -1.0f));

  const QuantizedInput in{codes.data(), scales.data()};
  expect_invalid([&] { dequantize({4, 3}, in, 64, x.data(), DType::kFloat32, 1); }, "must be even");
  expect_invalid([&] { dequantize(good, {nullptr, scales.data()}, 64, x.data(), DType::kFloat32, 1); },
                 "input.codes is null");
  expect_invalid([&] { dequantize(good, in, 64, nullptr, DType::kBFloat16, 1); }, "output is null");
  expect_invalid([&] { dequantize(good, in, 64, scales.data(), DType::kFloat32, 1); }, "overlap");
  expect_invalid([&] { dequantize_add({8, 0}, {in}, 64, acc.data(), 1); }, "block=0");
  expect_invalid([&] { dequantize_add(good, {in, {codes.data(), nullptr}}, 64, acc.data(), 1); },
                 "inputs[1].scales is null");
  expect_invalid([&] { dequantize_add(good, {in}, 64, nullptr, 1); }, "acc is null");
  expect_invalid([&] { dequantize_add(good, {in}, 64, scales.data(), 1); }, "overlap");
  EXPECT_EQ(x, std::vector<float>(64, 1.0f));
  EXPECT_EQ(acc, std::vector<float>(64, 2.0f));

  // Empty buffers need no memory.
  quantize(good, nullptr, DType::kFloat32, 0, nullptr, nullptr, 1);
  dequantize(good, {nullptr, nullptr}, 0, nullptr, DType::kFloat16, 1);
  dequantize_add(good, {{nullptr, nullptr}}, 0, nullptr, 1);
}

TEST(QuantizeArguments, SizesOfCodesAndScales) {
  EXPECT_EQ(quantized_bytes({8, 16}, 33), 33);
  EXPECT_EQ(quantized_bytes({4, 16}, 33), 17);
  EXPECT_EQ(quantized_bytes({4, 2}, 0), 0);
  EXPECT_EQ(scale_count({8, 16}, 33), 3);
  EXPECT_EQ(scale_count({4, 16}, 32), 2);
  EXPECT_EQ(scale_count({8, 1000}, 0), 0);
  expect_invalid([] { scale_count({8, 16}, -3); }, "numel=-3");
  expect_invalid([] { quantized_bytes({2, 16}, 3); }, "bits=2");
}

// ------------------------------------------------------------------- CUDA --

TEST(CudaQuantize, EntryPointsRefuseCleanlyWithoutAGpu) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present: covered by tests/python/test_quantization.py";
  const QuantFormat f{8, 16};
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { cuda::quantize(f, nullptr, DType::kFloat32, 0, nullptr, nullptr, 0); },
           [&] { cuda::dequantize(f, {nullptr, nullptr}, 0, nullptr, DType::kFloat32, 0); },
           [&] { cuda::dequantize_add(f, {}, 0, nullptr, 0); }}) {
    EXPECT_EQ(error_of(call).code(), StatusCode::kCudaUnavailable);
  }
}

}  // namespace
}  // namespace zcore
