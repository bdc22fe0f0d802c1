#include "zcore/cuda/runtime.h"

#include <gtest/gtest.h>

#include "zcore/status.h"

namespace zcore::cuda {
namespace {

TEST(CudaRuntime, QueriesAgreeAndNeverThrow) {
  const int count = device_count();
  EXPECT_GE(count, 0);
  EXPECT_EQ(unavailable_reason().empty(), count > 0);
  if (!built_with_cuda()) EXPECT_EQ(count, 0);
}

TEST(CudaRuntime, EntryPointsRefuseCleanlyWithoutAGpu) {
  if (device_count() > 0) GTEST_SKIP() << "a GPU is present: covered by the device tests";
  try {
    DeviceByteMover mover(nullptr, 0);
    FAIL() << "expected CudaUnavailable";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kCudaUnavailable);
    EXPECT_NE(std::string(e.what()).find("CUDA is unavailable"), std::string::npos);
  }
  EXPECT_THROW(require_available(), Error);
}

}  // namespace
}  // namespace zcore::cuda
