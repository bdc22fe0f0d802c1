// ParamCoordinator: registration, the gather plans, the trace and the live
// budget. The plans that move shards between tiers are in coordinator_shards.cpp.
#include "zcore/coordinator.h"

#include <algorithm>
#include <string>
#include <utility>

#include "zcore/status.h"

namespace zcore {

namespace {

bool contains(const std::vector<GroupId>& ids, GroupId id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

const std::vector<GroupId> kNoGroups;

const CoordinatorConfig& validated(const CoordinatorConfig& config) {
  const std::pair<const char*, std::int64_t> values[] = {
      {"prefetch_bucket_elements", config.prefetch_bucket_elements},
      {"max_live_elements", config.max_live_elements},
      {"max_reuse_distance", config.max_reuse_distance},
      {"persistence_threshold", config.persistence_threshold},
      {"resync_window", config.resync_window},
      {"staging_bytes", config.staging_bytes},
      {"fetch_horizon_uses", config.fetch_horizon_uses},
      {"nvme_host_elements", config.nvme_host_elements},
  };
  for (const auto& [name, value] : values) {
    if (value < 0) {
      throw Error(StatusCode::kInvalidArgument,
                  std::string("coordinator config ") + name + "=" + std::to_string(value) +
                      " must be >= 0 (0 disables what it bounds)",
                  {{"key", std::string(name)}, {"value", value}});
    }
  }
  return config;
}

}  // namespace

ParamCoordinator::ParamCoordinator(const CoordinatorConfig& config)
    : config_(validated(config)), shards_(config.staging_bytes) {}

GroupId ParamCoordinator::register_group(std::int64_t numel, std::int64_t element_size) {
  return register_group(numel, element_size, numel, ShardTier::kDevice);
}

GroupId ParamCoordinator::register_group(std::int64_t numel, std::int64_t element_size,
                                         std::int64_t shard_numel, ShardTier tier) {
  const bool persistent = numel < config_.persistence_threshold;
  // Everything is checked before either table changes, so a refused group leaves no trace.
  if (numel > 0 && element_size > 0 && (shard_numel <= 0 || shard_numel > numel)) {
    throw Error(StatusCode::kInvalidArgument,
                "register_group: shard_numel=" + std::to_string(shard_numel) +
                    " must be in [1, numel=" + std::to_string(numel) +
                    "]: the rank's shard of the group (numel / world size when padded)",
                {{"numel", numel}, {"shard_numel", shard_numel}});
  }
  if (persistent) tier = ShardTier::kDevice;  // it stays gathered and is refreshed from its shard
  const std::int64_t shard_bytes = shard_numel * element_size;
  if (tier != ShardTier::kDevice && shard_bytes > config_.staging_bytes) {
    throw Error(StatusCode::kInvalidArgument,
                std::string("register_group: a shard of ") + std::to_string(shard_bytes) +
                    " bytes on tier " + shard_tier_name(tier) +
                    " is staged on the device before its all-gather, but coordinator config "
                    "staging_bytes=" + std::to_string(config_.staging_bytes) +
                    "; set staging_bytes to at least the largest offloaded shard (" +
                    std::to_string(shard_bytes) + " bytes here), a few times that to fetch ahead",
                {{"key", std::string("staging_bytes")},
                 {"value", config_.staging_bytes},
                 {"needed", shard_bytes}});
  }
  const GroupId id = groups_.add(numel, element_size, persistent);
  shards_.add(shard_bytes, tier_kept(tier, shard_numel));
  return id;
}

ModuleId ParamCoordinator::register_module(const std::vector<GroupId>& groups) {
  for (std::size_t i = 0; i < groups.size(); ++i) {
    groups_.check(groups[i]);
    if (std::find(groups.begin(), groups.begin() + static_cast<std::ptrdiff_t>(i), groups[i]) !=
        groups.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw Error(StatusCode::kInvalidArgument,
                  "register_module: group " + std::to_string(groups[i]) +
                      " is listed twice; list each group a module needs once",
                  {{"group", groups[i]}});
    }
  }
  modules_.push_back(groups);
  return static_cast<ModuleId>(modules_.size() - 1);
}

const std::vector<GroupId>& ParamCoordinator::module(ModuleId module) const {
  if (module < 0 || static_cast<std::size_t>(module) >= modules_.size()) {
    throw Error(StatusCode::kInvalidHandle,
                "unknown module " + std::to_string(module) + ": " +
                    std::to_string(modules_.size()) +
                    " modules are registered; use the id register_module returned",
                {{"module", module}, {"registered", static_cast<std::int64_t>(modules_.size())}});
  }
  return modules_[static_cast<std::size_t>(module)];
}

const std::vector<GroupId>& ParamCoordinator::module_groups(ModuleId module) const {
  return this->module(module);
}

void ParamCoordinator::begin_step(std::int64_t trace_key) {
  if (step_ != StepState::kIdle) {
    throw Error(StatusCode::kInvalidState,
                "begin_step(" + std::to_string(trace_key) + ") inside the step of trace key " +
                    std::to_string(trace_key_) +
                    ": call end_step(), or abort_step() after an exception, first",
                {{"trace_key", trace_key}, {"current_trace_key", trace_key_}});
  }
  slot_ = &traces_[trace_key];
  trace_key_ = trace_key;
  recording_.clear();
  step_departed_ = false;
  position_ = 0;
  frontier_ = 0;
  fetch_frontier_ = 0;
  step_ = slot_->trace.empty() ? StepState::kRecording : StepState::kFollowing;
}

const Plan& ParamCoordinator::before_module(ModuleId module) {
  const std::vector<GroupId>& entering = this->module(module);
  plan_.clear();
  ++stats_.module_calls;
  if (step_ != StepState::kIdle) {
    for (GroupId g : entering) follow_trace(g);
  }
  for (GroupId g : entering) {
    switch (groups_.state(g)) {
      case GroupState::kSharded: ++stats_.prefetch_misses; break;
      case GroupState::kGathering: ++stats_.prefetch_hits; break;  // only prefetches stay in flight
      case GroupState::kGathered:
        ++(groups_.ahead_of_use(g) ? stats_.prefetch_hits : stats_.resident_hits);
        break;
      case GroupState::kInUse: ++stats_.resident_hits; break;
    }
    groups_.claim(g);  // no longer ahead of use: frees its share of the prefetch bucket
  }
  make_room(entering);
  // Shard reads are issued before the all-gathers and their waits, this
  // module's first, so that they overlap each other and the waits. Reads
  // ahead wait while this module lacks staging: they would take its slots.
  const bool entering_staged = fetch_entering(entering);
  if (step_ == StepState::kFollowing && entering_staged) fetch_ahead();
  for (GroupId g : entering) {
    if (groups_.state(g) != GroupState::kSharded) continue;
    stage_for_gather(g, entering);
    emit_gather(g, false);
  }
  // Prefetches are issued before waiting on this module's gathers so that
  // the communication stream never idles while the caller waits.
  if (step_ == StepState::kFollowing) prefetch(entering);
  for (GroupId g : entering) {
    if (groups_.state(g) == GroupState::kGathering) emit_wait(g);
  }
  for (GroupId g : entering) groups_.acquire(g);
  return plan_;
}

const Plan& ParamCoordinator::after_module(ModuleId module) {
  const std::vector<GroupId>& leaving = this->module(module);
  for (GroupId g : leaving) {  // all checked before any changes, so a misuse changes nothing
    if (groups_.state(g) != GroupState::kInUse) {
      throw Error(StatusCode::kInvalidState,
                  "after_module(" + std::to_string(module) + "): its group " + std::to_string(g) +
                      " is " + group_state_name(groups_.state(g)) +
                      ", not in use; call after_module once per before_module of the same module",
                  {{"module", module},
                   {"group", g},
                   {"state", std::string(group_state_name(groups_.state(g)))}});
    }
  }
  plan_.clear();
  for (GroupId g : leaving) groups_.unacquire(g);
  for (GroupId g : leaving) {
    if (!groups_.persistent(g) && groups_.state(g) == GroupState::kGathered &&
        !keep_after_use(g)) {
      emit_release(g);
    }
  }
  // Kept groups may now exceed the budget that the groups just left held open.
  const std::int64_t limit = live_limit(groups_.in_use_elements());
  if (groups_.live_elements() > limit) {
    evict(groups_.live_elements() - limit, 0, false, kNoGroups);
  }
  // A group released here is used again later: its read starts now rather
  // than in the plan whose prefetch gathers it.
  if (step_ == StepState::kFollowing) fetch_ahead();
  return plan_;
}

const Plan& ParamCoordinator::end_step() {
  if (step_ == StepState::kIdle) {
    throw Error(StatusCode::kInvalidState, "end_step() without begin_step()");
  }
  if (groups_.groups_in_use() > 0) {
    std::string in_use;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (groups_.state(static_cast<GroupId>(g)) == GroupState::kInUse) {
        in_use += (in_use.empty() ? "" : ", ") + std::to_string(g);
      }
    }
    throw Error(StatusCode::kInvalidState,
                "end_step() while groups " + in_use +
                    " are in use: a module was entered and not left; call after_module for "
                    "each before_module, or abort_step() after an exception",
                {{"groups_in_use", groups_.groups_in_use()}});
  }
  plan_.clear();
  if (step_ == StepState::kFollowing && position_ < slot_->trace.size()) {
    note_departure(slot_->trace.at(position_), -1);  // the step ended before its trace did
  }
  drain(false);
  drain_shards(true);
  finish_step();
  return plan_;
}

const Plan& ParamCoordinator::abort_step() {
  plan_.clear();
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (groups_.state(static_cast<GroupId>(g)) == GroupState::kInUse) {
      groups_.drop_users(static_cast<GroupId>(g));
    }
  }
  drain(false);
  drain_shards(true);
  if (step_ != StepState::kIdle) {
    ++stats_.aborted_steps;
    step_ = StepState::kIdle;
    slot_ = nullptr;
  }
  return plan_;
}

