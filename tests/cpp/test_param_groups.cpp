#include "zcore/param_groups.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "expect_error.h"
#include "zcore/status.h"

namespace zcore {
namespace {

using testing_support::error_of;

TEST(ParamGroupTable, GroupGoesThroughItsStates) {
  ParamGroupTable t;
  const GroupId g = t.add(1000, 2, false);
  EXPECT_EQ(t.state(g), GroupState::kSharded);
  t.start_gather(g, false);
  EXPECT_EQ(t.state(g), GroupState::kGathering);
  EXPECT_EQ(t.groups_in_flight(), 1);
  EXPECT_EQ(t.live_elements(), 1000);  // in flight counts: its buffer is taken
  t.finish_gather(g);
  EXPECT_EQ(t.state(g), GroupState::kGathered);
  EXPECT_EQ(t.groups_in_flight(), 0);
  t.acquire(g);
  t.acquire(g);  // re-entered
  EXPECT_EQ(t.state(g), GroupState::kInUse);
  EXPECT_EQ(t.use_count(g), 2);
  EXPECT_EQ(t.in_use_elements(), 1000);
  t.unacquire(g);
  EXPECT_EQ(t.state(g), GroupState::kInUse);
  t.unacquire(g);
  EXPECT_EQ(t.state(g), GroupState::kGathered);
  EXPECT_EQ(t.in_use_elements(), 0);
  t.release(g);
  EXPECT_EQ(t.state(g), GroupState::kSharded);
  EXPECT_EQ(t.live_elements(), 0);
}

TEST(ParamGroupTable, TransitionsCheckTheStateTheyStartFrom) {
  ParamGroupTable t;
  const GroupId g = t.add(10, 4, false);
  const Error e = error_of([&] { t.release(g); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidState);
  EXPECT_NE(std::string(e.what()).find("sharded"), std::string::npos) << e.what();
  EXPECT_EQ(error_of([&] { t.finish_gather(g); }).code(), StatusCode::kInvalidState);
  EXPECT_EQ(error_of([&] { t.acquire(g); }).code(), StatusCode::kInvalidState);
  EXPECT_EQ(error_of([&] { t.unacquire(g); }).code(), StatusCode::kInvalidState);
  t.start_gather(g, false);
  EXPECT_EQ(error_of([&] { t.start_gather(g, false); }).code(), StatusCode::kInvalidState);
  EXPECT_EQ(error_of([&] { t.release(g); }).code(), StatusCode::kInvalidState)
      << "a group in flight must be waited before it is released";
  EXPECT_EQ(error_of([&] { t.acquire(g); }).code(), StatusCode::kInvalidState);
  t.finish_gather(g);
  t.acquire(g);
  EXPECT_EQ(error_of([&] { t.release(g); }).code(), StatusCode::kInvalidState)
      << "a group in use must not be released";
  EXPECT_EQ(t.state(g), GroupState::kInUse) << "a refused transition changes nothing";
  t.drop_users(g);
  EXPECT_EQ(t.state(g), GroupState::kGathered);
  EXPECT_EQ(t.groups_in_use(), 0);
}

TEST(ParamGroupTable, RejectsBadSizesAndUnknownIds) {
  ParamGroupTable t;
  EXPECT_EQ(error_of([&] { t.add(0, 2, false); }).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(error_of([&] { t.add(5, 0, false); }).code(), StatusCode::kInvalidArgument);
  t.add(5, 2, false);
  const Error e = error_of([&] { t.start_gather(1, false); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidHandle);
  EXPECT_EQ(error_of([&] { t.check(-1); }).code(), StatusCode::kInvalidHandle);
}

TEST(ParamGroupTable, PersistentGroupsAreNotLive) {
  ParamGroupTable t;
  const GroupId p = t.add(7, 2, true);
  t.start_gather(p, true);
  EXPECT_EQ(t.live_elements(), 0);
  EXPECT_EQ(t.persistent_gathered_elements(), 7);
  EXPECT_EQ(t.ahead_elements(), 7) << "the prefetch bucket counts persistent groups too";
  t.finish_gather(p);
  t.acquire(p);
  EXPECT_EQ(t.in_use_elements(), 0);
  EXPECT_EQ(t.ahead_elements(), 0) << "a use consumes the prefetch";
  EXPECT_TRUE(t.live_groups().empty());
}

// The aggregates against a recount from the states, over random legal transitions.
TEST(ParamGroupTable, AggregatesMatchARecount) {
  ParamGroupTable t;
  std::mt19937 rng(7);
  std::vector<bool> ahead(40, false);
  for (int i = 0; i < 40; ++i) t.add(1 + static_cast<std::int64_t>(rng() % 1000), 2, rng() % 4 == 0);
  for (int step = 0; step < 20000; ++step) {
    const GroupId g = static_cast<GroupId>(rng() % 40);
    const auto i = static_cast<std::size_t>(g);
    switch (t.state(g)) {
      case GroupState::kSharded:
        ahead[i] = rng() % 2 == 0;
        t.start_gather(g, ahead[i]);
        break;
      case GroupState::kGathering: t.finish_gather(g); break;
      case GroupState::kGathered:
        if (rng() % 2) {
          t.acquire(g);
        } else {
          t.release(g);
        }
        ahead[i] = false;
        break;
      case GroupState::kInUse: rng() % 2 ? t.acquire(g) : t.unacquire(g); break;
    }
    std::int64_t live = 0, in_use = 0, ahead_sum = 0, persistent = 0, users = 0, flight = 0;
    std::vector<GroupId> live_ids;
    for (GroupId h = 0; h < 40; ++h) {
      const GroupState s = t.state(h);
      const bool gathered = s != GroupState::kSharded;
      if (gathered && !t.persistent(h)) live += t.numel(h), live_ids.push_back(h);
      if (gathered && t.persistent(h)) persistent += t.numel(h);
      if (s == GroupState::kInUse && !t.persistent(h)) in_use += t.numel(h);
      if (s == GroupState::kInUse) ++users;
      if (s == GroupState::kGathering) ++flight;
      if (ahead[static_cast<std::size_t>(h)]) ahead_sum += t.numel(h);
      EXPECT_EQ(t.ahead_of_use(h), ahead[static_cast<std::size_t>(h)]);
    }
    ASSERT_EQ(t.live_elements(), live);
    ASSERT_EQ(t.in_use_elements(), in_use);
    ASSERT_EQ(t.ahead_elements(), ahead_sum);
    ASSERT_EQ(t.persistent_gathered_elements(), persistent);
    ASSERT_EQ(t.groups_in_use(), users);
    ASSERT_EQ(t.groups_in_flight(), flight);
    std::vector<GroupId> listed = t.live_groups();
    std::sort(listed.begin(), listed.end());
    ASSERT_EQ(listed, live_ids);
  }
}

}  // namespace
}  // namespace zcore
