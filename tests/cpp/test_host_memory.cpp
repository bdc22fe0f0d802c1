#include "zcore/host_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdlib>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "zcore/status.h"

namespace zcore {
namespace {

// Whether this process may lock `bytes` beyond RLIMIT_MEMLOCK (root has
// CAP_IPC_LOCK): then no lock request is ever refused.
bool can_lock(std::size_t bytes) {
  void* p = std::aligned_alloc(4096, bytes);
  const bool locked = mlock(p, bytes) == 0;
  if (locked) munlock(p, bytes);
  std::free(p);
  return locked;
}

TEST(HostMemory, BuffersAreAlignedZeroedAndCounted) {
  HostMemory mem(1 << 20, LockPolicy::kNone);
  auto a = mem.allocate(1000, 4096);
  auto b = mem.allocate(3000, 64);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 64, 0u);
  const auto* bytes = static_cast<const unsigned char*>(a->data());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0);
  EXPECT_EQ(mem.stats().used, 4000u);
  a.reset();
  EXPECT_EQ(mem.stats().used, 3000u);
  EXPECT_EQ(mem.stats().peak, 4000u);
}

TEST(HostMemory, BudgetIsEnforcedAndRefundedWhenBuffersGo) {
  HostMemory mem(10000, LockPolicy::kNone);
  auto a = mem.allocate(6000, 64);
  try {
    mem.allocate(5000, 64);
    FAIL() << "expected OutOfBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfBudget);
    EXPECT_NE(std::string(e.what()).find("4000"), std::string::npos) << e.what();
  }
  EXPECT_EQ(mem.stats().used, 6000u);
  a.reset();
  EXPECT_NO_THROW(mem.allocate(10000, 64));
}

TEST(HostMemory, BufferOutlivingItsHostMemoryIsSafe) {
  std::unique_ptr<HostBuffer> buf;
  {
    HostMemory mem(4096, LockPolicy::kNone);
    buf = mem.allocate(4096, 4096);
  }
  std::memset(buf->data(), 7, buf->bytes());
  buf.reset();
}

TEST(HostMemory, ConcurrentAllocationsNeverExceedTheBudget) {
  HostMemory mem(64 * 1024, LockPolicy::kNone);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&mem] {
      for (int i = 0; i < 2000; ++i) {
        try {
          auto b = mem.allocate(4096, 64);
          ASSERT_LE(mem.stats().used, 64u * 1024u);
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), StatusCode::kOutOfBudget);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mem.stats().used, 0u);
  EXPECT_LE(mem.stats().peak, 64u * 1024u);
}

TEST(HostMemory, TryLockLocksWhatItMayAndFallsBackOtherwise) {
  HostMemory mem(1 << 25, LockPolicy::kTry);
  auto small = mem.allocate(4096, 4096);
  // Locking 4 KiB is within any default RLIMIT_MEMLOCK (64 KiB or more).
  EXPECT_TRUE(small->locked());
  EXPECT_EQ(mem.stats().locked, 4096u);
  const bool privileged = can_lock(1 << 24);
  auto big = mem.allocate(1 << 24, 4096);
  EXPECT_EQ(big->locked(), privileged);
  small.reset();
  big.reset();
  EXPECT_EQ(mem.stats().locked, 0u);
}

TEST(HostMemory, RequireLockFailsClearlyOverTheLimit) {
  if (can_lock(1 << 24)) {
    GTEST_SKIP() << "this process may lock 16 MiB (CAP_IPC_LOCK or a large RLIMIT_MEMLOCK): "
                    "nothing to refuse";
  }
  HostMemory mem(1 << 25, LockPolicy::kRequire);
  try {
    mem.allocate(1 << 24, 4096);
    FAIL() << "expected SystemError";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kSystemError);
    EXPECT_NE(std::string(e.what()).find("RLIMIT_MEMLOCK"), std::string::npos);
  }
  EXPECT_EQ(mem.stats().used, 0u);
}

TEST(HostMemory, RejectsBadArguments) {
  EXPECT_THROW(HostMemory(0, LockPolicy::kNone), Error);
  HostMemory mem(1 << 20, LockPolicy::kNone);
  EXPECT_THROW(mem.allocate(0, 64), Error);
  EXPECT_THROW(mem.allocate(-1, 64), Error);
  EXPECT_THROW(mem.allocate(64, 48), Error);
  EXPECT_THROW(mem.allocate(64, 2), Error);  // below sizeof(void*)
  EXPECT_EQ(mem.stats().used, 0u);
}

}  // namespace
}  // namespace zcore
