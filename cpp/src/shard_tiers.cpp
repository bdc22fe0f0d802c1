#include "zcore/shard_tiers.h"

#include <algorithm>
#include <string>

#include "zcore/status.h"

namespace zcore {

const char* shard_tier_name(ShardTier tier) {
  switch (tier) {
    case ShardTier::kDevice: return "device";
    case ShardTier::kHost: return "host";
    case ShardTier::kNvme: return "nvme";
  }
  return "unknown";
}

const char* shard_state_name(ShardState state) {
  switch (state) {
    case ShardState::kResident: return "resident";
    case ShardState::kStored: return "stored";
    case ShardState::kFetching: return "fetching";
    case ShardState::kFetched: return "fetched";
    case ShardState::kStoring: return "storing";
  }
  return "unknown";
}

ShardTierTable::ShardTierTable(std::int64_t staging_bytes) : staging_bytes_(staging_bytes) {
  if (staging_bytes < 0) {
    throw Error(StatusCode::kInvalidArgument,
                "staging_bytes=" + std::to_string(staging_bytes) +
                    " must be >= 0 (0 when no shard is offloaded)",
                {{"key", std::string("staging_bytes")}, {"value", staging_bytes}});
  }
}

GroupId ShardTierTable::add(std::int64_t shard_bytes, ShardTier tier) {
  if (shard_bytes <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "a shard needs shard_bytes > 0, got " + std::to_string(shard_bytes),
                {{"shard_bytes", shard_bytes}});
  }
  const bool resident = tier == ShardTier::kDevice;
  shards_.push_back(
      Shard{shard_bytes, tier, resident ? ShardState::kResident : ShardState::kStored, 0});
  if (!resident) ++offloaded_groups_;
  return static_cast<GroupId>(shards_.size() - 1);
}

void ShardTierTable::check(GroupId group) const {
  if (group < 0 || static_cast<std::size_t>(group) >= shards_.size()) {
    throw Error(StatusCode::kInvalidHandle,
                "unknown parameter group " + std::to_string(group) + ": " +
                    std::to_string(shards_.size()) +
                    " groups are registered (ids 0 to size-1); use the id register_group returned",
                {{"group", group}, {"registered", static_cast<std::int64_t>(shards_.size())}});
  }
}

ShardTierTable::Shard& ShardTierTable::expect(GroupId group, ShardState from,
                                              const char* transition) {
  check(group);
  Shard& s = shards_[index(group)];
  if (s.state != from) {
    throw Error(StatusCode::kInvalidState,
                std::string("the shard of parameter group ") + std::to_string(group) + " (tier " +
                    shard_tier_name(s.tier) + ") cannot " + transition + ": it is " +
                    shard_state_name(s.state) + ", the transition starts from " +
                    shard_state_name(from),
                {{"group", group},
                 {"state", std::string(shard_state_name(s.state))},
                 {"expected", std::string(shard_state_name(from))}});
  }
  return s;
}

void ShardTierTable::start_fetch(GroupId group) {
  Shard& s = expect(group, ShardState::kStored, "start fetching");
  if (!staging_fits(staged_bytes_, s.bytes, staging_bytes_)) {
    throw Error(StatusCode::kInvalidState,
                "the shard of parameter group " + std::to_string(group) + " (" +
                    std::to_string(s.bytes) + " bytes) does not fit in staging: " +
                    std::to_string(staged_bytes_) + " of staging_bytes=" +
                    std::to_string(staging_bytes_) + " are staged; drop a staged shard first",
                {{"group", group},
                 {"shard_bytes", s.bytes},
                 {"staged_bytes", staged_bytes_},
                 {"staging_bytes", staging_bytes_}});
  }
  s.staged_slot = staged_.size();
  staged_.push_back(group);
  staged_bytes_ += s.bytes;
  stats_.peak_staged_bytes = std::max(stats_.peak_staged_bytes, staged_bytes_);
  ++stats_.fetches;
  stats_.bytes_fetched += s.bytes;
  ++fetches_in_flight_;
  s.state = ShardState::kFetching;
}

void ShardTierTable::finish_fetch(GroupId group) {
  Shard& s = expect(group, ShardState::kFetching, "finish fetching");
  --fetches_in_flight_;
  s.state = ShardState::kFetched;
}

void ShardTierTable::drop(GroupId group) {
  Shard& s = expect(group, ShardState::kFetched, "be dropped from staging");
  const GroupId moved = staged_.back();
  staged_[s.staged_slot] = moved;
  shards_[index(moved)].staged_slot = s.staged_slot;
  staged_.pop_back();
  staged_bytes_ -= s.bytes;
  s.state = ShardState::kStored;
}

void ShardTierTable::start_store(GroupId group) {
  Shard& s = expect(group, ShardState::kStored, "start storing");
  ++stats_.stores;
  stats_.bytes_stored += s.bytes;
  ++stores_in_flight_;
  s.state = ShardState::kStoring;
}

void ShardTierTable::finish_store(GroupId group) {
  Shard& s = expect(group, ShardState::kStoring, "finish storing");
  --stores_in_flight_;
  s.state = ShardState::kStored;
}

std::size_t FetchScheduler::schedule(const ExecutionTrace& trace, const ParamGroupTable& groups,
                                     const ShardTierTable& shards, const FetchRequest& request,
                                     std::vector<GroupId>* out) {
  out->clear();
  const std::size_t end = std::min(request.scan_to, trace.size());
  if (shards.offloaded_groups() == 0) return std::max(request.scan_from, end);
  if (taken_.size() < shards.size()) taken_.resize(shards.size(), 0);
  ++call_;
  std::int64_t staged = shards.staged_bytes();
  for (std::size_t use = request.scan_from; use < end; ++use) {
    const GroupId g = trace.at(use);
    const auto slot = static_cast<std::size_t>(g);
    if (!shards.offloaded(g) || groups.state(g) != GroupState::kSharded || shards.staged(g) ||
        taken_[slot] == call_) {
      continue;
    }
    const std::int64_t bytes = shards.shard_bytes(g);
    if (!staging_fits(staged, bytes, shards.staging_bytes())) return use;
    taken_[slot] = call_;
    staged += bytes;
    out->push_back(g);
  }
  return std::max(request.scan_from, end);
}

}  // namespace zcore
