#include "zcore/shard_tiers.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {
namespace {

using testing_support::code_of;
using testing_support::error_of;

TEST(ShardTierTable, ShardGoesThroughItsStates) {
  ShardTierTable t(1000);
  const GroupId g = t.add(400, ShardTier::kNvme);
  EXPECT_EQ(t.tier(g), ShardTier::kNvme);
  EXPECT_EQ(t.state(g), ShardState::kStored);
  EXPECT_TRUE(t.offloaded(g));
  EXPECT_EQ(t.offloaded_groups(), 1);
  t.start_fetch(g);
  EXPECT_EQ(t.state(g), ShardState::kFetching);
  EXPECT_TRUE(t.staged(g));
  EXPECT_EQ(t.staged_bytes(), 400) << "a fetch in flight holds its slot";
  EXPECT_EQ(t.fetches_in_flight(), 1);
  t.finish_fetch(g);
  EXPECT_EQ(t.state(g), ShardState::kFetched);
  EXPECT_EQ(t.fetches_in_flight(), 0);
  EXPECT_EQ(t.staged_bytes(), 400);
  EXPECT_EQ(t.staged_groups(), std::vector<GroupId>{g});
  t.drop(g);
  EXPECT_EQ(t.state(g), ShardState::kStored);
  EXPECT_EQ(t.staged_bytes(), 0);
  EXPECT_TRUE(t.staged_groups().empty());
  t.start_store(g);
  EXPECT_EQ(t.state(g), ShardState::kStoring);
  EXPECT_EQ(t.stores_in_flight(), 1);
  EXPECT_EQ(t.staged_bytes(), 0) << "a write reads the updated shard, not a staging slot";
  t.finish_store(g);
  EXPECT_EQ(t.state(g), ShardState::kStored);
  EXPECT_EQ(t.stores_in_flight(), 0);
  const ShardTierStats s = t.stats();
  EXPECT_EQ(s.fetches, 1);
  EXPECT_EQ(s.bytes_fetched, 400);
  EXPECT_EQ(s.stores, 1);
  EXPECT_EQ(s.bytes_stored, 400);
  EXPECT_EQ(s.peak_staged_bytes, 400);
}

TEST(ShardTierTable, DeviceShardsAreResidentAndOthersStored) {
  ShardTierTable t(0);
  const GroupId device = t.add(10, ShardTier::kDevice);
  const GroupId host = t.add(10, ShardTier::kHost);
  EXPECT_EQ(t.state(device), ShardState::kResident);
  EXPECT_FALSE(t.offloaded(device));
  EXPECT_EQ(t.state(host), ShardState::kStored);
  EXPECT_EQ(t.offloaded_groups(), 1);
}

// Every transition from every state it does not start from is refused with
// kInvalidState naming the group and both states, and changes nothing.
TEST(ShardTierTable, EachIllegalTransitionIsRefusedNamingBothStates) {
  struct Transition {
    const char* name;
    ShardState from;
    std::function<void(ShardTierTable&, GroupId)> run;
  };
  const std::vector<Transition> transitions = {
      {"start_fetch", ShardState::kStored, [](ShardTierTable& t, GroupId g) { t.start_fetch(g); }},
      {"finish_fetch", ShardState::kFetching,
       [](ShardTierTable& t, GroupId g) { t.finish_fetch(g); }},
      {"drop", ShardState::kFetched, [](ShardTierTable& t, GroupId g) { t.drop(g); }},
      {"start_store", ShardState::kStored, [](ShardTierTable& t, GroupId g) { t.start_store(g); }},
      {"finish_store", ShardState::kStoring,
       [](ShardTierTable& t, GroupId g) { t.finish_store(g); }},
  };
  // Puts a fresh shard in `state` through legal transitions.
  const auto shard_in = [](ShardTierTable& t, ShardState state) {
    const GroupId g = t.add(8, state == ShardState::kResident ? ShardTier::kDevice : ShardTier::kNvme);
    if (state == ShardState::kFetching || state == ShardState::kFetched) t.start_fetch(g);
    if (state == ShardState::kFetched) t.finish_fetch(g);
    if (state == ShardState::kStoring) t.start_store(g);
    return g;
  };
  int refused = 0;
  for (ShardState state : {ShardState::kResident, ShardState::kStored, ShardState::kFetching,
                           ShardState::kFetched, ShardState::kStoring}) {
    for (const Transition& tr : transitions) {
      if (tr.from == state) continue;
      ShardTierTable t(1000);
      const GroupId g = shard_in(t, state);
      const std::int64_t staged = t.staged_bytes();
      const Error e = error_of([&] { tr.run(t, g); });
      EXPECT_EQ(e.code(), StatusCode::kInvalidState) << tr.name;
      const std::string what = e.what();
      EXPECT_NE(what.find("group " + std::to_string(g)), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("it is ") + shard_state_name(state)), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("starts from ") + shard_state_name(tr.from)), std::string::npos)
          << what;
      EXPECT_EQ(t.state(g), state) << tr.name << " changed the state it refused";
      EXPECT_EQ(t.staged_bytes(), staged);
      ++refused;
    }
  }
  EXPECT_EQ(refused, 5 * 5 - 5) << "5 states times 5 transitions, less each one's legal start";
}

