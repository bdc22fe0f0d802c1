// Host memory that zcore owns: aligned buffers for arenas and I/O, counted
// against an explicit byte budget and optionally locked in RAM (mlock).
//
// torch cannot pin memory on a machine without CUDA, and O_DIRECT I/O needs
// aligned buffers, so host memory comes from here and is exposed to torch
// without copies (through the Python buffer protocol).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

namespace zcore {

enum class LockPolicy {
  kNone,     // pageable memory
  kTry,      // mlock when the RLIMIT_MEMLOCK / privileges permit, else pageable
  kRequire,  // mlock or fail with kSystemError
};

// Shared by a HostMemory and the buffers it handed out, so a buffer that
// outlives its HostMemory still returns its bytes to the count.
struct HostMemoryAccount {
  std::mutex mutex;
  std::uint64_t budget = 0;
  std::uint64_t used = 0;
  std::uint64_t locked = 0;
  std::uint64_t peak = 0;
};

class HostBuffer {
 public:
  HostBuffer(void* data, std::uint64_t bytes, bool locked,
             std::shared_ptr<HostMemoryAccount> account);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  std::uint64_t bytes() const { return bytes_; }
  bool locked() const { return locked_; }

 private:
  void* data_;
  std::uint64_t bytes_;
  bool locked_;
  std::shared_ptr<HostMemoryAccount> account_;
};

struct HostMemoryStats {
  std::uint64_t budget;
  std::uint64_t used;    // bytes in live buffers
  std::uint64_t locked;  // of which locked in RAM
  std::uint64_t peak;
};

class HostMemory {
 public:
  // budget > 0 bytes: allocate() beyond it throws Error(kOutOfBudget) rather
  // than letting a job exhaust the machine's RAM.
  HostMemory(std::int64_t budget, LockPolicy lock);

  // bytes > 0; alignment a power of two and a multiple of sizeof(void*).
  // The memory is zero-filled.
  std::unique_ptr<HostBuffer> allocate(std::int64_t bytes, std::int64_t alignment);

  HostMemoryStats stats() const;
  LockPolicy lock_policy() const { return lock_; }

 private:
  LockPolicy lock_;
  std::shared_ptr<HostMemoryAccount> account_;
};

}  // namespace zcore
