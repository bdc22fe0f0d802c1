// AVX2 + FMA + F16C instantiation of the kernels in adam_simd.h. Compiled
// with -mavx2 -mfma -mf16c; called only when the CPU reports all three.
#include <immintrin.h>

#include "adam_simd.h"

namespace zcore::adam_kernels {
namespace {

struct Avx2 {
  static constexpr int kWidth = 8;
  static constexpr int kDPerBlock = 4;
  using F = __m256;
  using D = __m256d;

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const std::uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load_fp16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Round to nearest even as c10::BFloat16 does; every nan becomes 0x7FC0.
  static void store_bf16(std::uint16_t* p, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // packus works per 128-bit lane: take qwords 0 and 2 of the packed result.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_fp16(std::uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static F set1(float a) { return _mm256_set1_ps(a); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static D dzero() { return _mm256_setzero_pd(); }
  // A float's square is exact in double, so the fma rounds only the sum, as
  // the scalar path's add does.
  static void add_squares(D* acc, F x, int part) {
    const D lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const D hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc[2 * part] = _mm256_fmadd_pd(lo, lo, acc[2 * part]);
    acc[2 * part + 1] = _mm256_fmadd_pd(hi, hi, acc[2 * part + 1]);
  }
  static void store_lanes(const D* acc, double* lanes) {
    for (int k = 0; k < kDPerBlock; ++k) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
  }
};

}  // namespace

Kernels avx2_kernels() { return kernels_of<Avx2>(); }

}  // namespace zcore::adam_kernels
