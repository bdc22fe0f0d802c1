#include "zcore/buffer_pool.h"

#include <map>
#include <string>

#include "zcore/status.h"

namespace zcore {

// Shared by the pool and its loans, so a buffer returned after the pool was
// destroyed is still unregistered and freed.
struct BufferPoolState {
  BufferPoolState(std::int64_t budget, LockPolicy lock, std::shared_ptr<HostRegistrar> r)
      : memory(budget, lock), registrar(std::move(r)) {}

  ~BufferPoolState() {
    for (auto& entry : free) release(std::move(entry.second));
  }

  void release(std::unique_ptr<HostBuffer> buffer) {
    if (registrar) registrar->unregister_range(buffer->data());
    held -= buffer->bytes();
    --buffers;
  }

  std::mutex mutex;
  HostMemory memory;
  std::shared_ptr<HostRegistrar> registrar;
  std::multimap<std::uint64_t, std::unique_ptr<HostBuffer>> free;  // by capacity
  std::uint64_t held = 0;
  std::uint64_t in_use = 0;
  std::uint64_t buffers = 0;
  std::uint64_t allocations = 0;
  std::uint64_t reuses = 0;
};

PooledBuffer::PooledBuffer(std::unique_ptr<HostBuffer> buffer, std::uint64_t requested,
                           std::shared_ptr<BufferPoolState> pool)
    : buffer_(std::move(buffer)), requested_(requested), pool_(std::move(pool)) {}

PooledBuffer::~PooledBuffer() {
  std::lock_guard<std::mutex> lock(pool_->mutex);
  pool_->in_use -= buffer_->bytes();
  const std::uint64_t capacity = buffer_->bytes();
  pool_->free.emplace(capacity, std::move(buffer_));
}

HostBufferPool::HostBufferPool(std::int64_t budget, LockPolicy lock,
                               std::shared_ptr<HostRegistrar> registrar)
    : state_(std::make_shared<BufferPoolState>(budget, lock, std::move(registrar))) {}

HostBufferPool::~HostBufferPool() { trim(); }

std::unique_ptr<PooledBuffer> HostBufferPool::acquire(std::int64_t bytes) {
  if (bytes <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "a pooled buffer needs a positive size, got " + std::to_string(bytes),
                {{"bytes", bytes}});
  }
  const auto want = static_cast<std::uint64_t>((bytes + kPoolAlignment - 1) / kPoolAlignment *
                                               kPoolAlignment);
  BufferPoolState& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto fit = s.free.lower_bound(want);
  // A free buffer much larger than asked would pin memory another request
  // needs; reuse only up to twice the size.
  if (fit != s.free.end() && fit->first <= 2 * want) {
    std::unique_ptr<HostBuffer> buffer = std::move(fit->second);
    s.free.erase(fit);
    s.in_use += buffer->bytes();
    ++s.reuses;
    return std::make_unique<PooledBuffer>(std::move(buffer), static_cast<std::uint64_t>(bytes),
                                          state_);
  }
  const std::uint64_t budget = s.memory.stats().budget;
  // Make room by dropping free buffers, largest first.
  while (s.held + want > budget && !s.free.empty()) {
    auto largest = std::prev(s.free.end());
    s.release(std::move(largest->second));
    s.free.erase(largest);
  }
  if (s.held + want > budget) {
    throw Error(StatusCode::kOutOfBudget,
                "host buffer pool budget exceeded: requested " + std::to_string(want) +
                    " bytes while " + std::to_string(s.in_use) + " of the " +
                    std::to_string(budget) +
                    "-byte budget are in use; raise the pool budget or release buffers first",
                {{"requested", static_cast<std::int64_t>(want)},
                 {"available", static_cast<std::int64_t>(budget - s.held)},
                 {"budget", static_cast<std::int64_t>(budget)}});
  }
  std::unique_ptr<HostBuffer> buffer =
      s.memory.allocate(static_cast<std::int64_t>(want), kPoolAlignment);
  if (s.registrar) s.registrar->register_range(buffer->data(), buffer->bytes());
  s.held += want;
  s.in_use += want;
  ++s.buffers;
  ++s.allocations;
  return std::make_unique<PooledBuffer>(std::move(buffer), static_cast<std::uint64_t>(bytes),
                                        state_);
}

void HostBufferPool::trim() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& entry : state_->free) state_->release(std::move(entry.second));
  state_->free.clear();
}

BufferPoolStats HostBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const BufferPoolState& s = *state_;
  return {s.memory.stats().budget, s.held, s.in_use, s.buffers, s.allocations, s.reuses};
}

bool HostBufferPool::registered() const { return state_->registrar != nullptr; }

}  // namespace zcore
