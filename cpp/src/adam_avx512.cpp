// AVX-512 (F, BW, VL) instantiation of the kernels in adam_simd.h. Compiled
// with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c; called only when the CPU
// and the OS (ZMM state enabled) support AVX-512.
#include <immintrin.h>

#include "adam_simd.h"

namespace zcore::adam_kernels {
namespace {

struct Avx512 {
  static constexpr int kWidth = 16;
  static constexpr int kDPerBlock = 2;
  using F = __m512;
  using D = __m512d;

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load_bf16(const std::uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_fp16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Round to nearest even as c10::BFloat16 does; every nan becomes 0x7FC0.
  static void store_bf16(std::uint16_t* p, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_fp16(std::uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

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
