// ParamCoordinator's shard tiers (ZeRO-Infinity): shards fetched into
// staging before their all-gathers and ahead of them along the trace, the
// staging budget, writes of NVMe shards between steps, the tier a shard gets,
// and the property test over random traces with tiers.
#include "zcore/coordinator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "coordinator_harness.h"
#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {
namespace {

using namespace harness;  // the example tests' plans, configs and Chain
using testing_support::code_of;

constexpr std::int64_t kShard = S / 4 * 2;  // bytes of a rank's shard of an S-element group, world 4

CoordinatorConfig tiered(std::int64_t bucket, std::int64_t staging_shards, std::int64_t horizon) {
  CoordinatorConfig c = config(bucket, 100 * S, 0);
  c.staging_bytes = staging_shards * kShard;
  c.fetch_horizon_uses = horizon;
  return c;
}

// Chain's model with each group's shard on the given tier.
struct TieredChain : Chain {
  TieredChain(const CoordinatorConfig& cfg, const std::vector<ShardTier>& tiers) : Chain(cfg, 0) {
    for (ShardTier t : tiers) c.register_module({c.register_group(S, 2, S / 4, t)});
  }
};

TEST(ParamCoordinator, DeviceTiersPlanExactlyAsWithoutTiers) {
  // The same random steps (departures included) through a coordinator of
  // two-argument groups and default config, and one whose groups are asked
  // for the device tier explicitly, with staging and a fetch horizon set.
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    std::mt19937_64 rng(seed);
    const int n = 1 + static_cast<int>(rng() % 12);
    CoordinatorConfig cfg = config(static_cast<std::int64_t>(rng() % (4 * S)),
                                   S + static_cast<std::int64_t>(rng() % (6 * S)),
                                   static_cast<std::int64_t>(rng() % (4 * S)));
    ParamCoordinator plain(cfg);
    cfg.staging_bytes = 3 * kShard;
    cfg.fetch_horizon_uses = 2;
    ParamCoordinator device(cfg);
    for (int g = 0; g < n; ++g) {
      const std::int64_t numel = S / 2 + static_cast<std::int64_t>(rng() % S);
      plain.register_module({plain.register_group(numel, 2)});
      device.register_module({device.register_group(numel, 2, numel / 4, ShardTier::kDevice)});
    }
    std::vector<ModuleId> order;
    for (int k = 1 + static_cast<int>(rng() % 20); k > 0; --k) order.push_back(static_cast<ModuleId>(rng() % n));
    for (int step = 0; step < 4; ++step) {
      if (rng() % 3 == 0) order[rng() % order.size()] = static_cast<ModuleId>(rng() % n);
      plain.begin_step(0);
      device.begin_step(0);
      for (ModuleId m : order) {
        ASSERT_EQ(plain.before_module(m), device.before_module(m)) << "seed " << seed;
        ASSERT_EQ(plain.after_module(m), device.after_module(m)) << "seed " << seed;
      }
      ASSERT_EQ(plain.end_step(), device.end_step()) << "seed " << seed;
      ASSERT_TRUE(device.store_shards({0}).empty()) << "device shards are updated in place";
    }
    EXPECT_EQ(device.stats().shard_fetches, 0);
  }
}

TEST(ParamCoordinator, RecordingFetchesEachShardRightBeforeItsGather) {
  EXPECT_EQ(code_of([&] { TieredChain bad(CoordinatorConfig{}, {ShardTier::kNvme}); }),
            StatusCode::kInvalidArgument)
      << "staging_bytes 0 cannot hold a shard";
  CoordinatorConfig cfg;
  cfg.staging_bytes = kShard;
  TieredChain t(cfg, {ShardTier::kNvme, ShardTier::kHost});
  t.c.begin_step(0);
  EXPECT_EQ(t.c.before_module(0), plan({{Fetch, 0}, {Ready, 0}, {G, 0}, {W, 0}, {Drop, 0}}));
  EXPECT_EQ(t.c.shard_state(0), ShardState::kStored);
  EXPECT_EQ(t.c.after_module(0), plan({{R, 0}}));
  EXPECT_EQ(t.c.before_module(1), plan({{Fetch, 1}, {Ready, 1}, {G, 1}, {W, 1}, {Drop, 1}}));
  t.c.after_module(1);
  EXPECT_TRUE(t.c.end_step().empty());
  const CoordinatorStats s = t.c.stats();
  EXPECT_EQ(s.shard_fetches, 2);
  EXPECT_EQ(s.shard_bytes_fetched, 2 * kShard);
  EXPECT_EQ(s.peak_staged_bytes, kShard);
  EXPECT_EQ(s.staged_bytes, 0);
}