const Plan& ParamCoordinator::release_all() {
  if (step_ != StepState::kIdle || groups_.groups_in_use() > 0) {
    throw Error(StatusCode::kInvalidState,
                "release_all() inside a step or while a module runs: call it between steps",
                {{"groups_in_use", groups_.groups_in_use()}});
  }
  plan_.clear();
  drain(true);
  drain_shards(false);
  return plan_;
}

std::optional<TraceDeparture> ParamCoordinator::take_departure_notice() {
  std::optional<TraceDeparture> notice;
  notice.swap(notice_);
  return notice;
}

void ParamCoordinator::follow_trace(GroupId group) {
  recording_.append(group, groups_.numel(group));
  if (step_ == StepState::kRecording) return;
  const ExecutionTrace& trace = slot_->trace;
  if (step_ == StepState::kFollowing) {
    if (position_ < trace.size() && trace.at(position_) == group) {
      ++position_;
      frontier_ = std::max(frontier_, position_);
      return;
    }
    note_departure(position_ < trace.size() ? trace.at(position_) : -1, group);
  }
  // Resynchronise: a skipped stretch (a branch not taken) puts the group a
  // few uses ahead; an inserted module keeps it out of the trace and the
  // next use usually matches again at the same position.
  const std::size_t use = trace.next_use(group, position_);
  if (use != ExecutionTrace::kNone &&
      use - position_ <= static_cast<std::size_t>(config_.resync_window)) {
    position_ = use + 1;
    frontier_ = std::max(frontier_, position_);
    step_ = StepState::kFollowing;
    ++stats_.trace_resyncs;
  }
}

