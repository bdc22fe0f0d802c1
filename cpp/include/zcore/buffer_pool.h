// A pool of reusable host staging buffers within a byte budget: bounce
// buffers between device memory and files (swap, aio on CUDA tensors).
//
// Buffers come from a HostMemory (aligned to kPoolAlignment, mlock'ed when
// permitted) and are kept after release for reuse, so a steady stream of
// swaps allocates nothing. When a GPU is present, a HostRegistrar (the CUDA
// one lives in cuda/) registers every buffer once when it is allocated, so
// device copies from and to it run at DMA speed.
//
// The budget bounds everything the pool holds, free or in use: when a new
// buffer would exceed it, free buffers are released first; if that is not
// enough, acquire() throws Error(kOutOfBudget) naming the request and what is
// in use, rather than letting host RAM run out.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "zcore/host_memory.h"

namespace zcore {

constexpr std::int64_t kPoolAlignment = 4096;  // O_DIRECT and page alignment

// Makes host memory known to a device runtime (cudaHostRegister) and back.
class HostRegistrar {
 public:
  virtual ~HostRegistrar() = default;
  virtual void register_range(void* data, std::uint64_t bytes) = 0;
  virtual void unregister_range(void* data) = 0;
};

struct BufferPoolStats {
  std::uint64_t budget;
  std::uint64_t held;        // bytes in buffers the pool owns (free + in use)
  std::uint64_t in_use;      // bytes in buffers handed out
  std::uint64_t buffers;     // buffers held
  std::uint64_t allocations; // buffers ever allocated (reuse keeps this low)
  std::uint64_t reuses;      // acquire() served by a free buffer
};

struct BufferPoolState;

// A buffer on loan from a pool; returns to the pool when destroyed.
class PooledBuffer {
 public:
  PooledBuffer(std::unique_ptr<HostBuffer> buffer, std::uint64_t requested,
               std::shared_ptr<BufferPoolState> pool);
  ~PooledBuffer();
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;

  void* data() const { return buffer_->data(); }
  // The bytes asked for; capacity() >= bytes() is a multiple of kPoolAlignment.
  std::uint64_t bytes() const { return requested_; }
  std::uint64_t capacity() const { return buffer_->bytes(); }
  bool locked() const { return buffer_->locked(); }

 private:
  std::unique_ptr<HostBuffer> buffer_;
  std::uint64_t requested_;
  std::shared_ptr<BufferPoolState> pool_;
};

class HostBufferPool {
 public:
  // budget > 0 bytes. `registrar` may be null (no device runtime).
  HostBufferPool(std::int64_t budget, LockPolicy lock,
                 std::shared_ptr<HostRegistrar> registrar = nullptr);
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // A buffer of at least `bytes` (> 0), rounded up to kPoolAlignment: the
  // smallest free one that fits, else a new one. Contents are unspecified.
  std::unique_ptr<PooledBuffer> acquire(std::int64_t bytes);

  // Releases every free buffer (in-use ones return to the pool later).
  void trim();

  BufferPoolStats stats() const;
  bool registered() const;

 private:
  std::shared_ptr<BufferPoolState> state_;
};

}  // namespace zcore