TEST(ParamCoordinator, FollowingStepFetchesAheadOfTheAllGatherPrefetch) {
  // Bucket of one group, horizon of two uses: the shards are read two uses
  // ahead, so the prefetch all-gathers shards already fetched.
  TieredChain ch(tiered(S, 10, 2), std::vector<ShardTier>(4, ShardTier::kNvme));
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{Fetch, 0}, {Fetch, 1}, {Fetch, 2}, {Ready, 0}, {G, 0},
                                         {Ready, 1}, {G, 1}, {W, 0}, {Drop, 0}}));
  EXPECT_EQ(ch.c.shard_state(2), ShardState::kFetching);
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}}));
  EXPECT_EQ(ch.c.before_module(1), plan({{Fetch, 3}, {Ready, 2}, {G, 2}, {W, 1}, {Drop, 1}}));
  ch.c.after_module(1);
  EXPECT_EQ(ch.c.before_module(2), plan({{Ready, 3}, {G, 3}, {W, 2}, {Drop, 2}}));
  ch.c.after_module(2);
  EXPECT_EQ(ch.c.before_module(3), plan({{W, 3}, {Drop, 3}}));
  ch.c.after_module(3);
  EXPECT_TRUE(ch.c.end_step().empty());
  EXPECT_EQ(ch.c.stats().shard_fetches_ahead, 3);
  EXPECT_EQ(ch.c.stats().shard_fetches, 8);
}

TEST(ParamCoordinator, StagingBoundsTheFetchesAhead) {
  // Room for two shards: one read ahead while another feeds an all-gather.
  TieredChain ch(tiered(S, 2, 64), std::vector<ShardTier>(4, ShardTier::kHost));
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{Fetch, 0}, {Fetch, 1}, {Ready, 0}, {G, 0}, {Ready, 1},
                                         {G, 1}, {W, 0}, {Drop, 0}}));
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}, {Fetch, 2}})) << "the slot freed is used at once";
  EXPECT_EQ(ch.c.before_module(1), plan({{Ready, 2}, {G, 2}, {W, 1}, {Drop, 1}}));
  EXPECT_EQ(ch.c.after_module(1), plan({{R, 1}, {Fetch, 3}}));
  EXPECT_EQ(ch.c.before_module(2), plan({{Ready, 3}, {G, 3}, {W, 2}, {Drop, 2}}));
  ch.c.after_module(2);
  ch.run({3});
  EXPECT_TRUE(ch.c.end_step().empty());
  EXPECT_EQ(ch.c.stats().peak_staged_bytes, 2 * kShard);
}

TEST(ParamCoordinator, ADepartureDropsTheShardsFetchedForUsesThatDidNotCome) {
  TieredChain ch(tiered(0, 2, 64), std::vector<ShardTier>(4, ShardTier::kNvme));
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{Fetch, 0}, {Fetch, 1}, {Ready, 0}, {G, 0}, {W, 0}, {Drop, 0}}));
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}, {Fetch, 2}}));
  // Modules 1 and 2 are skipped: staging is full of their shards, so one is
  // waited and dropped to make room for group 3's.
  EXPECT_EQ(ch.c.before_module(3),
            plan({{Ready, 1}, {Drop, 1}, {Fetch, 3}, {Ready, 3}, {G, 3}, {W, 3}, {Drop, 3}}));
  ch.c.after_module(3);
  EXPECT_EQ(ch.c.end_step(), plan({{Ready, 2}, {Drop, 2}})) << "nothing stays staged";
  EXPECT_EQ(ch.c.stats().shard_fetches_unused, 2);
  EXPECT_EQ(ch.c.stats().staged_bytes, 0);
}

