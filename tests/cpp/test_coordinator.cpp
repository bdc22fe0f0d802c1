#include "zcore/coordinator.h"

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "coordinator_harness.h"
#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {

bool operator==(const Action& a, const Action& b) { return a.kind == b.kind && a.group == b.group; }

void PrintTo(const Action& a, std::ostream* os) {
  static const char* const kNames[] = {"G", "W", "R", "Fetch", "Ready", "Drop", "Store", "Stored"};
  *os << kNames[static_cast<int>(a.kind)] << a.group;
}

namespace {

using testing_support::code_of;

constexpr ActionKind G = ActionKind::kGather;
constexpr ActionKind W = ActionKind::kWait;
constexpr ActionKind R = ActionKind::kRelease;
constexpr ActionKind Fetch = ActionKind::kFetchShard;
constexpr ActionKind Ready = ActionKind::kShardReady;
constexpr ActionKind Drop = ActionKind::kDropShard;
constexpr ActionKind Store = ActionKind::kStoreShard;
constexpr ActionKind Stored = ActionKind::kShardStored;
constexpr std::int64_t S = 1'000'000;  // a layer-sized group, above the persistence threshold

Plan plan(std::initializer_list<Action> actions) { return Plan(actions); }

CoordinatorConfig config(std::int64_t bucket, std::int64_t live, std::int64_t reuse) {
  CoordinatorConfig c;
  c.prefetch_bucket_elements = bucket;
  c.max_live_elements = live;
  c.max_reuse_distance = reuse;
  return c;
}

// n groups of `numel` elements and one module per group (module i uses group i).
struct Chain {
  explicit Chain(const CoordinatorConfig& cfg, int n, std::int64_t numel = S) : c(cfg) {
    for (int i = 0; i < n; ++i) c.register_module({c.register_group(numel, 2)});
  }
  void run(const std::vector<ModuleId>& order) {
    for (ModuleId m : order) {
      c.before_module(m);
      c.after_module(m);
    }
  }
  void step(const std::vector<ModuleId>& order, std::int64_t key = 0) {
    c.begin_step(key);
    run(order);
    c.end_step();
  }
  ParamCoordinator c;
};

TEST(ParamCoordinator, RejectsBadConfigIdsAndModules) {
  CoordinatorConfig bad;
  bad.max_live_elements = -1;
  EXPECT_EQ(code_of([&] { ParamCoordinator c(bad); }), StatusCode::kInvalidArgument);
  ParamCoordinator c(CoordinatorConfig{});
  const GroupId g = c.register_group(S, 2);
  EXPECT_EQ(code_of([&] { c.register_group(0, 2); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { c.register_module({g, 5}); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { c.register_module({g, g}); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { c.before_module(0); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(code_of([&] { c.state(1); }), StatusCode::kInvalidHandle);
  EXPECT_EQ(c.num_modules(), 0u) << "a refused module is not registered";
}

TEST(ParamCoordinator, RejectsCallsOutOfProtocol) {
  Chain ch(CoordinatorConfig{}, 2);
  EXPECT_EQ(code_of([&] { ch.c.after_module(0); }), StatusCode::kInvalidState);
  EXPECT_EQ(code_of([&] { ch.c.end_step(); }), StatusCode::kInvalidState);
  ch.c.begin_step(0);
  EXPECT_EQ(code_of([&] { ch.c.begin_step(0); }), StatusCode::kInvalidState);
  EXPECT_EQ(code_of([&] { ch.c.release_all(); }), StatusCode::kInvalidState);
  ch.c.before_module(1);
  EXPECT_EQ(code_of([&] { ch.c.end_step(); }), StatusCode::kInvalidState) << "module 1 still runs";
  EXPECT_EQ(ch.c.state(1), GroupState::kInUse) << "the refused end_step changed nothing";
  ch.c.after_module(1);
  ch.c.end_step();
}

TEST(ParamCoordinator, RecordingStepGathersOnDemandAndReleasesAfterUse) {
  Chain ch(CoordinatorConfig{}, 3);
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{G, 0}, {W, 0}}));
  EXPECT_EQ(ch.c.state(0), GroupState::kInUse);
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}})) << "no trace yet: nothing is kept";
  EXPECT_EQ(ch.c.before_module(2), plan({{G, 2}, {W, 2}}));
  EXPECT_EQ(ch.c.after_module(2), plan({{R, 2}}));
  EXPECT_TRUE(ch.c.end_step().empty());
  EXPECT_EQ(ch.c.trace(0), (std::vector<GroupId>{0, 2}));
  const CoordinatorStats s = ch.c.stats();
  EXPECT_EQ(s.gathers, 2);
  EXPECT_EQ(s.prefetch_misses, 2);
  EXPECT_EQ(s.bytes_gathered, 2 * 2 * S);
  EXPECT_EQ(s.trace_recordings, 1);
  EXPECT_EQ(s.peak_live_elements, S);
  EXPECT_EQ(s.live_elements, 0);
}

