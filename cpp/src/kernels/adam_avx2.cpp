// AVX2 + FMA + F16C instantiation of the kernels in adam_simd.h. Compiled
// with -mavx2 -mfma -mf16c; called only when the CPU reports all three.
#include <immintrin.h>

#include "adam_simd.h"
#include "simd_io_avx2.h"

namespace zcore::adam_kernels {
namespace {

// Loads and stores from simd_io_avx2.h.
struct Avx2 : simd::Avx2Io {
  static constexpr int kDPerBlock = 4;
  using D = __m256d;

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
