// Blockwise symmetric quantization for quantized collectives (ZeRO++: qwZ
// quantizes the weights of the forward all-gather, qgZ the gradients of the
// reduce-scatter).
//
// A buffer of `numel` elements is cut into blocks of `block` elements (the
// last one may be partial); each block gets one fp32 scale and one signed
// code per element:
//   int8: scale = max|x| / 127, q = clamp(rne(x / scale), -127, 127),
//         one int8 per element;
//   int4: scale = max|x| / 7,   q = clamp(rne(x / scale), -7, 7), two codes
//         per byte, element 2k in the low nibble and 2k+1 in the high one,
//         as two's complement nibbles (block must be even, so that every
//         block starts on a byte; the high nibble after an odd numel is 0).
// rne is round half to even; every operation is one IEEE fp32 operation
// (x is converted exactly from bf16/fp16 first). Decoding is q * scale in
// fp32, then rounded to nearest even for a bf16/fp16 output.
//
// Special blocks:
//   - all zeros: scale 0, codes 0, decodes to zeros. A block whose scale
//     underflows to 0 (max|x| < 2^-143) is stored the same way.
//   - any NaN or +-Inf in the block: scale NaN, codes 0; every element of the
//     block decodes to NaN (in every output dtype), and dequantize_add turns
//     the whole block of the accumulator into NaN. So an fp16 overflow check
//     downstream still sees the overflow; Inf is not kept as Inf (a code has
//     no room for it), and no finite value is ever made up.
//
// Error bound, element by element, in a finite block with scale s:
//   |x - q * s| <= s / 2 + 2^-21 * max|x| + 2^-142
// (the last two terms are the fp32 rounding of the division and the product,
// and the coarse grid of a subnormal scale), plus the rounding of a bf16/fp16
// output.
//
// Every ISA level of cpu_isa.h gives the same bits (codes, scales, outputs),
// whatever the thread count: blocks are independent, and each element goes
// through the same IEEE operations. Arguments are validated before any byte
// is written; a bad call throws Error(kInvalidArgument) naming the argument
// and the values involved.
#pragma once

#include <cstdint>
#include <vector>

#include "zcore/dtype.h"

namespace zcore {

// How a buffer is quantized; the same on both sides of a collective.
struct QuantFormat {
  int bits = 8;               // 8 (int8 codes) or 4 (packed int4 codes)
  std::int64_t block = 256;   // elements per scale; > 0, and even for 4 bits
};

// Bytes of codes for `numel` elements: numel (8 bits) or ceil(numel / 2).
std::int64_t quantized_bytes(const QuantFormat& format, std::int64_t numel);

// Scales for `numel` elements: ceil(numel / block).
std::int64_t scale_count(const QuantFormat& format, std::int64_t numel);

// Throws Error(kInvalidArgument) unless bits is 4 or 8 and block fits it.
void check_quant_format(const QuantFormat& format);

// One quantized buffer as dequantize_add reads it.
struct QuantizedInput {
  const void* codes = nullptr;     // quantized_bytes(format, numel) bytes
  const float* scales = nullptr;   // scale_count(format, numel) scales
};

// Quantizes `numel` elements of `input` (fp32, bf16 or fp16) into `codes`
// and `scales`, on up to `threads` threads. Outputs must not overlap the input.
void quantize(const QuantFormat& format, const void* input, DType input_dtype,
              std::int64_t numel, void* codes, float* scales, int threads);

// Decodes `numel` elements into `output` (fp32, bf16 or fp16), which must not
// overlap the codes or scales.
void dequantize(const QuantFormat& format, const QuantizedInput& input, std::int64_t numel,
                void* output, DType output_dtype, int threads);

// acc[i] = (((acc[i] + x0[i]) + x1[i]) + ...) in fp32, xk = the decoded
// inputs[k], in input order: the same bits as one call per input in turn,
// with the accumulator read and written once. The reduce side of a quantized
// reduce-scatter. `acc` must not overlap any input.
void dequantize_add(const QuantFormat& format, const std::vector<QuantizedInput>& inputs,
                    std::int64_t numel, float* acc, int threads);

// The checks of the three calls above (shared with the CUDA launchers, which
// see the same arguments), without the thread count.
void check_quantize_arguments(const QuantFormat& format, const void* input, DType input_dtype,
                              std::int64_t numel, const void* codes, const float* scales);
void check_dequantize_arguments(const QuantFormat& format, const QuantizedInput& input,
                                std::int64_t numel, const void* output, DType output_dtype);
void check_dequantize_add_arguments(const QuantFormat& format,
                                    const std::vector<QuantizedInput>& inputs,
                                    std::int64_t numel, const float* acc);

}  // namespace zcore