void ParamCoordinator::note_departure(GroupId expected, GroupId actual) {
  ++stats_.trace_departures;
  step_departed_ = true;
  step_ = StepState::kDeparted;
  if (slot_->notice_armed) {
    notice_ = TraceDeparture{trace_key_, stats_.steps, static_cast<std::int64_t>(position_),
                             expected, actual};
    slot_->notice_armed = false;
  }
}

std::int64_t ParamCoordinator::live_limit(std::int64_t mandatory) const {
  return std::max(config_.max_live_elements, mandatory);
}

void ParamCoordinator::make_room(const std::vector<GroupId>& entering) {
  std::int64_t mandatory = groups_.in_use_elements();
  std::int64_t incoming = 0;
  for (GroupId g : entering) {
    if (groups_.persistent(g)) continue;
    const GroupState s = groups_.state(g);
    if (s != GroupState::kInUse) mandatory += groups_.numel(g);
    if (s == GroupState::kSharded) incoming += groups_.numel(g);
  }
  const std::int64_t deficit = groups_.live_elements() + incoming - live_limit(mandatory);
  if (deficit > 0) evict(deficit, 0, false, entering);
}

void ParamCoordinator::prefetch(const std::vector<GroupId>& entering) {
  std::size_t scan_from = std::max(frontier_, position_);
  for (;;) {
    const PrefetchRequest request{scan_from, config_.prefetch_bucket_elements,
                                  groups_.ahead_elements(),
                                  config_.max_live_elements - groups_.live_elements()};
    const PrefetchResult result =
        scheduler_.schedule(slot_->trace, groups_, request, &candidates_);
    for (const PrefetchCandidate& c : candidates_) {
      if (!stage_for_prefetch(c.group)) {
        frontier_ = c.use;  // the uses before it are gathered, in flight or taken
        return;
      }
      emit_gather(c.group, true);
    }
    frontier_ = result.frontier;
    if (!result.blocked) return;
    // Displace groups used later than the blocked candidate (Belady's rule);
    // give up when they would not free enough.
    const std::int64_t deficit = groups_.numel(result.blocker.group) -
                                 (config_.max_live_elements - groups_.live_elements());
    if (!evict(deficit, result.blocker.use + 1, true, entering)) return;
    scan_from = result.frontier;
  }
}

