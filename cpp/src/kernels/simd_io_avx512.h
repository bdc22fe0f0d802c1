// The AVX-512 kernel level's register of 16 floats and its loads and stores
// (fp32, bf16, and fp16 through vcvtph2ps/vcvtps2ph). Each kernel family's
// AVX-512 traits class (adam_avx512.cpp, quantize_avx512.cpp) derives from
// Avx512Io and adds its arithmetic.
//
// Include it only from translation units compiled with the AVX-512 flags
// (zcore_avx512_sources in cpp/CMakeLists.txt); internal linkage, for the
// reason given in adam_simd.h.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "simd_io_avx512.h needs -mavx512f -mavx512bw -mavx512vl (the AVX-512 kernel files only)"
#endif

#include <immintrin.h>

#include <cstdint>

namespace zcore::simd {
namespace {

struct Avx512Io {
  static constexpr int kWidth = 16;
  using F = __m512;

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
};

}  // namespace
}  // namespace zcore::simd
