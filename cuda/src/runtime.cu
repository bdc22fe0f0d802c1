#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "check.h"
#include "zcore/cuda/runtime.h"
#include "zcore/status.h"

namespace zcore::cuda {
namespace {

// A move whose source and destination are at least this far apart is copied
// directly in chunks of that distance; closer ones are staged through a
// scratch buffer so that tiny shifts of large blocks are not split into
// millions of copies.
constexpr std::uint64_t kDirectChunkMin = 16ull << 20;
constexpr std::uint64_t kScratchMax = 64ull << 20;

cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void copy_chunks(unsigned char* dst, const unsigned char* src, std::uint64_t bytes,
                 std::uint64_t chunk, cudaStream_t stream) {
  for (std::uint64_t done = 0; done < bytes; done += chunk) {
    const std::uint64_t n = std::min(chunk, bytes - done);
    check(cudaMemcpyAsync(dst + done, src + done, n, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync (arena move)");
  }
}

}  // namespace

bool built_with_cuda() { return true; }

int device_count() {
  int count = 0;  // cudaGetDeviceCount leaves it untouched on error
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls start clean
    return 0;
  }
  return count;
}

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA driver or device (") + cudaGetErrorName(err) + ": " +
           cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)";
  return "";
}

void require_available() {
  const std::string reason = unavailable_reason();
  if (!reason.empty()) throw Error(StatusCode::kCudaUnavailable, "CUDA is unavailable: " + reason);
}

DeviceByteMover::DeviceByteMover(void* base, std::uintptr_t stream)
    : base_(static_cast<unsigned char*>(base)), stream_(stream) {
  require_available();
}

void DeviceByteMover::apply(const std::vector<Move>& moves) {
  const cudaStream_t stream = as_stream(stream_);
  unsigned char* scratch = nullptr;
  std::uint64_t scratch_bytes = 0;
  for (const Move& m : moves) {
    const std::uint64_t distance = m.src - m.dst;
    unsigned char* dst = base_ + m.dst;
    const unsigned char* src = base_ + m.src;
    if (distance >= m.bytes || distance >= kDirectChunkMin) {
      // Chunks no longer than the distance never overlap their own source,
      // and going upwards never overwrites a source still to be read.
      copy_chunks(dst, src, m.bytes, std::min(distance, m.bytes), stream);
      continue;
    }
    const std::uint64_t want = std::min(m.bytes, kScratchMax);
    if (scratch_bytes < want) {
      if (scratch) check(cudaFreeAsync(scratch, stream), "cudaFreeAsync (arena scratch)");
      scratch = nullptr;
      scratch_bytes = 0;
      if (cudaMallocAsync(reinterpret_cast<void**>(&scratch), want, stream) == cudaSuccess) {
        scratch_bytes = want;
      } else {
        cudaGetLastError();  // device full: fall back to distance-sized chunks
      }
    }
    if (scratch_bytes == 0) {
      copy_chunks(dst, src, m.bytes, distance, stream);
      continue;
    }
    for (std::uint64_t done = 0; done < m.bytes; done += scratch_bytes) {
      const std::uint64_t n = std::min(scratch_bytes, m.bytes - done);
      check(cudaMemcpyAsync(scratch, src + done, n, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync (arena move, staging)");
      check(cudaMemcpyAsync(dst + done, scratch, n, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync (arena move, from staging)");
    }
  }
  if (scratch) check(cudaFreeAsync(scratch, stream), "cudaFreeAsync (arena scratch)");
}

}  // namespace zcore::cuda
