#include "zcore/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cfenv>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace zcore {
namespace {

TEST(ParallelFor, RunsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    for (std::int64_t count : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(count));
      parallel_for(count, threads, [&](std::int64_t i) { hits[static_cast<std::size_t>(i)]++; });
      for (std::int64_t i = 0; i < count; ++i) {
        EXPECT_EQ(hits[static_cast<std::size_t>(i)].load(), 1) << "threads " << threads << " i " << i;
      }
    }
  }
}

TEST(ParallelFor, UsesAtMostTheThreadsAskedForAndTheCaller) {
  for (int threads : {1, 2, 4}) {
    std::mutex mutex;
    std::set<std::thread::id> seen;
    parallel_for(64, threads, [&](std::int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard<std::mutex> lock(mutex);
      seen.insert(std::this_thread::get_id());
    });
    EXPECT_LE(static_cast<int>(seen.size()), threads);
    if (threads == 1) EXPECT_EQ(*seen.begin(), std::this_thread::get_id());
  }
}

TEST(ParallelFor, ConcurrentCallersAreServedOneAfterAnother) {
  std::atomic<std::int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        parallel_for(100, 3, [&](std::int64_t i) { total += i; });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * (99 * 100 / 2));
}

TEST(ParallelFor, TasksRunInTheCallersRoundingMode) {
  const int saved = std::fegetround();
  std::fesetround(FE_UPWARD);
  std::vector<int> modes(64, -1);
  parallel_for(64, 4, [&](std::int64_t i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    modes[static_cast<std::size_t>(i)] = std::fegetround();
  });
  std::fesetround(saved);
  for (int mode : modes) EXPECT_EQ(mode, FE_UPWARD);
}

}  // namespace
}  // namespace zcore