TEST(ParamCoordinator, AbortStepWaitsAndDropsEveryStagedShard) {
  TieredChain ch(tiered(S, 10, 64), std::vector<ShardTier>(4, ShardTier::kNvme));
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  ch.c.before_module(0);  // fetches 0 to 3, all-gathers 0 and 1
  EXPECT_EQ(ch.c.abort_step(), plan({{R, 0}, {W, 1}, {Drop, 1}, {R, 1}, {Ready, 2}, {Drop, 2},
                                     {Ready, 3}, {Drop, 3}}));
  for (GroupId g = 0; g < 4; ++g) EXPECT_EQ(ch.c.shard_state(g), ShardState::kStored);
}

TEST(ParamCoordinator, AModuleWhoseShardsDoNotFitTogetherWaitsItsOwnAllGathersFirst) {
  CoordinatorConfig cfg;
  cfg.staging_bytes = kShard;
  ParamCoordinator c(cfg);
  const GroupId a = c.register_group(S, 2, S / 4, ShardTier::kNvme);
  const GroupId b = c.register_group(S, 2, S / 4, ShardTier::kHost);
  const ModuleId m = c.register_module({a, b});
  EXPECT_EQ(c.before_module(m), plan({{Fetch, a}, {Ready, a}, {G, a}, {W, a}, {Drop, a}, {Fetch, b},
                                      {Ready, b}, {G, b}, {W, b}, {Drop, b}}));
  EXPECT_EQ(c.state(a), GroupState::kInUse);
  EXPECT_EQ(c.after_module(m), plan({{R, a}, {R, b}}));
}

