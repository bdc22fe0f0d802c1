// Parameter groups of ZeRO-3 and the one state machine each of them follows.
//
// A parameter group is the unit that is gathered by one all-gather: normally
// one module's own parameters, flattened. Each rank keeps a shard; the full
// parameters exist only while the group is gathered. ParamGroupTable is the
// only owner of every group's state and of the element totals derived from
// it (live, in use, gathered ahead of use); ParamCoordinator drives it.
//
// A group is *persistent* when it is small (fewer elements than the
// persistence threshold): it stays gathered once gathered, and it is not
// counted against the live-element budget ("live" below means non-persistent
// groups that are not sharded).
#pragma once

#include <cstdint>
#include <vector>

namespace zcore {

using GroupId = std::int64_t;  // dense: 0, 1, ... in registration order

enum class GroupState : std::uint8_t {
  kSharded,    // only this rank's shard exists; the full parameters are not materialized
  kGathering,  // an all-gather of the full parameters is in flight, not yet waited on
  kGathered,   // full parameters materialized; no module is running with them
  kInUse,      // full parameters materialized; at least one module is running with them
};

const char* group_state_name(GroupState state);

class ParamGroupTable {
 public:
  // numel > 0, element_size > 0 (bytes per gathered element, for statistics).
  GroupId add(std::int64_t numel, std::int64_t element_size, bool persistent);

  std::size_t size() const { return groups_.size(); }
  // Throws Error(kInvalidHandle) naming the id and the registered range.
  void check(GroupId group) const;

  // Transitions. Each checks the state it starts from, throws
  // Error(kInvalidState) naming the group and both states otherwise, and sets
  // the new state last.
  void start_gather(GroupId group, bool ahead_of_use);  // kSharded -> kGathering
  void finish_gather(GroupId group);                    // kGathering -> kGathered
  void acquire(GroupId group);    // kGathered -> kInUse; kInUse -> kInUse, one more user
  void unacquire(GroupId group);  // kInUse -> kInUse, one user fewer; kGathered after the last
  void drop_users(GroupId group);  // kInUse -> kGathered, all users at once (aborted step)
  void release(GroupId group);     // kGathered -> kSharded
  // A module is about to use the group: it no longer counts as gathered
  // ahead of use (acquire() does the same; this is for before the gather
  // has been waited, when acquire() cannot run yet). Any state.
  void claim(GroupId group) { clear_ahead(groups_[index(group)]); }

  // Queries take an id that check() accepts; they do not check it again
  // because the coordinator validates ids once per call, on its hot path.
  GroupState state(GroupId group) const { return groups_[index(group)].state; }
  std::int64_t use_count(GroupId group) const { return groups_[index(group)].users; }
  std::int64_t numel(GroupId group) const { return groups_[index(group)].numel; }
  std::int64_t element_size(GroupId group) const { return groups_[index(group)].element_size; }
  bool persistent(GroupId group) const { return groups_[index(group)].persistent; }
  // Gathered ahead of use (prefetched) and not used since.
  bool ahead_of_use(GroupId group) const { return groups_[index(group)].ahead; }

  std::int64_t live_elements() const { return live_elements_; }
  std::int64_t in_use_elements() const { return in_use_elements_; }  // non-persistent
  std::int64_t ahead_elements() const { return ahead_elements_; }    // persistent included
  std::int64_t persistent_gathered_elements() const { return persistent_elements_; }
  std::int64_t groups_in_use() const { return groups_in_use_; }
  std::int64_t groups_in_flight() const { return groups_in_flight_; }
  // Non-persistent groups that are not sharded, in no particular order.
  const std::vector<GroupId>& live_groups() const { return live_; }

 private:
  struct Group {
    std::int64_t numel;
    std::int64_t element_size;
    bool persistent;
    bool ahead;  // see ahead_of_use()
    GroupState state;
    std::int64_t users;      // modules running with it; > 0 exactly in kInUse
    std::size_t live_slot;   // index in live_ while live
  };

  static std::size_t index(GroupId group) { return static_cast<std::size_t>(group); }
  Group& expect(GroupId group, GroupState from, const char* transition);
  void clear_ahead(Group& g);

  std::vector<Group> groups_;
  std::vector<GroupId> live_;
  std::int64_t live_elements_ = 0;
  std::int64_t in_use_elements_ = 0;
  std::int64_t ahead_elements_ = 0;
  std::int64_t persistent_elements_ = 0;
  std::int64_t groups_in_use_ = 0;
  std::int64_t groups_in_flight_ = 0;
};

}  // namespace zcore
