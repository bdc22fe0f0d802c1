// AVX2 + F16C instantiation of the kernels in quantize_simd.h. Compiled with
// -mavx2 -mfma -mf16c; called only when the CPU reports all three.
#include <immintrin.h>

#include "quantize_simd.h"
#include "simd_io_avx2.h"

namespace zcore::quantize_kernels {
namespace {

// Loads and stores from simd_io_avx2.h.
struct Avx2 : simd::Avx2Io {
  using I = __m256i;

  static F set1(float a) { return _mm256_set1_ps(a); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F round_even(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F clamp(F a, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
  }
  static I to_int(F a) { return _mm256_cvttps_epi32(a); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }

  static I izero() { return _mm256_setzero_si256(); }
  static I max_abs_bits(I acc, F x) {
    const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_max_epi32(acc, magnitude);
  }
  static std::int32_t reduce_max(I a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(m);
  }

  static I load_int8(const std::int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_int8(std::int8_t* p, I q) {
    // The codes fit in int8, so the saturating packs only narrow.
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
  // Byte k goes to 64-bit lane k as b | (b << 28): its low nibble lands in
  // int32 lane 2k, its high nibble in lane 2k + 1; shifting each lane left
  // then arithmetic right by 28 sign-extends the nibble.
  static I load_int4(const std::uint8_t* p) {
    std::int32_t four_bytes;
    std::memcpy(&four_bytes, p, 4);
    const __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four_bytes));
    const __m256i split = _mm256_or_si256(
        _mm256_and_si256(b, _mm256_set1_epi64x(0xF)),
        _mm256_slli_epi64(_mm256_and_si256(b, _mm256_set1_epi64x(0xF0)), 28));
    return _mm256_srai_epi32(_mm256_slli_epi32(split, 28), 28);
  }
  // Nibbles of lanes 2k and 2k + 1 meet in the low byte of 64-bit lane k.
  static void store_int4(std::uint8_t* p, I q) {
    const __m256i nibbles = _mm256_and_si256(q, _mm256_set1_epi32(0xF));
    const __m256i pairs = _mm256_or_si256(nibbles, _mm256_srli_epi64(nibbles, 28));
    // Bytes 0 and 8 of each 128-bit lane hold the two bytes of that lane.
    const __m256i gather = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i bytes = _mm256_shuffle_epi8(pairs, gather);
    const std::uint32_t four_bytes =
        static_cast<std::uint32_t>(_mm256_extract_epi16(bytes, 0)) |
        (static_cast<std::uint32_t>(_mm256_extract_epi16(bytes, 8)) << 16);
    std::memcpy(p, &four_bytes, 4);
  }
};

}  // namespace

Kernels avx2_kernels() { return kernels_of<Avx2>(); }

}  // namespace zcore::quantize_kernels
