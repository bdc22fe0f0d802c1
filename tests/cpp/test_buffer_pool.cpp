#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "zcore/buffer_pool.h"
#include "zcore/status.h"

using zcore::Error;
using zcore::HostBufferPool;
using zcore::HostRegistrar;
using zcore::LockPolicy;
using zcore::StatusCode;

namespace {

// Records registrations, standing in for cudaHostRegister on a machine without a GPU.
class CountingRegistrar : public HostRegistrar {
 public:
  void register_range(void*, std::uint64_t bytes) override {
    ++registered;
    registered_bytes += bytes;
  }
  void unregister_range(void*) override { ++unregistered; }
  int registered = 0;
  int unregistered = 0;
  std::uint64_t registered_bytes = 0;
};

TEST(HostBufferPool, BuffersAreAlignedRoundedAndReused) {
  HostBufferPool pool(1 << 20, LockPolicy::kNone);
  void* first_address = nullptr;
  {
    auto a = pool.acquire(1000);
    EXPECT_EQ(a->bytes(), 1000u);
    EXPECT_EQ(a->capacity(), 4096u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % zcore::kPoolAlignment, 0u);
    std::memset(a->data(), 7, a->capacity());
    first_address = a->data();
    EXPECT_EQ(pool.stats().in_use, 4096u);
  }
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_EQ(pool.stats().held, 4096u);
  auto b = pool.acquire(4096);
  EXPECT_EQ(b->data(), first_address);
  EXPECT_EQ(pool.stats().allocations, 1u);
  EXPECT_EQ(pool.stats().reuses, 1u);
}

TEST(HostBufferPool, ExceedingTheBudgetIsAClearError) {
  HostBufferPool pool(64 << 10, LockPolicy::kTry);
  auto a = pool.acquire(48 << 10);
  try {
    pool.acquire(32 << 10);
    FAIL() << "expected kOutOfBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfBudget);
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos);
  }
  auto b = pool.acquire(16 << 10);  // what is left still works
  EXPECT_EQ(pool.stats().in_use, 64u << 10);
}

TEST(HostBufferPool, FreeBuffersMakeRoomForADifferentSize) {
  HostBufferPool pool(64 << 10, LockPolicy::kNone);
  { auto a = pool.acquire(40 << 10); }
  auto big = pool.acquire(60 << 10);  // the free 40 KiB buffer is dropped
  EXPECT_EQ(pool.stats().held, 60u << 10);
  EXPECT_EQ(pool.stats().buffers, 1u);
}

TEST(HostBufferPool, RegistersEachBufferOnceAndUnregistersOnRelease) {
  auto registrar = std::make_shared<CountingRegistrar>();
  {
    HostBufferPool pool(1 << 20, LockPolicy::kNone, registrar);
    EXPECT_TRUE(pool.registered());
    for (int i = 0; i < 5; ++i) auto a = pool.acquire(8192);
    EXPECT_EQ(registrar->registered, 1);
    auto b = pool.acquire(100 << 10);
    EXPECT_EQ(registrar->registered, 2);
  }
  EXPECT_EQ(registrar->unregistered, 2);
}

TEST(HostBufferPool, LoansOutliveThePool) {
  auto registrar = std::make_shared<CountingRegistrar>();
  std::unique_ptr<zcore::PooledBuffer> loan;
  {
    HostBufferPool pool(1 << 20, LockPolicy::kNone, registrar);
    loan = pool.acquire(4096);
  }
  std::memset(loan->data(), 1, 4096);
  loan.reset();
  EXPECT_EQ(registrar->unregistered, 1);
}

}  // namespace
