// AVX-512 (F, BW, VL) instantiation of the kernels in adam_simd.h. Compiled
// with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c; called only when the CPU
// and the OS (ZMM state enabled) support AVX-512.
#include <immintrin.h>

#include "adam_simd.h"
#include "simd_io_avx512.h"

namespace zcore::adam_kernels {
namespace {

// Loads and stores from simd_io_avx512.h.
struct Avx512 : simd::Avx512Io {
  static constexpr int kDPerBlock = 2;
  using D = __m512d;

  static F set1(float a) { return _mm512_set1_ps(a); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  static D dzero() { return _mm512_setzero_pd(); }
  // Exact squares in double: the fma rounds only the sum (see adam_avx2.cpp).
  static void add_squares(D* acc, F x, int /*part: always 0, one register per block*/) {
    const D lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const D hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
  }
  static void store_lanes(const D* acc, double* lanes) {
    _mm512_storeu_pd(lanes, acc[0]);
    _mm512_storeu_pd(lanes + 8, acc[1]);
  }
};

}  // namespace

Kernels avx512_kernels() { return kernels_of<Avx512>(); }

}  // namespace zcore::adam_kernels
