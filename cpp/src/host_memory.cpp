#include "zcore/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zcore/status.h"

namespace zcore {
namespace {

// Buffers of at least this size are aligned to it and asked to be backed by
// transparent huge pages (best effort; effective where THP is "madvise" or
// "always"). An O_DIRECT transfer from 4 KiB pages needs one DMA segment per
// page, and the block layer splits requests at max_segments (254 on a virtio
// disk, i.e. ~1 MiB); from 2 MiB pages it takes a few segments, so large
// requests reach the device whole. Measured on this project's VM disk: reads
// 1.8 -> 3.0 GB/s, writes 4.0 -> 6.1 GB/s for 1 GiB with 1-4 MiB blocks.
constexpr std::uint64_t kHugePage = 2ull << 20;

}  // namespace

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

  const bool huge = want >= kHugePage;
  const auto align = huge ? std::max<std::uint64_t>(static_cast<std::uint64_t>(alignment), kHugePage)
                          : static_cast<std::uint64_t>(alignment);
  void* data = nullptr;
  const int rc = posix_memalign(&data, static_cast<std::size_t>(align), want);
  if (rc != 0) {
    release();
    throw Error(StatusCode::kSystemError,
                "could not allocate " + std::to_string(want) + " bytes of host memory: " +
                    std::strerror(rc),
                {{"requested", bytes}, {"errno", rc}});
  }
  // Before the first touch, so the pages are faulted in as huge pages.
  if (huge) madvise(data, want / kHugePage * kHugePage, MADV_HUGEPAGE);
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