TEST(ParamCoordinator, FollowingStepPrefetchesWithinTheBucket) {
  Chain ch(config(2 * S, 100 * S, 0), 4);
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  // Gathers its own group, prefetches the next two (the bucket), then waits.
  EXPECT_EQ(ch.c.before_module(0), plan({{G, 0}, {G, 1}, {G, 2}, {W, 0}}));
  EXPECT_EQ(ch.c.after_module(0), plan({{R, 0}}));
  // Prefetches are issued before the wait, so that they overlap it.
  EXPECT_EQ(ch.c.before_module(1), plan({{G, 3}, {W, 1}}));
  EXPECT_EQ(ch.c.after_module(1), plan({{R, 1}}));
  EXPECT_EQ(ch.c.before_module(2), plan({{W, 2}}));
  EXPECT_EQ(ch.c.after_module(2), plan({{R, 2}}));
  EXPECT_EQ(ch.c.before_module(3), plan({{W, 3}}));
  EXPECT_EQ(ch.c.after_module(3), plan({{R, 3}}));
  EXPECT_TRUE(ch.c.end_step().empty());
  const CoordinatorStats s = ch.c.stats();
  EXPECT_EQ(s.prefetch_hits, 3);
  EXPECT_EQ(s.prefetch_misses, 4 + 1) << "the recording step's 4 and the first module's";
  EXPECT_EQ(s.prefetch_gathers, 3);
  EXPECT_EQ(s.trace_departures, 0);
  EXPECT_FALSE(ch.c.take_departure_notice().has_value());
}

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

TEST(ParamCoordinator, ReenteredAndNestedModulesCountUses) {
  Chain ch(CoordinatorConfig{}, 2);
  ParamCoordinator& c = ch.c;
  const ModuleId both = c.register_module({0, 1});
  c.begin_step(0);
  EXPECT_EQ(c.before_module(0), plan({{G, 0}, {W, 0}}));
  EXPECT_TRUE(c.before_module(0).empty()) << "re-entered: already in use";
  EXPECT_EQ(c.use_count(0), 2);
  EXPECT_EQ(c.before_module(both), plan({{G, 1}, {W, 1}}));
  EXPECT_EQ(c.use_count(0), 3);
  EXPECT_EQ(c.after_module(both), plan({{R, 1}}));
  EXPECT_TRUE(c.after_module(0).empty()) << "the outer call still runs";
  EXPECT_EQ(c.after_module(0), plan({{R, 0}}));
  EXPECT_EQ(code_of([&] { c.after_module(0); }), StatusCode::kInvalidState);
  c.end_step();
  EXPECT_EQ(c.trace(0), (std::vector<GroupId>{0, 0, 0, 1}));
}

TEST(ParamCoordinator, SkippedBranchResynchronisesAndWaitsTheUnusedPrefetch) {
  Chain ch(config(S, 100 * S, 0), 4);
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  EXPECT_EQ(ch.c.before_module(0), plan({{G, 0}, {G, 1}, {W, 0}}));
  ch.c.after_module(0);
  // Module 1 is skipped this step: group 2 comes, found one use ahead.
  EXPECT_EQ(ch.c.before_module(2), plan({{G, 2}, {W, 2}}))
      << "group 1 is ahead and fills the bucket: no prefetch of 3";
  ch.c.after_module(2);
  EXPECT_EQ(ch.c.before_module(3), plan({{G, 3}, {W, 3}}));
  ch.c.after_module(3);
  EXPECT_EQ(ch.c.end_step(), plan({{W, 1}, {R, 1}})) << "the unused prefetch is waited, then released";
  CoordinatorStats s = ch.c.stats();
  EXPECT_EQ(s.trace_departures, 1);
  EXPECT_EQ(s.trace_resyncs, 1);
  EXPECT_EQ(s.prefetch_unused, 1);
  const auto notice = ch.c.take_departure_notice();
  ASSERT_TRUE(notice.has_value());
  EXPECT_EQ(notice->expected, 1);
  EXPECT_EQ(notice->actual, 2);
  EXPECT_EQ(notice->position, 1);
  EXPECT_EQ(notice->step, 1);
  EXPECT_FALSE(ch.c.take_departure_notice().has_value()) << "notified once";
  EXPECT_EQ(ch.c.trace(0), (std::vector<GroupId>{0, 2, 3})) << "re-recorded";
  ch.step({0, 2, 3});
  EXPECT_EQ(ch.c.stats().trace_departures, 1) << "the new trace is followed";
}