bool ParamCoordinator::evict(std::int64_t deficit, std::size_t min_next_use,
                             bool all_or_nothing, const std::vector<GroupId>& keep) {
  victims_.clear();
  std::int64_t available = 0;
  for (GroupId g : groups_.live_groups()) {
    if (groups_.state(g) == GroupState::kInUse || contains(keep, g)) continue;
    const std::size_t use = next_use(g);
    if (use < min_next_use) continue;
    victims_.emplace_back(use, g);
    available += groups_.numel(g);
  }
  if (all_or_nothing && available < deficit) return false;
  // Farthest next use first; among equals, those already arrived (no wait),
  // then by id, so that every rank computes the same plan.
  std::sort(victims_.begin(), victims_.end(), [this](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    const bool a_arrived = groups_.state(a.second) == GroupState::kGathered;
    const bool b_arrived = groups_.state(b.second) == GroupState::kGathered;
    if (a_arrived != b_arrived) return a_arrived;
    return a.second < b.second;
  });
  for (const auto& [use, g] : victims_) {
    if (deficit <= 0) break;
    if (groups_.state(g) == GroupState::kGathering) emit_wait(g);
    deficit -= groups_.numel(g);
    emit_release(g);
  }
  return deficit <= 0;
}

std::size_t ParamCoordinator::next_use(GroupId group) const {
  if (step_ != StepState::kFollowing) return ExecutionTrace::kNone;  // unknown: treat as never
  return slot_->trace.next_use(group, position_);
}

bool ParamCoordinator::keep_after_use(GroupId group) const {
  const std::size_t use = next_use(group);
  return use != ExecutionTrace::kNone &&
         slot_->trace.elements_between(position_, use) <= config_.max_reuse_distance;
}

void ParamCoordinator::rewind_frontiers(GroupId group, bool gather) {
  if (step_ != StepState::kFollowing && step_ != StepState::kDeparted) return;
  // Keep the frontiers' invariants (prefetch.h, shard_tiers.h): the group's
  // next use needs a gather (or a fetch) again. next_use is >= position, or kNone.
  const std::size_t use = slot_->trace.next_use(group, position_);
  if (gather) frontier_ = std::min(frontier_, use);
  if (shards_.offloaded(group)) fetch_frontier_ = std::min(fetch_frontier_, use);
}

