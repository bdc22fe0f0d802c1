// Element types of the buffers the native kernels read and write. The core
// never sees torch dtypes: Python maps torch.float32/bfloat16/float16 onto
// these values before handing pointers over.
#pragma once

#include <cstdint>

namespace zcore {

enum class DType : std::uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

const char* dtype_name(DType dtype);

// Bytes per element; 0 for a value outside the enum (rejected by callers).
std::int64_t dtype_size(DType dtype);

}  // namespace zcore
