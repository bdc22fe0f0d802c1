// ParamCoordinator's gather state and protocol: plans of recording and
// following steps, re-entered and nested modules, the trace (departures,
// resynchronisation, notices, keys), and the property test over random
// traces. The live budget, reuse distance and persistence are tested in
// test_coordinator_budget.cpp; the shard tiers in test_coordinator_shards.cpp.
#include "zcore/coordinator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator_harness.h"
#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {
namespace {

using namespace harness;  // the example tests' plans, configs and Chain
using testing_support::code_of;

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

}  // namespace
}  // namespace zcore