void ParamCoordinator::drain(bool release_persistent) {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    const auto g = static_cast<GroupId>(i);
    if (groups_.state(g) == GroupState::kGathering) emit_wait(g);
    if (groups_.state(g) == GroupState::kGathered &&
        (release_persistent || !groups_.persistent(g))) {
      emit_release(g);
    }
  }
}

void ParamCoordinator::finish_step() {
  if (step_ == StepState::kRecording || step_departed_) {
    std::swap(slot_->trace, recording_);
    slot_->trace.build_index();
    if (!slot_->trace.empty()) ++stats_.trace_recordings;
  } else {
    slot_->notice_armed = true;  // followed the whole trace: the next departure is news
  }
  ++stats_.steps;
  step_ = StepState::kIdle;
  slot_ = nullptr;
}

void ParamCoordinator::emit_gather(GroupId group, bool ahead_of_use) {
  groups_.start_gather(group, ahead_of_use);
  plan_.push_back(Action{ActionKind::kGather, group});
  const std::int64_t numel = groups_.numel(group);
  ++stats_.gathers;
  stats_.elements_gathered += numel;
  stats_.bytes_gathered += numel * groups_.element_size(group);
  if (ahead_of_use) ++stats_.prefetch_gathers;
  stats_.peak_live_elements = std::max(stats_.peak_live_elements, groups_.live_elements());
}

void ParamCoordinator::emit_wait(GroupId group) {
  groups_.finish_gather(group);
  plan_.push_back(Action{ActionKind::kWait, group});
  // The all-gather has read the staged shard: its slot goes back at once.
  if (shards_.offloaded(group)) emit_drop(group);
}

void ParamCoordinator::emit_release(GroupId group) {
  if (groups_.ahead_of_use(group)) ++stats_.prefetch_unused;
  rewind_frontiers(group, true);
  groups_.release(group);
  plan_.push_back(Action{ActionKind::kRelease, group});
  ++stats_.releases;
}

bool ParamCoordinator::unforeseen(ModuleId module) const {
  const std::vector<GroupId>& entering = this->module(module);
  if (step_ == StepState::kIdle) return false;
  if (step_ != StepState::kFollowing) return true;
  // follow_trace matches the groups one by one at consecutive positions.
  const ExecutionTrace& trace = slot_->trace;
  for (std::size_t i = 0; i < entering.size(); ++i) {
    if (position_ + i >= trace.size() || trace.at(position_ + i) != entering[i]) return true;
  }
  return false;
}

GroupState ParamCoordinator::state(GroupId group) const {
  groups_.check(group);
  return groups_.state(group);
}

std::int64_t ParamCoordinator::use_count(GroupId group) const {
  groups_.check(group);
  return groups_.use_count(group);
}

bool ParamCoordinator::persistent(GroupId group) const {
  groups_.check(group);
  return groups_.persistent(group);
}

std::vector<GroupId> ParamCoordinator::trace(std::int64_t trace_key) const {
  const auto it = traces_.find(trace_key);
  return it == traces_.end() ? std::vector<GroupId>{} : it->second.trace.uses();
}

CoordinatorStats ParamCoordinator::stats() const {
  CoordinatorStats s = stats_;
  s.live_elements = groups_.live_elements();
  s.persistent_elements = groups_.persistent_gathered_elements();
  const ShardTierStats t = shards_.stats();
  s.shard_fetches = t.fetches;
  s.shard_bytes_fetched = t.bytes_fetched;
  s.shard_stores = t.stores;
  s.shard_bytes_stored = t.bytes_stored;
  s.staged_bytes = shards_.staged_bytes();
  s.peak_staged_bytes = t.peak_staged_bytes;
  return s;
}

void ParamCoordinator::reset_peak() {
  stats_.peak_live_elements = groups_.live_elements();
  shards_.reset_peak();
}

}  // namespace zcore
