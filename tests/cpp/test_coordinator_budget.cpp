// ParamCoordinator's budgets: the reuse distance that keeps groups, the live
// budget that evicts them (farthest next use first), groups larger than the
// budget, and persistent groups.
#include "zcore/coordinator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "coordinator_harness.h"

namespace zcore {
namespace {

using namespace harness;  // the example tests' plans, configs and Chain

TEST(ParamCoordinator, ReuseDistanceKeepsGroupsUsedAgainSoon) {
  // Forward 0 1 2, backward 2 1 0. Group 2's next use follows at once
  // (distance 0), group 1's after group 2's two uses (2S), group 0's after 4S.
  Chain ch(config(0, 100 * S, 2 * S), 3);
  ch.step({0, 1, 2, 2, 1, 0});
  ch.c.begin_step(0);
  ch.c.before_module(0);
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}})) << "distance 4S > 2S";
  ch.c.before_module(1);
  EXPECT_TRUE(ch.c.after_module(1).empty()) << "distance 2S: kept";
  ch.c.before_module(2);
  EXPECT_TRUE(ch.c.after_module(2).empty());
  EXPECT_TRUE(ch.c.before_module(2).empty()) << "still gathered: nothing to do";
  EXPECT_EQ(ch.c.after_module(2), plan({{R, 2}})) << "no later use";
  EXPECT_TRUE(ch.c.before_module(1).empty());
  EXPECT_EQ(ch.c.after_module(1), plan({{R, 1}}));
  EXPECT_EQ(ch.c.before_module(0), plan({{G, 0}, {W, 0}}));
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}}));
  ch.c.end_step();
  EXPECT_EQ(ch.c.stats().resident_hits, 2);
}

TEST(ParamCoordinator, LiveBudgetEvictsTheGroupUsedFarthestAhead) {
  // Budget 2S, everything would be kept by the reuse distance. Trace 0 1 2 0:
  // at module 1 the prefetch of group 2 displaces group 0, kept for its later use.
  Chain ch(config(10 * S, 2 * S, 100 * S), 3);
  ch.step({0, 1, 2, 0});
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{G, 0}, {G, 1}, {W, 0}})) << "group 2 does not fit";
  EXPECT_TRUE(ch.c.after_module(0).empty()) << "group 0 is used again: kept";
  EXPECT_EQ(ch.c.before_module(1), plan({{R, 0}, {G, 2}, {W, 1}}));
  EXPECT_EQ(ch.c.after_module(1), plan({{R, 1}}));
  EXPECT_EQ(ch.c.before_module(2), plan({{G, 0}, {W, 2}}));
  EXPECT_EQ(ch.c.after_module(2), plan({{R, 2}}));
  EXPECT_EQ(ch.c.before_module(0), plan({{W, 0}}));
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}}));
  ch.c.end_step();
  EXPECT_EQ(ch.c.stats().peak_live_elements, 2 * S);
}

TEST(ParamCoordinator, PrefetchDisplacesNothingWhenThatWouldNotMakeRoom) {
  // Budget 2S; groups 0 and 1 of S, group 2 of 2S; trace 0 1 2 0.
  ParamCoordinator c(config(10 * S, 2 * S, 100 * S));
  for (std::int64_t numel : {S, S, 2 * S}) c.register_module({c.register_group(numel, 2)});
  const std::vector<ModuleId> order{0, 1, 2, 0};
  for (int step = 0; step < 2; ++step) {
    c.begin_step(0);
    for (ModuleId m : order) {
      const Plan before = c.before_module(m);
      const Plan after = c.after_module(m);
      if (step == 0) continue;
      if (m == 1) {
        // Group 2 is blocked; only group 0 (S) is used later than it: evicting
        // it would not make room for 2S, so it stays.
        EXPECT_EQ(before, plan({{W, 1}}));
      }
      if (m == 2) EXPECT_EQ(before, plan({{R, 0}, {G, 2}, {W, 2}}));
    }
    c.end_step();
  }
}

TEST(ParamCoordinator, AGroupLargerThanTheBudgetIsGatheredAlone) {
  ParamCoordinator c(config(10 * S, S, 100 * S));
  const GroupId big = c.register_group(3 * S, 2);
  const GroupId small = c.register_group(S, 2);
  const ModuleId mb = c.register_module({big});
  const ModuleId ms = c.register_module({small});
  c.begin_step(0);
  c.before_module(ms);
  c.after_module(ms);
  c.before_module(mb);
  c.after_module(mb);
  c.end_step();
  c.begin_step(0);
  EXPECT_EQ(c.before_module(ms), plan({{G, small}, {W, small}})) << "the big one does not fit";
  EXPECT_EQ(c.after_module(ms), plan({{R, small}})) << "no later use";
  EXPECT_EQ(c.before_module(mb), plan({{G, big}, {W, big}}));
  EXPECT_EQ(c.stats().live_elements, 3 * S);
  EXPECT_EQ(c.after_module(mb), plan({{R, big}}));
  c.end_step();
}

TEST(ParamCoordinator, PersistentGroupsStayGatheredUntilReleaseAll) {
  CoordinatorConfig cfg;
  cfg.persistence_threshold = 1000;
  ParamCoordinator c(cfg);
  const GroupId small = c.register_group(999, 2);
  const GroupId big = c.register_group(1000, 2);
  EXPECT_TRUE(c.persistent(small));
  EXPECT_FALSE(c.persistent(big));
  const ModuleId m = c.register_module({small, big});
  for (int step = 0; step < 2; ++step) {
    c.begin_step(0);
    EXPECT_EQ(c.before_module(m), step == 0 ? plan({{G, small}, {G, big}, {W, small}, {W, big}})
                                            : plan({{G, big}, {W, big}}));
    EXPECT_EQ(c.after_module(m), plan({{R, big}}));
    c.end_step();
    EXPECT_EQ(c.state(small), GroupState::kGathered);
  }
  EXPECT_EQ(c.stats().persistent_elements, 999);
  EXPECT_EQ(c.stats().live_elements, 0) << "persistent groups are not live";
  EXPECT_EQ(c.release_all(), plan({{R, small}}));
  EXPECT_EQ(c.state(small), GroupState::kSharded);
}

// With room for everything and no departures, only the first module of a
// followed step waits for a gather it did not prefetch.
TEST(ParamCoordinator, AmpleBudgetsLeaveOnlyTheFirstModuleToMiss) {
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    std::mt19937_64 rng(seed);
    const int n = 1 + static_cast<int>(rng() % 20);
    Chain ch(config(1'000'000 * S, 1'000'000 * S, static_cast<std::int64_t>(rng() % (4 * S))), n,
             S + static_cast<std::int64_t>(rng() % S));
    std::vector<ModuleId> order;
    for (int k = 1 + static_cast<int>(rng() % 30); k > 0; --k) order.push_back(static_cast<ModuleId>(rng() % n));
    ch.step(order);
    const std::int64_t misses = ch.c.stats().prefetch_misses;
    ch.step(order);
    ch.step(order);
    EXPECT_EQ(ch.c.stats().prefetch_misses - misses, 2) << "seed " << seed;
  }
}

}  // namespace
}  // namespace zcore