TEST(ShardTierTable, StagingCountsFetchingAndFetchedShards) {
  ShardTierTable t(100);
  const GroupId a = t.add(40, ShardTier::kNvme);
  const GroupId b = t.add(40, ShardTier::kHost);
  const GroupId c = t.add(30, ShardTier::kNvme);
  EXPECT_TRUE(t.can_fetch(a));
  t.start_fetch(a);
  t.start_fetch(b);
  t.finish_fetch(b);
  EXPECT_EQ(t.staged_bytes(), 80);
  EXPECT_FALSE(t.can_fetch(c)) << "80 + 30 > 100";
  const Error e = error_of([&] { t.start_fetch(c); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidState);
  EXPECT_NE(std::string(e.what()).find("staging_bytes=100"), std::string::npos) << e.what();
  EXPECT_EQ(t.state(c), ShardState::kStored) << "a refused fetch changes nothing";
  t.drop(b);
  EXPECT_TRUE(t.can_fetch(c));
  t.start_fetch(c);
  EXPECT_EQ(t.staged_bytes(), 70);
  EXPECT_EQ(t.stats().peak_staged_bytes, 80);
  t.reset_peak();
  EXPECT_EQ(t.stats().peak_staged_bytes, 70);
}

TEST(ShardTierTable, OneShardLargerThanTheBudgetIsFetchedOnlyAlone) {
  ShardTierTable t(100);
  const GroupId big = t.add(150, ShardTier::kNvme);
  const GroupId small = t.add(10, ShardTier::kNvme);
  t.start_fetch(small);
  EXPECT_FALSE(t.can_fetch(big)) << "something else is staged";
  t.finish_fetch(small);
  t.drop(small);
  EXPECT_TRUE(t.can_fetch(big)) << "nothing is staged";
  t.start_fetch(big);
  EXPECT_EQ(t.staged_bytes(), 150);
  EXPECT_FALSE(t.can_fetch(small)) << "the oversized shard stays alone";
  EXPECT_TRUE(staging_fits(0, 150, 100));
  EXPECT_FALSE(staging_fits(1, 100, 100));
  EXPECT_TRUE(staging_fits(60, 40, 100));
}

TEST(ShardTierTable, RejectsBadSizesAndIds) {
  EXPECT_EQ(code_of([] { ShardTierTable t(-1); }), StatusCode::kInvalidArgument);
  ShardTierTable t(10);
  EXPECT_EQ(code_of([&] { t.add(0, ShardTier::kHost); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.size(), 0u);
  t.add(5, ShardTier::kHost);
  EXPECT_EQ(code_of([&] { t.check(1); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { t.start_fetch(-1); }), StatusCode::kInvalidHandle);
}

TEST(ShardTierTable, NamesEveryTierAndState) {
  EXPECT_STREQ(shard_tier_name(ShardTier::kDevice), "device");
  EXPECT_STREQ(shard_tier_name(ShardTier::kHost), "host");
  EXPECT_STREQ(shard_tier_name(ShardTier::kNvme), "nvme");
  EXPECT_STREQ(shard_state_name(ShardState::kResident), "resident");
  EXPECT_STREQ(shard_state_name(ShardState::kStored), "stored");
  EXPECT_STREQ(shard_state_name(ShardState::kFetching), "fetching");
  EXPECT_STREQ(shard_state_name(ShardState::kFetched), "fetched");
  EXPECT_STREQ(shard_state_name(ShardState::kStoring), "storing");
}

// The fetch walk: groups in both tables, a trace over them.
struct Model {
  explicit Model(std::int64_t staging) : shards(staging) {}
  GroupId add(std::int64_t shard_bytes, ShardTier tier) {
    groups.add(shard_bytes * 4, 2, false);
    return shards.add(shard_bytes, tier);
  }
  ExecutionTrace trace_of(const std::vector<GroupId>& uses) const {
    ExecutionTrace t;
    for (GroupId g : uses) t.append(g, groups.numel(g));
    t.build_index();
    return t;
  }
  ParamGroupTable groups;
  ShardTierTable shards;
  FetchScheduler fetcher;
  std::vector<GroupId> out;
};

TEST(FetchScheduler, TakesOffloadedShardsInTraceOrderOnce) {
  Model m(1000);
  const GroupId d = m.add(10, ShardTier::kDevice);
  const GroupId a = m.add(10, ShardTier::kNvme);
  const GroupId b = m.add(10, ShardTier::kHost);
  const ExecutionTrace trace = m.trace_of({d, b, a, b, d, a});
  EXPECT_EQ(m.fetcher.schedule(trace, m.groups, m.shards, {0, 6}, &m.out), 6u);
  EXPECT_EQ(m.out, (std::vector<GroupId>{b, a})) << "device shards need no fetch; one fetch per group";
}

TEST(FetchScheduler, SkipsGroupsGatheredAndShardsStagedButNotShardsBeingWritten) {
  Model m(1000);
  const GroupId gathered = m.add(10, ShardTier::kNvme);
  const GroupId staged = m.add(10, ShardTier::kNvme);
  const GroupId storing = m.add(10, ShardTier::kNvme);
  m.groups.start_gather(gathered, false);
  m.shards.start_fetch(staged);
  m.shards.start_store(storing);
  const ExecutionTrace trace = m.trace_of({gathered, staged, storing});
  m.fetcher.schedule(trace, m.groups, m.shards, {0, 3}, &m.out);
  EXPECT_EQ(m.out, std::vector<GroupId>{storing}) << "its write is waited before the fetch";
}

TEST(FetchScheduler, StopsAtTheHorizonAndCountsWhatIsStaged) {
  Model m(100);
  const GroupId a = m.add(40, ShardTier::kNvme);
  const GroupId b = m.add(50, ShardTier::kNvme);
  const GroupId c = m.add(10, ShardTier::kNvme);
  const ExecutionTrace trace = m.trace_of({a, b, c});
  EXPECT_EQ(m.fetcher.schedule(trace, m.groups, m.shards, {0, 1}, &m.out), 1u) << "horizon";
  EXPECT_EQ(m.out, std::vector<GroupId>{a});
  m.shards.start_fetch(a);
  EXPECT_EQ(m.fetcher.schedule(trace, m.groups, m.shards, {1, 64}, &m.out), 3u)
      << "the horizon is clipped to the trace";
  EXPECT_EQ(m.out, (std::vector<GroupId>{b, c})) << "40 + 50 + 10 fits exactly";
}

TEST(FetchScheduler, AShardThatDoesNotFitStopsTheWalkThere) {
  Model m(100);
  const GroupId a = m.add(60, ShardTier::kNvme);
  const GroupId b = m.add(60, ShardTier::kNvme);
  const GroupId c = m.add(10, ShardTier::kNvme);
  const ExecutionTrace trace = m.trace_of({a, b, c});
  EXPECT_EQ(m.fetcher.schedule(trace, m.groups, m.shards, {0, 3}, &m.out), 1u)
      << "b does not fit after a: the frontier stays at b's use";
  EXPECT_EQ(m.out, std::vector<GroupId>{a}) << "c, smaller and later, is not taken";
}

TEST(FetchScheduler, DoesNothingWithoutOffloadedGroups) {
  Model m(0);
  const GroupId d = m.add(10, ShardTier::kDevice);
  const ExecutionTrace trace = m.trace_of({d, d});
  EXPECT_EQ(m.fetcher.schedule(trace, m.groups, m.shards, {0, 64}, &m.out), 2u);
  EXPECT_TRUE(m.out.empty());
}

}  // namespace
}  // namespace zcore
