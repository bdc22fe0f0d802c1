#include "zcore/prefetch.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

namespace zcore {
namespace {

struct Scene {
  ParamGroupTable groups;
  ExecutionTrace trace;

  void uses(const std::vector<GroupId>& order) {
    for (GroupId g : order) trace.append(g, groups.numel(g));
    trace.build_index();
  }
};

std::vector<GroupId> ids(const std::vector<PrefetchCandidate>& c) {
  std::vector<GroupId> out;
  for (const auto& x : c) out.push_back(x.group);
  return out;
}

TEST(PrefetchScheduler, TakesSharedGroupsInTraceOrderWithinTheBucket) {
  Scene s;
  for (int i = 0; i < 5; ++i) s.groups.add(100, 2, false);
  s.uses({0, 1, 2, 1, 3, 4});
  PrefetchScheduler p;
  std::vector<PrefetchCandidate> out;
  // Group 1 is used twice ahead: taken once, for its first use.
  const PrefetchResult r = p.schedule(s.trace, s.groups, {1, 300, 0, 1000}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{1, 2, 3}));
  EXPECT_EQ(out[2].use, 4u);
  EXPECT_EQ(r.frontier, 5u) << "stopped by the bucket at group 4's use";
  EXPECT_FALSE(r.blocked);
}

TEST(PrefetchScheduler, SkipsGroupsAlreadyGatheredOrInFlight) {
  Scene s;
  for (int i = 0; i < 4; ++i) s.groups.add(100, 2, false);
  s.uses({0, 1, 2, 3});
  s.groups.start_gather(1, true);  // in flight: costs nothing more
  s.groups.start_gather(2, false);
  s.groups.finish_gather(2);
  PrefetchScheduler p;
  std::vector<PrefetchCandidate> out;
  const PrefetchResult r = p.schedule(s.trace, s.groups, {0, 1000, 100, 1000}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{0, 3}));
  EXPECT_EQ(r.frontier, 4u);
}

TEST(PrefetchScheduler, BucketCountsWhatIsAlreadyAheadButAdmitsOneLargeGroup) {
  Scene s;
  s.groups.add(500, 2, false);
  s.groups.add(10, 2, false);
  s.uses({0, 1});
  PrefetchScheduler p;
  std::vector<PrefetchCandidate> out;
  p.schedule(s.trace, s.groups, {0, 100, 0, 10000}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{0})) << "nothing ahead: one group larger than the bucket";
  p.schedule(s.trace, s.groups, {0, 100, 95, 10000}, &out);
  EXPECT_TRUE(out.empty()) << "95 ahead + 500 > bucket";
  p.schedule(s.trace, s.groups, {1, 100, 90, 10000}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{1})) << "90 + 10 <= 100";
  const PrefetchResult r = p.schedule(s.trace, s.groups, {0, 0, 0, 10000}, &out);
  EXPECT_TRUE(out.empty()) << "bucket 0 disables prefetch";
  EXPECT_EQ(r.frontier, 0u);
}

TEST(PrefetchScheduler, StopsAtTheFirstGroupOverTheHeadroomAndNamesIt) {
  Scene s;
  s.groups.add(100, 2, false);
  s.groups.add(300, 2, false);
  s.groups.add(50, 2, false);
  s.groups.add(40, 2, true);
  s.uses({0, 1, 2, 3});
  PrefetchScheduler p;
  std::vector<PrefetchCandidate> out;
  const PrefetchResult r = p.schedule(s.trace, s.groups, {0, 10000, 0, 200}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{0})) << "group 2 would fit but comes after group 1";
  EXPECT_TRUE(r.blocked);
  EXPECT_EQ(r.blocker.group, 1);
  EXPECT_EQ(r.blocker.use, 1u);
  EXPECT_EQ(r.frontier, 1u);
  // A persistent group does not spend headroom.
  s.groups.start_gather(0, false);
  s.groups.start_gather(1, false);
  s.groups.start_gather(2, false);
  const PrefetchResult r2 = p.schedule(s.trace, s.groups, {0, 10000, 0, 0}, &out);
  EXPECT_EQ(ids(out), (std::vector<GroupId>{3}));
  EXPECT_FALSE(r2.blocked);
}

// The scheduler against a literal reading of the policy in prefetch.h, on
// random traces, states and limits.
TEST(PrefetchScheduler, MatchesTheDocumentedPolicy) {
  std::mt19937_64 rng(11);
  PrefetchScheduler p;
  std::vector<PrefetchCandidate> out;
  for (int round = 0; round < 3000; ++round) {
    Scene s;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int g = 0; g < n; ++g) s.groups.add(1 + static_cast<std::int64_t>(rng() % 100), 2, rng() % 5 == 0);
    std::vector<GroupId> order;
    for (int u = static_cast<int>(rng() % 30); u > 0; --u) order.push_back(static_cast<GroupId>(rng() % n));
    s.uses(order);
    for (GroupId g = 0; g < n; ++g) {
      if (rng() % 3 == 0) s.groups.start_gather(g, false);
    }
    const PrefetchRequest req{rng() % (order.size() + 1), static_cast<std::int64_t>(rng() % 300),
                              static_cast<std::int64_t>(rng() % 100),
                              static_cast<std::int64_t>(rng() % 400) - 50};
    const PrefetchResult r = p.schedule(s.trace, s.groups, req, &out);

    std::vector<GroupId> expected;
    std::set<GroupId> taken;
    std::int64_t ahead = req.ahead_elements, headroom = req.live_headroom;
    std::size_t frontier = order.size();
    bool blocked = false;
    for (std::size_t u = req.scan_from; u < order.size() && req.bucket_elements > 0; ++u) {
      const GroupId g = order[u];
      if (s.groups.state(g) != GroupState::kSharded || taken.count(g)) continue;
      const std::int64_t e = s.groups.numel(g);
      const bool fits_bucket = ahead == 0 || ahead + e <= req.bucket_elements;
      const bool fits_memory = s.groups.persistent(g) || e <= headroom;
      if (!fits_bucket || !fits_memory) {
        frontier = u;
        blocked = fits_bucket;
        break;
      }
      taken.insert(g);
      expected.push_back(g);
      ahead += e;
      if (!s.groups.persistent(g)) headroom -= e;
    }
    if (req.bucket_elements == 0) frontier = req.scan_from;
    ASSERT_EQ(ids(out), expected) << "round " << round;
    ASSERT_EQ(r.frontier, frontier) << "round " << round;
    ASSERT_EQ(r.blocked, blocked) << "round " << round;
  }
}

}  // namespace
}  // namespace zcore
