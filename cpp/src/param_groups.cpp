#include "zcore/param_groups.h"

#include <string>

#include "zcore/status.h"

namespace zcore {

const char* group_state_name(GroupState state) {
  switch (state) {
    case GroupState::kSharded: return "sharded";
    case GroupState::kGathering: return "gathering";
    case GroupState::kGathered: return "gathered";
    case GroupState::kInUse: return "in use";
  }
  return "unknown";
}

GroupId ParamGroupTable::add(std::int64_t numel, std::int64_t element_size, bool persistent) {
  if (numel <= 0 || element_size <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "a parameter group needs numel > 0 and element_size > 0, got numel=" +
                    std::to_string(numel) + " element_size=" + std::to_string(element_size) +
                    "; groups without parameters need no gathering, so do not register them",
                {{"numel", numel}, {"element_size", element_size}});
  }
  groups_.push_back(Group{numel, element_size, persistent, false, GroupState::kSharded, 0, 0});
  return static_cast<GroupId>(groups_.size() - 1);
}

void ParamGroupTable::check(GroupId group) const {
  if (group < 0 || static_cast<std::size_t>(group) >= groups_.size()) {
    throw Error(StatusCode::kInvalidHandle,
                "unknown parameter group " + std::to_string(group) + ": " +
                    std::to_string(groups_.size()) +
                    " groups are registered (ids 0 to size-1); use the id register_group returned",
                {{"group", group}, {"registered", static_cast<std::int64_t>(groups_.size())}});
  }
}

ParamGroupTable::Group& ParamGroupTable::expect(GroupId group, GroupState from,
                                                const char* transition) {
  check(group);
  Group& g = groups_[index(group)];
  if (g.state != from) {
    throw Error(StatusCode::kInvalidState,
                std::string("parameter group ") + std::to_string(group) + " cannot " + transition +
                    ": it is " + group_state_name(g.state) + ", the transition starts from " +
                    group_state_name(from),
                {{"group", group},
                 {"state", std::string(group_state_name(g.state))},
                 {"expected", std::string(group_state_name(from))}});
  }
  return g;
}

void ParamGroupTable::clear_ahead(Group& g) {
  if (!g.ahead) return;
  ahead_elements_ -= g.numel;
  g.ahead = false;
}

void ParamGroupTable::start_gather(GroupId group, bool ahead_of_use) {
  Group& g = expect(group, GroupState::kSharded, "start gathering");
  if (g.persistent) {
    persistent_elements_ += g.numel;
  } else {
    g.live_slot = live_.size();
    live_.push_back(group);
    live_elements_ += g.numel;
  }
  if (ahead_of_use) ahead_elements_ += g.numel;
  g.ahead = ahead_of_use;
  ++groups_in_flight_;
  g.state = GroupState::kGathering;
}

void ParamGroupTable::finish_gather(GroupId group) {
  Group& g = expect(group, GroupState::kGathering, "finish gathering");
  --groups_in_flight_;
  g.state = GroupState::kGathered;
}

void ParamGroupTable::acquire(GroupId group) {
  check(group);
  Group& g = groups_[index(group)];
  if (g.state == GroupState::kInUse) {
    ++g.users;  // re-entered: a module called again inside itself, or a group shared by nested modules
    return;
  }
  expect(group, GroupState::kGathered, "be used by a module");
  clear_ahead(g);
  if (!g.persistent) in_use_elements_ += g.numel;
  ++groups_in_use_;
  g.users = 1;
  g.state = GroupState::kInUse;
}

void ParamGroupTable::unacquire(GroupId group) {
  Group& g = expect(group, GroupState::kInUse, "be left by a module");
  if (--g.users > 0) return;
  if (!g.persistent) in_use_elements_ -= g.numel;
  --groups_in_use_;
  g.state = GroupState::kGathered;
}

void ParamGroupTable::drop_users(GroupId group) {
  Group& g = expect(group, GroupState::kInUse, "drop its users");
  if (!g.persistent) in_use_elements_ -= g.numel;
  --groups_in_use_;
  g.users = 0;
  g.state = GroupState::kGathered;
}

void ParamGroupTable::release(GroupId group) {
  Group& g = expect(group, GroupState::kGathered, "be released");
  clear_ahead(g);
  if (g.persistent) {
    persistent_elements_ -= g.numel;
  } else {
    const GroupId moved = live_.back();
    live_[g.live_slot] = moved;
    groups_[index(moved)].live_slot = g.live_slot;
    live_.pop_back();
    live_elements_ -= g.numel;
  }
  g.state = GroupState::kSharded;
}

}  // namespace zcore
