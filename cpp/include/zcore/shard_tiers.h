// Where each parameter group's shard lives at rest (device, host, NVMe) and
// what is happening to it, orthogonal to the gather state in ParamGroupTable.
//
// A group on the device tier keeps its shard on the compute device for good:
// the all-gather reads it in place, as plain ZeRO-3 does. A group offloaded
// to host memory or NVMe has its shard copied (host) or read (NVMe) into a
// staging slot on the device before it can be all-gathered; the slot is
// returned once the all-gather has been waited. Staging slots are device
// memory, so their total is a budget in bytes (staging_bytes): a shard counts
// against it from the start of its fetch until it is dropped.
//
// ShardTierTable is the only owner of every group's shard state and of the
// staged-byte total; ParamCoordinator drives it. FetchScheduler is the walk
// along the trace that picks the shards to read ahead of their all-gather.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zcore/param_groups.h"
#include "zcore/trace.h"

namespace zcore {

enum class ShardTier : std::uint8_t {
  kDevice,  // on the compute device for good; the all-gather reads it in place
  kHost,    // in host memory; copied into a device staging slot to be all-gathered
  kNvme,    // on NVMe; read into a staging slot to be all-gathered, written back after updates
};

enum class ShardState : std::uint8_t {
  kResident,  // tier kDevice: always usable, never staged
  kStored,    // only in its tier
  kFetching,  // a copy/read into a staging slot is in flight, not yet waited
  kFetched,   // in a staging slot, usable as the all-gather's input
  kStoring,   // an updated shard is being written back to its tier, not yet waited
};

const char* shard_tier_name(ShardTier tier);
const char* shard_state_name(ShardState state);

// The staging rule, shared by the table and the fetch walk: a shard fits when
// the staged bytes plus its own stay within the budget, or when nothing is
// staged (so that one shard larger than the budget can still be fetched
// alone, like a group larger than the prefetch bucket; see prefetch.h).
inline bool staging_fits(std::int64_t staged, std::int64_t bytes, std::int64_t budget) {
  return staged == 0 || staged + bytes <= budget;
}

struct ShardTierStats {
  std::int64_t fetches;        // start_fetch() calls
  std::int64_t bytes_fetched;
  std::int64_t stores;         // start_store() calls
  std::int64_t bytes_stored;
  std::int64_t peak_staged_bytes;  // since construction or reset_peak()
};

class ShardTierTable {
 public:
  // Throws Error(kInvalidArgument) for staging_bytes < 0.
  explicit ShardTierTable(std::int64_t staging_bytes);

  // One entry per group, in the groups' id order: shard_bytes > 0 (the rank's
  // shard, shard_numel times element_size). kDevice starts kResident, the
  // other tiers kStored (the caller puts the shard there at construction).
  GroupId add(std::int64_t shard_bytes, ShardTier tier);

  std::size_t size() const { return shards_.size(); }
  // Throws Error(kInvalidHandle) naming the id and the registered range.
  void check(GroupId group) const;

  // Transitions. Each checks the state it starts from, throws
  // Error(kInvalidState) naming the group and both states otherwise, and sets
  // the new state last.
  // kStored -> kFetching; takes staging: refused (kInvalidState) unless can_fetch.
  void start_fetch(GroupId group);
  void finish_fetch(GroupId group);  // kFetching -> kFetched
  void drop(GroupId group);          // kFetched -> kStored; returns its staging
  void start_store(GroupId group);   // kStored -> kStoring (the coordinator stores kNvme only)
  void finish_store(GroupId group);  // kStoring -> kStored

  // Whether the group's shard fits in the staging budget now (staging_fits).
  bool can_fetch(GroupId group) const {
    return staging_fits(staged_bytes_, shard_bytes(group), staging_bytes_);
  }

  // Queries take an id that check() accepts (see ParamGroupTable).
  ShardTier tier(GroupId group) const { return shards_[index(group)].tier; }
  ShardState state(GroupId group) const { return shards_[index(group)].state; }
  std::int64_t shard_bytes(GroupId group) const { return shards_[index(group)].bytes; }
  bool offloaded(GroupId group) const { return tier(group) != ShardTier::kDevice; }
  // In a staging slot or on its way there.
  bool staged(GroupId group) const {
    const ShardState s = state(group);
    return s == ShardState::kFetching || s == ShardState::kFetched;
  }

  std::int64_t staging_bytes() const { return staging_bytes_; }
  std::int64_t staged_bytes() const { return staged_bytes_; }
  std::int64_t offloaded_groups() const { return offloaded_groups_; }
  std::int64_t fetches_in_flight() const { return fetches_in_flight_; }
  std::int64_t stores_in_flight() const { return stores_in_flight_; }
  // Groups whose shard is kFetching or kFetched, in no particular order.
  const std::vector<GroupId>& staged_groups() const { return staged_; }

  ShardTierStats stats() const { return stats_; }
  void reset_peak() { stats_.peak_staged_bytes = staged_bytes_; }

 private:
  struct Shard {
    std::int64_t bytes;
    ShardTier tier;
    ShardState state;
    std::size_t staged_slot;  // index in staged_ while staged
  };

  static std::size_t index(GroupId group) { return static_cast<std::size_t>(group); }
  Shard& expect(GroupId group, ShardState from, const char* transition);

  std::int64_t staging_bytes_;
  std::vector<Shard> shards_;
  std::vector<GroupId> staged_;
  std::int64_t staged_bytes_ = 0;
  std::int64_t offloaded_groups_ = 0;
  std::int64_t fetches_in_flight_ = 0;
  std::int64_t stores_in_flight_ = 0;
  ShardTierStats stats_{};
};

// Which shards to start fetching now, walking the trace ahead of the
// all-gather prefetch. Policy:
// - Examine the uses [scan_from, scan_to); scan_to is the position plus the
//   fetch horizon. A use is a candidate when its group is offloaded, sharded
//   (a group gathered, in flight or in use does not need its shard), and its
//   shard is not staged (kStored, or kStoring: its write is waited first).
//   A group used several times is fetched once, for its first use.
// - Candidates are taken in trace order while they fit the staging budget
//   (staging_fits). The walk stops at the first that does not fit: a later,
//   smaller shard would spend staging that the earlier use needs first.
// The frontier makes repeated calls cheap, as in prefetch.h: every use in
// [position, frontier) was examined and needs no fetch, or was fetched. The
// coordinator moves it back when a group becomes a candidate again (a group
// released, a staged shard dropped before its use).
struct FetchRequest {
  std::size_t scan_from;  // the fetch frontier
  std::size_t scan_to;    // first use beyond the horizon (at most the trace size)
};

class FetchScheduler {
 public:
  // Replaces `out` with the groups to fetch now, in trace order; returns the
  // new frontier (the first use not examined).
  std::size_t schedule(const ExecutionTrace& trace, const ParamGroupTable& groups,
                       const ShardTierTable& shards, const FetchRequest& request,
                       std::vector<GroupId>* out);

 private:
  // Marks groups taken in the current call: taken_[g] == call_ (no clearing per call).
  std::vector<std::uint64_t> taken_;
  std::uint64_t call_ = 0;
};

}  // namespace zcore
