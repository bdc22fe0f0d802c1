#include "zcore/trace.h"

#include <algorithm>

namespace zcore {

void ExecutionTrace::clear() {
  uses_.clear();
  prefix_.resize(1);
  row_start_.clear();
  by_group_.clear();
  indexed_ = false;
}

void ExecutionTrace::append(GroupId group, std::int64_t numel) {
  uses_.push_back(group);
  prefix_.push_back(prefix_.back() + numel);
  indexed_ = false;
}

void ExecutionTrace::build_index() {
  GroupId max_group = -1;
  for (GroupId g : uses_) max_group = std::max(max_group, g);
  const std::size_t rows = static_cast<std::size_t>(max_group + 1);
  // Counting sort by group; uses are visited in order, so each row ascends.
  row_start_.assign(rows + 1, 0);
  for (GroupId g : uses_) ++row_start_[static_cast<std::size_t>(g) + 1];
  for (std::size_t r = 0; r < rows; ++r) row_start_[r + 1] += row_start_[r];
  by_group_.resize(uses_.size());
  std::vector<std::size_t> fill(row_start_.begin(), row_start_.end() - 1);
  for (std::size_t use = 0; use < uses_.size(); ++use) {
    by_group_[fill[static_cast<std::size_t>(uses_[use])]++] = use;
  }
  indexed_ = true;
}

std::size_t ExecutionTrace::next_use(GroupId group, std::size_t from) const {
  if (!indexed_ || group < 0 || static_cast<std::size_t>(group) + 1 >= row_start_.size()) {
    return kNone;
  }
  const auto first = by_group_.begin() + static_cast<std::ptrdiff_t>(row_start_[group]);
  const auto last = by_group_.begin() + static_cast<std::ptrdiff_t>(row_start_[group + 1]);
  const auto it = std::lower_bound(first, last, from);
  return it == last ? kNone : *it;
}

}  // namespace zcore
