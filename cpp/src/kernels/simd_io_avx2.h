// The AVX2 kernel level's register of 8 floats and its loads and stores
// (fp32, bf16, and fp16 through F16C). Each kernel family's AVX2 traits class
// (adam_avx2.cpp, quantize_avx2.cpp) derives from Avx2Io and adds its
// arithmetic.
//
// Include it only from translation units compiled with the AVX2 flags
// (zcore_avx2_sources in cpp/CMakeLists.txt); internal linkage, for the
// reason given in adam_simd.h.
#pragma once

#if !defined(__AVX2__) || !defined(__F16C__)
#error "simd_io_avx2.h needs -mavx2 -mf16c (the AVX2 kernel files only)"
#endif

#include <immintrin.h>

#include <cstdint>

namespace zcore::simd {
namespace {

struct Avx2Io {
  static constexpr int kWidth = 8;
  using F = __m256;

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
};

}  // namespace
}  // namespace zcore::simd
