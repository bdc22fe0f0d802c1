#include "zcore/host_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zcore/status.h"

namespace zcore {

HostBuffer::HostBuffer(void* data, std::uint64_t bytes, bool locked,
                       std::shared_ptr<HostMemoryAccount> account)
    : data_(data), bytes_(bytes), locked_(locked), account_(std::move(account)) {}

HostBuffer::~HostBuffer() {
  if (locked_) munlock(data_, bytes_);
  std::free(data_);
  std::lock_guard<std::mutex> lock(account_->mutex);
  account_->used -= bytes_;
  if (locked_) account_->locked -= bytes_;
}

HostMemory::HostMemory(std::int64_t budget, LockPolicy lock)
    : lock_(lock), account_(std::make_shared<HostMemoryAccount>()) {
  if (budget <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "host memory budget must be a positive number of bytes, got " +
                    std::to_string(budget),
                {{"budget", budget}});
  }
  account_->budget = static_cast<std::uint64_t>(budget);
}

std::unique_ptr<HostBuffer> HostMemory::allocate(std::int64_t bytes, std::int64_t alignment) {
  if (bytes <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "host buffer size must be a positive number of bytes, got " + std::to_string(bytes),
                {{"bytes", bytes}});
  }
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0 ||
      alignment % static_cast<std::int64_t>(sizeof(void*)) != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "host buffer alignment must be a power of two and a multiple of " +
                    std::to_string(sizeof(void*)) + ", got " + std::to_string(alignment),
                {{"alignment", alignment}});
  }
  const auto want = static_cast<std::uint64_t>(bytes);
  {
    // Reserve first so concurrent callers cannot both pass the check.
    std::lock_guard<std::mutex> lock(account_->mutex);
    if (account_->used + want > account_->budget) {
      const std::uint64_t left = account_->budget - account_->used;
      throw Error(StatusCode::kOutOfBudget,
                  "host memory budget exceeded: requested " + std::to_string(want) +
                      " bytes with " + std::to_string(left) + " of the " +
                      std::to_string(account_->budget) +
                      "-byte budget left; raise the budget or free buffers first",
                  {{"requested", bytes},
                   {"available", static_cast<std::int64_t>(left)},
                   {"budget", static_cast<std::int64_t>(account_->budget)}});
    }
    account_->used += want;
    if (account_->used > account_->peak) account_->peak = account_->used;
  }
  auto release = [&] {
    std::lock_guard<std::mutex> lock(account_->mutex);
    account_->used -= want;
  };

  void* data = nullptr;
  const int rc = posix_memalign(&data, static_cast<std::size_t>(alignment), want);
  if (rc != 0) {
    release();
    throw Error(StatusCode::kSystemError,
                "could not allocate " + std::to_string(want) + " bytes of host memory: " +
                    std::strerror(rc),
                {{"requested", bytes}, {"errno", rc}});
  }
  std::memset(data, 0, want);

  bool locked = false;
  if (lock_ != LockPolicy::kNone) {
    locked = mlock(data, want) == 0;
    if (!locked && lock_ == LockPolicy::kRequire) {
      const int err = errno;
      std::free(data);
      release();
      throw Error(StatusCode::kSystemError,
                  "could not lock " + std::to_string(want) + " bytes of host memory (mlock: " +
                      std::strerror(err) +
                      "); raise RLIMIT_MEMLOCK (ulimit -l) or use the 'try' lock policy",
                  {{"requested", bytes}, {"errno", err}});
    }
  }
  if (locked) {
    std::lock_guard<std::mutex> lock(account_->mutex);
    account_->locked += want;
  }
  return std::make_unique<HostBuffer>(data, want, locked, account_);
}

HostMemoryStats HostMemory::stats() const {
  std::lock_guard<std::mutex> lock(account_->mutex);
  return {account_->budget, account_->used, account_->locked, account_->peak};
}

}  // namespace zcore
