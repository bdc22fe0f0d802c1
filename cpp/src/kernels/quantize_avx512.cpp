// AVX-512 (F, BW, VL) instantiation of the kernels in quantize_simd.h.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mf16c; called only when the
// CPU and the OS (ZMM state enabled) support AVX-512.
#include <immintrin.h>

#include "quantize_simd.h"
#include "simd_io_avx512.h"

namespace zcore::quantize_kernels {
namespace {

// Loads and stores from simd_io_avx512.h.
struct Avx512 : simd::Avx512Io {
  using I = __m512i;

  static F set1(float a) { return _mm512_set1_ps(a); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F round_even(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F clamp(F a, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(a, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
  }
  static I to_int(F a) { return _mm512_cvttps_epi32(a); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }

  static I izero() { return _mm512_setzero_si512(); }
  static I max_abs_bits(I acc, F x) {
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_max_epi32(acc, magnitude);
  }
  static std::int32_t reduce_max(I a) { return _mm512_reduce_max_epi32(a); }

  static I load_int8(const std::int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_int8(std::int8_t* p, I q) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(q));
  }
  // As in quantize_avx2.cpp: byte k becomes 64-bit lane k with its nibbles in
  // int32 lanes 2k and 2k + 1, sign-extended by a shift pair.
  static I load_int4(const std::uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m512i split = _mm512_or_si512(
        _mm512_and_si512(b, _mm512_set1_epi64(0xF)),
        _mm512_slli_epi64(_mm512_and_si512(b, _mm512_set1_epi64(0xF0)), 28));
    return _mm512_srai_epi32(_mm512_slli_epi32(split, 28), 28);
  }
  // Nibbles of lanes 2k and 2k + 1 meet in the low byte of 64-bit lane k,
  // which the truncating vpmovqb collects.
  static void store_int4(std::uint8_t* p, I q) {
    const __m512i nibbles = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    const __m512i pairs = _mm512_or_si512(nibbles, _mm512_srli_epi64(nibbles, 28));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm512_cvtepi64_epi8(pairs));
  }
};

}  // namespace

Kernels avx512_kernels() { return kernels_of<Avx512>(); }

}  // namespace zcore::quantize_kernels
