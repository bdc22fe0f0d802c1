// The execution trace of one kind of step: the order in which parameter
// groups were used (forward, then backward: backward is just the
// continuation), one entry per use, with the elements each use touches.
//
// Positions are use indices: position p means uses [0, p) have happened.
// Distances are measured the way DeepSpeed measures reuse distance: in
// parameter elements accessed by the uses in between.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "zcore/param_groups.h"

namespace zcore {

class ExecutionTrace {
 public:
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

  void clear();  // keeps capacity: the coordinator records into one trace per step
  void append(GroupId group, std::int64_t numel);
  // Builds the per-group index that next_use() reads. Call once the trace is
  // complete; append() after it drops the index until the next call.
  void build_index();

  std::size_t size() const { return uses_.size(); }
  bool empty() const { return uses_.empty(); }
  GroupId at(std::size_t use) const { return uses_[use]; }
  const std::vector<GroupId>& uses() const { return uses_; }

  // Elements touched by the uses [from, to), from <= to <= size().
  std::int64_t elements_between(std::size_t from, std::size_t to) const {
    return prefix_[to] - prefix_[from];
  }
  // The first use at or after `from` whose group is `group`, or kNone (also
  // for a group the trace never used). Needs build_index(); O(log uses of the group).
  std::size_t next_use(GroupId group, std::size_t from) const;

 private:
  std::vector<GroupId> uses_;
  std::vector<std::int64_t> prefix_{0};  // prefix_[i]: elements of uses [0, i)
  // Uses grouped by group, ascending (compressed rows): the uses of group g
  // are by_group_[row_start_[g] .. row_start_[g + 1]).
  std::vector<std::size_t> row_start_;
  std::vector<std::size_t> by_group_;
  bool indexed_ = false;
};

}  // namespace zcore