TEST(ParamCoordinator, StoresWriteNvmeShardsBetweenStepsAndAreWaitedBeforeAFetch) {
  TieredChain ch(tiered(0, 4, 64), {ShardTier::kNvme, ShardTier::kHost, ShardTier::kDevice});
  ParamCoordinator& c = ch.c;
  EXPECT_EQ(c.store_shards({0, 1, 2}), plan({{Store, 0}})) << "host and device shards change in place";
  EXPECT_EQ(c.shard_state(0), ShardState::kStoring);
  EXPECT_EQ(c.store_shards({0}), plan({{Stored, 0}, {Store, 0}})) << "one write at a time";
  EXPECT_EQ(code_of([&] { c.store_shards({1, 1}); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { c.store_shards({0, 7}); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(c.stats().shard_stores, 2) << "a refused call changes nothing";
  c.begin_step(0);
  EXPECT_EQ(code_of([&] { c.store_shards({0}); }), StatusCode::kInvalidState);
  EXPECT_EQ(c.before_module(0),
            plan({{Stored, 0}, {Fetch, 0}, {Ready, 0}, {G, 0}, {W, 0}, {Drop, 0}}));
  c.after_module(0);
  c.end_step();
  c.store_shards({0});
  ch.step({1}, 1);
  EXPECT_EQ(c.shard_state(0), ShardState::kStored) << "end_step waited the write";
  c.store_shards({0});
  EXPECT_TRUE(c.release_all().empty()) << "release_all leaves writes in flight";
  EXPECT_EQ(c.finish_stores(), plan({{Stored, 0}}));
  EXPECT_TRUE(c.finish_stores().empty());
  EXPECT_EQ(c.stats().shard_stores, 4);
  EXPECT_EQ(c.stats().shard_bytes_stored, 4 * kShard);
}

TEST(ParamCoordinator, PersistentGroupsKeepTheirShardOnTheDevice) {
  CoordinatorConfig cfg;
  cfg.persistence_threshold = 1000;
  ParamCoordinator c(cfg);  // staging_bytes 0: fine, nothing is offloaded
  const GroupId small = c.register_group(999, 2, 250, ShardTier::kNvme);
  EXPECT_EQ(c.shard_tier(small), ShardTier::kDevice);
  EXPECT_EQ(c.shard_state(small), ShardState::kResident);
  const ModuleId m = c.register_module({small});
  EXPECT_EQ(c.before_module(m), plan({{G, small}, {W, small}}));
  c.after_module(m);
  EXPECT_TRUE(c.store_shards({small}).empty());
}

TEST(ParamCoordinator, NvmeShardsWithinTheHostBudgetStayInHostMemoryUpToTheFirstThatSpills) {
  CoordinatorConfig cfg;
  cfg.persistence_threshold = 1000;
  cfg.staging_bytes = 1 << 20;
  cfg.nvme_host_elements = 550;
  ParamCoordinator c(cfg);
  const GroupId first = c.register_group(1000, 2, 250, ShardTier::kNvme);
  const GroupId persistent = c.register_group(999, 2, 250, ShardTier::kNvme);
  const GroupId second = c.register_group(1000, 2, 250, ShardTier::kNvme);
  const GroupId spills = c.register_group(1000, 2, 250, ShardTier::kNvme);
  const GroupId would_fit = c.register_group(1000, 2, 40, ShardTier::kNvme);
  const GroupId host = c.register_group(1000, 2, 250, ShardTier::kHost);
  EXPECT_EQ(c.shard_tier(first), ShardTier::kHost);
  EXPECT_EQ(c.shard_tier(persistent), ShardTier::kDevice) << "not counted against the budget";
  EXPECT_EQ(c.shard_tier(second), ShardTier::kHost);
  EXPECT_EQ(c.shard_tier(spills), ShardTier::kNvme) << "500 + 250 elements > 550";
  EXPECT_EQ(c.shard_tier(would_fit), ShardTier::kNvme) << "after the first spill, all go to NVMe";
  EXPECT_EQ(c.shard_tier(host), ShardTier::kHost);
  const ModuleId m = c.register_module({second, spills});
  EXPECT_EQ(c.before_module(m), plan({{Fetch, second}, {Fetch, spills}, {Ready, second}, {G, second},
                                      {Ready, spills}, {G, spills}, {W, second}, {Drop, second},
                                      {W, spills}, {Drop, spills}}));
  c.after_module(m);
  EXPECT_EQ(c.store_shards({second, spills}), plan({{Store, spills}})) << "only the NVMe shard is written";
}

TEST(ParamCoordinator, RejectsBadShardsAndStaging) {
  CoordinatorConfig bad;
  bad.staging_bytes = -1;
  EXPECT_EQ(code_of([&] { ParamCoordinator c(bad); }), StatusCode::kInvalidArgument);
  bad = CoordinatorConfig{};
  bad.fetch_horizon_uses = -1;
  EXPECT_EQ(code_of([&] { ParamCoordinator c(bad); }), StatusCode::kInvalidArgument);
  bad = CoordinatorConfig{};
  bad.nvme_host_elements = -1;
  EXPECT_EQ(code_of([&] { ParamCoordinator c(bad); }), StatusCode::kInvalidArgument);
  CoordinatorConfig cfg;
  cfg.staging_bytes = kShard - 1;
  ParamCoordinator c(cfg);
  EXPECT_EQ(code_of([&] { c.register_group(S, 2, 0, ShardTier::kHost); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { c.register_group(S, 2, S + 1, ShardTier::kHost); }),
            StatusCode::kInvalidArgument);
  const Error e = testing_support::error_of([&] { c.register_group(S, 2, S / 4, ShardTier::kNvme); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("staging_bytes=" + std::to_string(kShard - 1)), std::string::npos)
      << e.what();
  EXPECT_NE(std::string(e.what()).find(std::to_string(kShard) + " bytes"), std::string::npos) << e.what();
  EXPECT_EQ(c.num_groups(), 0u) << "refused groups are not registered";
  EXPECT_EQ(c.register_group(S, 2, S / 4, ShardTier::kDevice), 0) << "the device needs no staging";
  EXPECT_EQ(code_of([&] { c.shard_tier(1); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { c.shard_state(-1); }), StatusCode::kInvalidHandle);
}

// With room for everything, a followed trace never all-gathers a shard whose
// fetch was issued in the same plan, except in the first plan of a step.
TEST(ParamCoordinator, FetchesRunAheadOfGathersOnAFollowedTrace) {
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    std::mt19937_64 rng(seed);
    const int n = 1 + static_cast<int>(rng() % 20);
    CoordinatorConfig cfg = tiered(static_cast<std::int64_t>(1 + rng() % 3) * S, 1000, 64);
    cfg.max_reuse_distance = static_cast<std::int64_t>(rng() % (4 * S));
    cfg.max_live_elements = 1'000'000 * S;
    std::vector<ShardTier> tiers;
    for (int g = 0; g < n; ++g) tiers.push_back(static_cast<ShardTier>(rng() % 3));
    TieredChain ch(cfg, tiers);
    std::vector<std::vector<GroupId>> modules;
    std::vector<std::int64_t> bytes;
    for (int g = 0; g < n; ++g) modules.push_back({g}), bytes.push_back(kShard);
    harness::FaithfulCaller caller(ch.c, modules, std::vector<std::int64_t>(n, S), tiers, bytes);
    harness::Calls calls;
    for (int k = 1 + static_cast<int>(rng() % 30); k > 0; --k) {
      const ModuleId m = static_cast<ModuleId>(rng() % n);
      calls.push_back({true, m});
      calls.push_back({false, m});
    }
    std::int64_t recorded = 0;  // the recording step fetches on demand: not counted
    for (int step = 0; step < 3; ++step) {
      caller.begin_step(0);
      for (const harness::Call& call : calls) caller.call(call);
      caller.end_step();
      if (step == 0) recorded = caller.late_fetches();
    }
    ASSERT_EQ(caller.violations(), 0) << caller.first_violation();
    EXPECT_EQ(caller.late_fetches() - recorded, 0) << "seed " << seed;
    EXPECT_EQ(ch.c.stats().trace_departures, 0);
  }
}

TEST(ParamCoordinator, HarnessDetectsATierItDoesNotExpect) {
  TieredChain ch(tiered(0, 1, 0), {ShardTier::kNvme});
  harness::FaithfulCaller caller(ch.c, {{0}}, {S});  // believes every shard is on the device
  EXPECT_GT(caller.violations(), 0);
}

// The property test over random traces with random shard tiers, staging
// budgets, fetch horizons and writes between steps.
TEST(ParamCoordinator, PropertiesHoldOnRandomTracesWithShardTiers) {
  CoordinatorStats total{};
  std::int64_t offloaded_gathers = 0;
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) {
    const harness::PropertyVerdict v = harness::check_random_trace(seed, true);
    ASSERT_EQ(v.violations, 0) << v.first_violation;
    total.shard_fetches_ahead += v.stats.shard_fetches_ahead;
    total.shard_fetches_unused += v.stats.shard_fetches_unused;
    total.shard_stores += v.stats.shard_stores;
    total.trace_departures += v.stats.trace_departures;
    total.aborted_steps += v.stats.aborted_steps;
    offloaded_gathers += v.offloaded_gathers;
  }
  // The traces reach every path the properties are about.
  EXPECT_GT(offloaded_gathers, 50000);
  EXPECT_GT(total.shard_fetches_ahead, 10000);
  EXPECT_GT(total.shard_fetches_unused, 500);
  EXPECT_GT(total.shard_stores, 5000);
  EXPECT_GT(total.trace_departures, 5000);
  EXPECT_GT(total.aborted_steps, 100);
}

}  // namespace
}  // namespace zcore
