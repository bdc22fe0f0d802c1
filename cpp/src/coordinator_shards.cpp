// ParamCoordinator's shard tiers (ZeRO-Infinity; "Shard tiers" in
// coordinator.h): which tier a registered shard gets, the plans that fetch
// offloaded shards into staging slots ahead of their all-gathers, drop them
// after, and write updated NVMe shards back. coordinator.cpp holds the gather
// state, the trace and the live budget, and calls in here where a gather
// needs its shard; the shard states themselves live in ShardTierTable.
#include "zcore/coordinator.h"

#include <algorithm>
#include <string>

#include "zcore/status.h"

namespace zcore {

ShardTier ParamCoordinator::tier_kept(ShardTier tier, std::int64_t shard_numel) {
  if (tier != ShardTier::kNvme) return tier;
  if (!nvme_spilled_ && nvme_kept_in_host_ + shard_numel <= config_.nvme_host_elements) {
    nvme_kept_in_host_ += shard_numel;
    return ShardTier::kHost;
  }
  nvme_spilled_ = true;  // as DeepSpeed: once a shard goes to NVMe, every later one does
  return ShardTier::kNvme;
}

const Plan& ParamCoordinator::store_shards(const std::vector<GroupId>& updated) {
  if (step_ != StepState::kIdle) {
    throw Error(StatusCode::kInvalidState,
                "store_shards() inside the step of trace key " + std::to_string(trace_key_) +
                    ": call it between steps, after end_step() and the optimizer step",
                {{"trace_key", trace_key_}});
  }
  std::vector<bool> listed(groups_.size(), false);
  for (GroupId g : updated) {  // all checked before any changes, so a misuse changes nothing
    groups_.check(g);
    if (listed[static_cast<std::size_t>(g)]) {
      throw Error(StatusCode::kInvalidArgument,
                  "store_shards: group " + std::to_string(g) +
                      " is listed twice; list each updated group once",
                  {{"group", g}});
    }
    listed[static_cast<std::size_t>(g)] = true;
  }
  plan_.clear();
  for (GroupId g : updated) {
    if (shards_.tier(g) != ShardTier::kNvme) continue;
    if (shards_.state(g) == ShardState::kStoring) emit_shard_stored(g);  // one write at a time
    emit_store(g);
  }
  return plan_;
}

const Plan& ParamCoordinator::finish_stores() {
  plan_.clear();
  for (std::size_t i = 0; i < shards_.size() && shards_.stores_in_flight() > 0; ++i) {
    const auto g = static_cast<GroupId>(i);
    if (shards_.state(g) == ShardState::kStoring) emit_shard_stored(g);
  }
  return plan_;
}

ShardTier ParamCoordinator::shard_tier(GroupId group) const {
  shards_.check(group);
  return shards_.tier(group);
}

ShardState ParamCoordinator::shard_state(GroupId group) const {
  shards_.check(group);
  return shards_.state(group);
}

bool ParamCoordinator::fetch_entering(const std::vector<GroupId>& entering) {
  bool all_staged = true;
  for (GroupId g : entering) {
    if (!shards_.offloaded(g) || groups_.state(g) != GroupState::kSharded || shards_.staged(g)) {
      continue;
    }
    if (shards_.can_fetch(g)) {
      emit_fetch(g, false);
    } else {
      all_staged = false;  // stage_for_gather makes room for it
    }
  }
  return all_staged;
}

void ParamCoordinator::fetch_ahead() {
  if (shards_.offloaded_groups() == 0) return;
  const FetchRequest request{std::max(fetch_frontier_, position_),
                             position_ + static_cast<std::size_t>(config_.fetch_horizon_uses)};
  fetch_frontier_ = fetcher_.schedule(slot_->trace, groups_, shards_, request, &fetches_);
  for (GroupId g : fetches_) emit_fetch(g, true);
}

void ParamCoordinator::stage_for_gather(GroupId group, const std::vector<GroupId>& entering) {
  if (!shards_.offloaded(group) || shards_.state(group) == ShardState::kFetched) return;
  if (shards_.state(group) != ShardState::kFetching) {
    make_staging_room(group, entering);
    emit_fetch(group, false);
  }
  emit_shard_ready(group);
}

bool ParamCoordinator::stage_for_prefetch(GroupId group) {
  if (!shards_.offloaded(group) || shards_.state(group) == ShardState::kFetched) return true;
  if (shards_.state(group) != ShardState::kFetching) {
    // A prefetch frees no slot: it waits until the uses before it free theirs.
    if (!shards_.can_fetch(group)) return false;
    emit_fetch(group, false);
  }
  emit_shard_ready(group);
  return true;
}

// Frees staging for a shard the module being entered needs, cheapest first:
// (0) shards fetched ahead for other groups, farthest next use first (they
// are fetched again later); (1) this module's all-gathers in flight (their
// wait is due anyway); (2) prefetched all-gathers in flight, nearest use
// first (likely arrived); (3) shards fetched ahead for this module's other
// groups. Staged shards are always of one of these kinds, so the loop ends
// with room at the latest when nothing is staged (staging_fits).
void ParamCoordinator::make_staging_room(GroupId group, const std::vector<GroupId>& entering) {
  if (shards_.can_fetch(group)) return;
  staged_victims_.clear();
  for (GroupId h : shards_.staged_groups()) {
    const bool own = std::find(entering.begin(), entering.end(), h) != entering.end();
    const std::size_t use = next_use(h);
    if (groups_.state(h) == GroupState::kSharded) {
      staged_victims_.push_back({own ? 3 : 0, ExecutionTrace::kNone - use, h});
    } else {
      staged_victims_.push_back({own ? 1 : 2, use, h});
    }
  }
  std::sort(staged_victims_.begin(), staged_victims_.end(), [](const auto& a, const auto& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    if (a.key != b.key) return a.key < b.key;
    return a.group < b.group;  // every rank computes the same plan
  });
  for (const StagedVictim& v : staged_victims_) {
    if (shards_.can_fetch(group)) return;
    if (groups_.state(v.group) == GroupState::kGathering) {
      emit_wait(v.group);  // drops its shard
      continue;
    }
    if (shards_.state(v.group) == ShardState::kFetching) emit_shard_ready(v.group);
    emit_drop(v.group);
  }
}

void ParamCoordinator::drain_shards(bool wait_stores) {
  if (shards_.offloaded_groups() == 0) return;
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    const auto g = static_cast<GroupId>(i);
    if (shards_.state(g) == ShardState::kFetching) emit_shard_ready(g);
    if (shards_.state(g) == ShardState::kFetched) emit_drop(g);
    if (wait_stores && shards_.state(g) == ShardState::kStoring) emit_shard_stored(g);
  }
}

void ParamCoordinator::emit_fetch(GroupId group, bool ahead) {
  if (shards_.state(group) == ShardState::kStoring) emit_shard_stored(group);
  shards_.start_fetch(group);
  plan_.push_back(Action{ActionKind::kFetchShard, group});
  if (ahead) ++stats_.shard_fetches_ahead;
}

void ParamCoordinator::emit_shard_ready(GroupId group) {
  shards_.finish_fetch(group);
  plan_.push_back(Action{ActionKind::kShardReady, group});
}

void ParamCoordinator::emit_drop(GroupId group) {
  const bool unused = groups_.state(group) == GroupState::kSharded;  // not all-gathered from it
  shards_.drop(group);
  plan_.push_back(Action{ActionKind::kDropShard, group});
  if (unused) {
    ++stats_.shard_fetches_unused;
    rewind_frontiers(group, false);
  }
}

void ParamCoordinator::emit_store(GroupId group) {
  shards_.start_store(group);
  plan_.push_back(Action{ActionKind::kStoreShard, group});
}

void ParamCoordinator::emit_shard_stored(GroupId group) {
  shards_.finish_store(group);
  plan_.push_back(Action{ActionKind::kShardStored, group});
}

}  // namespace zcore
