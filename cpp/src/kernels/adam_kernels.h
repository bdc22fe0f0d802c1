// Internal interface between adam.cpp (validation, threading, dispatch) and
// the per-ISA translation units adam_scalar.cpp, adam_avx2.cpp and
// adam_avx512.cpp, each compiled with its own target flags.
#pragma once

#include <cstdint>

#include "zcore/adam.h"

namespace zcore::adam_kernels {

// Chunk boundaries handed to the kernels are multiples of this; only the end
// of a buffer may fall inside a block, and that partial block is run padded.
constexpr std::int64_t kBlock = 16;

// Elements [begin, end) of one tensor; begin is a multiple of kBlock.
using AdamRangeFn = void (*)(const AdamScalars&, const AdamTensor&, std::int64_t begin,
                             std::int64_t end);
// Scales elements [begin, end) of one buffer (writing back if asked) and
// returns the sum of squares, accumulated in 16 double lanes (lane j takes the
// elements with index % 16 == j) reduced in a fixed order, so that every ISA
// returns the same bits.
using SumSqRangeFn = double (*)(const GradBuffer&, float scale, bool write_back,
                                std::int64_t begin, std::int64_t end);

struct Kernels {
  AdamRangeFn adam;
  SumSqRangeFn sum_sq;
};

Kernels scalar_kernels();
#if defined(ZCORE_X86_KERNELS)
Kernels avx2_kernels();
Kernels avx512_kernels();
#endif

}  // namespace zcore::adam_kernels
