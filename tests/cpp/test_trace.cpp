#include "zcore/trace.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace zcore {
namespace {

TEST(ExecutionTrace, NextUseAndDistances) {
  ExecutionTrace t;
  const std::vector<std::pair<GroupId, std::int64_t>> uses = {{2, 10}, {0, 5}, {2, 10}, {1, 7}};
  for (const auto& [g, n] : uses) t.append(g, n);
  EXPECT_EQ(t.next_use(2, 0), ExecutionTrace::kNone) << "no index yet";
  t.build_index();
  EXPECT_EQ(t.size(), 4u);
  EXPECT_EQ(t.next_use(2, 0), 0u);
  EXPECT_EQ(t.next_use(2, 1), 2u);
  EXPECT_EQ(t.next_use(2, 3), ExecutionTrace::kNone);
  EXPECT_EQ(t.next_use(1, 0), 3u);
  EXPECT_EQ(t.next_use(7, 0), ExecutionTrace::kNone) << "a group the trace never used";
  EXPECT_EQ(t.elements_between(0, 4), 32);
  EXPECT_EQ(t.elements_between(1, 3), 15);
  EXPECT_EQ(t.elements_between(2, 2), 0);
  t.clear();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.next_use(2, 0), ExecutionTrace::kNone);
  t.append(3, 4);
  t.build_index();
  EXPECT_EQ(t.next_use(3, 0), 0u);
  EXPECT_EQ(t.elements_between(0, 1), 4);
}

TEST(ExecutionTrace, NextUseMatchesALinearScan) {
  std::mt19937 rng(3);
  for (int round = 0; round < 50; ++round) {
    ExecutionTrace t;
    std::vector<GroupId> uses;
    const int n = 1 + static_cast<int>(rng() % 200);
    for (int i = 0; i < n; ++i) {
      uses.push_back(static_cast<GroupId>(rng() % 17));
      t.append(uses.back(), 1);
    }
    t.build_index();
    for (GroupId g = 0; g < 18; ++g) {
      for (std::size_t from = 0; from <= uses.size(); ++from) {
        std::size_t expected = ExecutionTrace::kNone;
        for (std::size_t i = from; i < uses.size(); ++i) {
          if (uses[i] == g) {
            expected = i;
            break;
          }
        }
        ASSERT_EQ(t.next_use(g, from), expected) << "group " << g << " from " << from;
      }
    }
  }
}

}  // namespace
}  // namespace zcore