TEST(ParamCoordinator, InsertedModuleResynchronisesAtTheSamePosition) {
  Chain ch(config(S, 100 * S, 0), 4);
  ch.step({0, 1, 2});
  ch.c.begin_step(0);
  ch.c.before_module(0);  // prefetches 1
  ch.c.after_module(0);
  EXPECT_EQ(ch.c.before_module(3), plan({{G, 3}, {W, 3}})) << "unpredicted: on demand, no prefetch";
  ch.c.after_module(3);
  EXPECT_EQ(ch.c.before_module(1), plan({{G, 2}, {W, 1}})) << "back on the trace: prefetch again";
  ch.c.after_module(1);
  ch.c.before_module(2);
  ch.c.after_module(2);
  ch.c.end_step();
  EXPECT_EQ(ch.c.stats().trace_departures, 1);
  EXPECT_EQ(ch.c.stats().trace_resyncs, 1);
}

TEST(ParamCoordinator, UsesAreUnforeseenWhileRecordingAndAtDepartures) {
  Chain ch(config(S, 100 * S, 0), 4);
  EXPECT_FALSE(ch.c.recording());
  EXPECT_FALSE(ch.c.unforeseen(0)) << "outside a step";
  ch.c.begin_step(0);
  EXPECT_TRUE(ch.c.recording()) << "the key's first step records";
  EXPECT_TRUE(ch.c.unforeseen(0));
  ch.run({0, 1, 2});
  ch.c.end_step();
  EXPECT_FALSE(ch.c.recording());
  ch.c.begin_step(0);
  EXPECT_FALSE(ch.c.recording()) << "follows its trace";
  EXPECT_FALSE(ch.c.unforeseen(0));
  EXPECT_TRUE(ch.c.unforeseen(1)) << "a departure, asked before it happens";
  EXPECT_FALSE(ch.c.recording()) << "asking changes nothing";
  ch.run({0});
  EXPECT_TRUE(ch.c.unforeseen(3));
  ch.run({3});
  EXPECT_TRUE(ch.c.recording()) << "departed";
  EXPECT_TRUE(ch.c.unforeseen(1)) << "every use while departed";
  ch.run({1});
  EXPECT_FALSE(ch.c.recording()) << "resynchronised";
  EXPECT_FALSE(ch.c.unforeseen(2));
  ch.run({2});
  EXPECT_TRUE(ch.c.unforeseen(2)) << "past the end of the trace";
  ch.c.end_step();
  ch.c.begin_step(1);
  EXPECT_TRUE(ch.c.recording()) << "another key records its own trace";
  ch.c.abort_step();
  EXPECT_FALSE(ch.c.recording());
}

TEST(ParamCoordinator, AModuleOfSeveralGroupsIsForeseenOnlyWhenAllAreNext) {
  ParamCoordinator c(config(S, 100 * S, 0));
  const GroupId g0 = c.register_group(S, 2);
  const GroupId g1 = c.register_group(S, 2);
  const ModuleId both = c.register_module({g0, g1});
  const ModuleId reversed = c.register_module({g1, g0});
  c.begin_step(0);
  c.before_module(both);
  c.after_module(both);
  c.end_step();
  c.begin_step(0);
  EXPECT_FALSE(c.unforeseen(both));
  EXPECT_TRUE(c.unforeseen(reversed));
  c.abort_step();
}

TEST(ParamCoordinator, AlternatingControlFlowIsNotifiedOnce) {
  Chain ch(config(S, 100 * S, 0), 3);
  int notices = 0;
  for (int step = 0; step < 12; ++step) {
    ch.step(step % 2 ? std::vector<ModuleId>{0, 2} : std::vector<ModuleId>{0, 1, 2});
    notices += ch.c.take_departure_notice().has_value();
  }
  EXPECT_EQ(ch.c.stats().trace_departures, 11);
  EXPECT_EQ(notices, 1);
  ch.step({0, 2});  // the same as the step before: followed
  EXPECT_FALSE(ch.c.take_departure_notice().has_value());
  ch.step({0, 1});  // departs after a followed step: news again
  EXPECT_TRUE(ch.c.take_departure_notice().has_value());
}

