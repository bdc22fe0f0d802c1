// The CUDA quantization kernels of a build without CUDA: they report why and throw.
#include "zcore/cuda/quantize.h"
#include "zcore/cuda/runtime.h"

namespace zcore::cuda {

void quantize(const QuantFormat&, const void*, DType, std::int64_t, void*, float*, std::uintptr_t) {
  require_available();
}

void dequantize(const QuantFormat&, const QuantizedInput&, std::int64_t, void*, DType,
                std::uintptr_t) {
  require_available();
}

void dequantize_add(const QuantFormat&, const std::vector<QuantizedInput>&, std::int64_t, float*,
                    std::uintptr_t) {
  require_available();
}

}  // namespace zcore::cuda