TEST(ParamCoordinator, StepEndingEarlyIsADepartureAndLeavesNothingInFlight) {
  Chain ch(config(2 * S, 100 * S, 0), 4);
  ch.step({0, 1, 2, 3});
  ch.c.begin_step(0);
  ch.run({0});  // prefetches 1 and 2
  EXPECT_EQ(ch.c.end_step(), plan({{W, 1}, {R, 1}, {W, 2}, {R, 2}}));
  const auto notice = ch.c.take_departure_notice();
  ASSERT_TRUE(notice.has_value());
  EXPECT_EQ(notice->expected, 1);
  EXPECT_EQ(notice->actual, -1);
  EXPECT_EQ(ch.c.trace(0), (std::vector<GroupId>{0}));
}

TEST(ParamCoordinator, AbortStepReleasesEverythingAndKeepsTheTrace) {
  Chain ch(config(S, 100 * S, 100 * S), 3);
  ch.step({0, 1, 2});
  ch.c.begin_step(0);
  ch.c.before_module(0);  // prefetches 1
  ch.c.before_module(1);  // nested
  EXPECT_EQ(ch.c.abort_step(), plan({{R, 0}, {R, 1}, {W, 2}, {R, 2}}));
  EXPECT_FALSE(ch.c.in_step());
  EXPECT_EQ(ch.c.stats().aborted_steps, 1);
  EXPECT_EQ(ch.c.trace(0), (std::vector<GroupId>{0, 1, 2}));
  ch.step({0, 1, 2});
  EXPECT_EQ(ch.c.stats().trace_departures, 0);
}

TEST(ParamCoordinator, UntracedUsesOutsideAStepReleaseAtExit) {
  Chain ch(config(10 * S, 100 * S, 100 * S), 2);
  ch.step({0, 1});
  EXPECT_EQ(ch.c.before_module(1), plan({{G, 1}, {W, 1}})) << "no prefetch outside a step";
  EXPECT_EQ(ch.c.after_module(1), plan({{R, 1}})) << "nothing kept outside a step";
  EXPECT_EQ(ch.c.trace(0), (std::vector<GroupId>{0, 1})) << "untraced";
}

TEST(ParamCoordinator, TraceKeysKeepSeparateTraces) {
  Chain ch(config(S, 100 * S, 0), 3);
  for (int step = 0; step < 6; ++step) {
    if (step % 2) {
      ch.step({0, 1, 2}, 0);
    } else {
      ch.step({2, 0}, 1);
    }
  }
  EXPECT_EQ(ch.c.stats().trace_departures, 0);
  EXPECT_EQ(ch.c.stats().trace_recordings, 2);
  EXPECT_EQ(ch.c.trace(1), (std::vector<GroupId>{2, 0}));
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

TEST(ParamCoordinator, HarnessDetectsAPlanThatWasNotExecuted) {
  Chain ch(CoordinatorConfig{}, 2);
  harness::FaithfulCaller caller(ch.c, {{0}, {1}}, {S, S});
  caller.begin_step(0);
  caller.enter(0);
  ch.c.after_module(0);  // behind the caller's back: it never executes this release
  caller.enter(1);
  EXPECT_GT(caller.violations(), 0);
  EXPECT_NE(caller.first_violation().find("group 0"), std::string::npos) << caller.first_violation();
}

// The property test over random traces (see coordinator_harness.h); the
// fuzz target in bench/cpp/bench_coordinator.cpp runs >= 10^5 of them.
TEST(ParamCoordinator, PropertiesHoldOnRandomTraces) {
  CoordinatorStats total{};
  std::int64_t premature_or_missed = 0;
  for (std::uint64_t seed = 1; seed <= 5000; ++seed) {
    const harness::PropertyVerdict v = harness::check_random_trace(seed);
    ASSERT_EQ(v.violations, 0) << v.first_violation;
    total.module_calls += v.stats.module_calls;
    total.prefetch_hits += v.stats.prefetch_hits;
    total.prefetch_unused += v.stats.prefetch_unused;
    total.trace_departures += v.stats.trace_departures;
    total.trace_resyncs += v.stats.trace_resyncs;
    total.aborted_steps += v.stats.aborted_steps;
    total.resident_hits += v.stats.resident_hits;
    premature_or_missed += v.stats.prefetch_misses;
  }
  // The traces reach every path the properties are about.
  EXPECT_GT(total.module_calls, 200000);
  EXPECT_GT(total.prefetch_hits, 10000);
  EXPECT_GT(total.prefetch_unused, 1000);
  EXPECT_GT(total.trace_departures, 1000);
  EXPECT_GT(total.trace_resyncs, 1000);
  EXPECT_GT(total.aborted_steps, 100);
  EXPECT_GT(total.resident_hits, 10000);
  EXPECT_GT(premature_or_missed, 10000);
  RecordProperty("module_calls", std::to_string(total.module_calls));
}

// Shard tiers ---------------------------------------------------------------

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
