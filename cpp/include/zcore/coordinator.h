// ZeRO-3 parameter coordinator: decides, at each module, which parameter
// groups to gather (the module's own and the prefetch), which to wait for,
// and which to release, and, for groups whose shard is offloaded to host
// memory or NVMe (ZeRO-Infinity), when to fetch the shard into a staging slot
// and when to write an updated shard back; the Python layer executes its plans.
//
// Calling protocol (the Python hooks follow it; see also "Plan" below):
//
//   at construction:
//     g = register_group(numel, element_size)     one per parameter group, shard on the device;
//     g = register_group(numel, element_size,     or with its shard on another tier
//                        shard_numel, tier)       (see "Shard tiers" below)
//     m = register_module([g, ...])               one per module with parameters, and one
//                                                 per extra use site (parameters used outside
//                                                 their module, GatheredParameters)
//   each step (forward and backward are one trace: backward continues it):
//     begin_step(trace_key)                       e.g. 0 training, 1 eval forward, 2 generation
//     execute(before_module(m))                   forward pre-hook / backward pre-hook
//     ... the module runs ...
//     execute(after_module(m))                    forward post-hook / backward post-hook
//     execute(end_step())                         after backward (or after a no_grad forward)
//     optimizer step on the shards, then refresh persistent groups (see below)
//     execute(store_shards(updated))              the NVMe shards the optimizer changed
//   after an exception inside a step:
//     execute(abort_step())
//   once in a while (e.g. each step):
//     if (d = take_departure_notice()) log it      at most once per stretch of departures
//   before a checkpoint or shutdown:
//     execute(finish_stores())                    waits every shard write in flight
//
// A Plan is a list of actions to execute in the order given, before the next
// call into the coordinator:
//   kGather  g: take a buffer for g's full parameters and start one async
//               all-gather of g's shard into it (on the communication stream)
//   kWait    g: wait for g's all-gather (the parameters become usable)
//   kRelease g: g is not needed: point its parameters away from the buffer
//               and return the buffer (g is never in flight when released)
// and, only for groups whose shard is offloaded (never for tier kDevice):
//   kFetchShard  g: take a staging slot of g's shard bytes and start copying
//                   (host) or reading (NVMe) g's shard into it
//   kShardReady  g: wait for that copy/read (the slot is the all-gather's input)
//   kDropShard   g: g's staged shard is no longer needed: return its slot
//   kStoreShard  g: start writing g's updated shard (as the optimizer left
//                   it) to its tier
//   kShardStored g: wait for that write
// The coordinator applies each action's state transition when it issues the
// plan (so plans cost one native call per hook), which is why the caller must
// execute every action. Every rank issues the same calls and gets the same
// plans, so the all-gathers are issued in the same order on every rank; a
// rank whose modules run in a different order than the others' would hang
// the collectives, whatever the coordinator does.
//
// Guarantees, for a caller that executes every plan:
// - when before_module(m) returns, every group of m is gathered (after its
//   kWait) and stays so until the matching after_module(m) (re-entrant: a
//   module entered again while running, or groups shared by nested modules,
//   are counted, not gathered twice);
// - a group in use is never released; a group in flight is waited before it
//   is released, and no group is in flight after end_step();
// - live elements (non-persistent groups gathered or in flight) never exceed
//   max_live_elements, except while the groups in use plus those of the
//   module being entered alone exceed it; then nothing else is live;
// - all-gathers started ahead of use stay within prefetch_bucket_elements
//   (one group larger than the bucket may be prefetched alone);
// - with every group on tier kDevice, plans hold no shard action and are
//   exactly those of a coordinator without shard tiers.
// and, for offloaded groups:
// - a kGather of g follows g's kFetchShard (in the same or an earlier plan)
//   and, in the same plan, g's kShardReady; a kFetchShard of g follows the
//   kShardStored of any write of g in flight;
// - g's kWait is followed at once by g's kDropShard: a slot is held from the
//   fetch until the all-gather reading it has been waited, no longer;
// - staged bytes (shards fetching or fetched) never exceed staging_bytes;
// - a shard fetched ahead and not all-gathered is waited (kShardReady) and
//   dropped: when its slot is needed, and at the latest by end_step(),
//   abort_step() and release_all(); no shard is staged, and no fetch or write
//   is in flight, after end_step() or abort_step() (release_all() leaves
//   writes in flight: finish_stores() waits them);
// - before_module never drops a shard to fetch another unless the shards
//   staged leave no room; it then drops shards fetched ahead for later uses
//   (farthest use first), then waits all-gathers in flight to free theirs.
//
// Persistent groups (numel < persistence_threshold) stay gathered once
// gathered, across steps. The optimizer changes their shards, so after each
// optimizer step the caller either re-gathers them in place (one coalesced
// all-gather; their state does not change) or executes release_all() so that
// they are gathered again on first use.
//
// Shard tiers (ZeRO-Infinity). Each group's shard lives on the device (the
// default: nothing changes), in host memory or on NVMe (shard_tiers.h). An
// offloaded shard is fetched into a device staging slot before its
// all-gather and dropped after it; staging_bytes bounds the slots. While a
// step follows its trace, shards are fetched ahead along it, up to
// fetch_horizon_uses uses past the position and within staging_bytes, so that
// the all-gather prefetch finds its shards already fetched. Recording,
// departed, or outside a step, a shard is fetched on demand, right before its
// all-gather. Host shards are updated in place by the optimizer, so only NVMe
// shards are written back: store_shards() between steps starts the writes,
// and a later fetch of a shard being written waits for its write first.
// Persistent groups stay gathered (and the caller refreshes them from their
// shards after each optimizer step), so their shard always lives on the
// device, whatever tier is asked; shard_tier() tells the tier in effect.
// Every rank registers the same tiers and gets the same plans, so fetches and
// stores, like the all-gathers, come in the same order on every rank.
//
// Trace: the first step of a trace_key records the order of group uses; the
// following steps follow it to prefetch and to keep groups whose next use is
// near. When a group comes that the trace did not predict, the step is said
// to depart: the coordinator gathers on demand (correct, without prefetch),
// looks for the group up to resync_window uses ahead and continues from
// there if it is found, and at the end of the step adopts what it recorded
// as the new trace. Departures are counted in the statistics and notified
// once: take_departure_notice() returns the first departure after a step
// that followed its trace, and nothing more until the trace is followed for
// a whole step again.
//
// Outside a step, before_module/after_module still work (no trace, no
// prefetch, release at exit): for GatheredParameters or a forward outside
// the engine. end_step() requires every module entered, inside the step or
// before it, to have been left: a missing after_module would otherwise hold
// gathered memory for good.
//
// Not thread-safe: one caller at a time (the Python bindings keep the GIL).
// Errors: Error(kInvalidHandle) for unknown group or module ids,
// Error(kInvalidState) for calls out of protocol (after_module without
// before_module, begin_step inside a step, end_step while a module runs,
// store_shards inside a step), Error(kInvalidArgument) for bad sizes or config
// values (an offloaded shard larger than staging_bytes included).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "zcore/param_groups.h"
#include "zcore/prefetch.h"
#include "zcore/shard_tiers.h"
#include "zcore/trace.h"

namespace zcore {

using ModuleId = std::int64_t;  // dense: 0, 1, ... in registration order

// Sizes are in parameter elements, as DeepSpeed's stage3_* keys are, except staging_bytes.
struct CoordinatorConfig {
  std::int64_t prefetch_bucket_elements = 50'000'000;  // stage3_prefetch_bucket_size; 0: no prefetch
  std::int64_t max_live_elements = 1'000'000'000;      // stage3_max_live_parameters
  // stage3_max_reuse_distance: a group whose next use comes within this many
  // elements of other uses stays gathered (within the live budget); 0 keeps
  // only groups used again immediately.
  std::int64_t max_reuse_distance = 1'000'000'000;
  std::int64_t persistence_threshold = 100'000;  // stage3_param_persistence_threshold
  std::int64_t resync_window = 64;  // trace uses searched ahead after a departure
  // Bytes of device staging slots for offloaded shards fetched (or being
  // fetched) and not yet dropped; 0 is allowed only while no group is
  // offloaded: register_group needs at least the largest offloaded shard.
  // DeepSpeed's analogue: offload_param buffer_count times buffer_size.
  std::int64_t staging_bytes = 0;
  // How many trace uses past the position shard fetches may start. Set it
  // above the uses that the prefetch bucket spans: the all-gather prefetch
  // fetches the shards it reaches beyond it just before their all-gather (a
  // wait). In practice staging_bytes binds first; the horizon stops reads
  // from running far ahead when staging is plentiful, where they would hold
  // slots longest and be the first wasted at a departure. DeepSpeed walks
  // its queue past the parameters being all-gathered up to twice the
  // elements in flight, within its free swap-in buffers; 0: no fetch ahead.
  std::int64_t fetch_horizon_uses = 64;
  // Elements of shards registered on tier NVMe that stay in host memory
  // instead: the groups registered first, up to the first that would take
  // the total past it (DeepSpeed's offload_param.max_in_cpu); 0: all on NVMe.
  std::int64_t nvme_host_elements = 0;
};

// The first three keep their values: plans of device-only groups hold only them.
enum class ActionKind : std::uint8_t {
  kGather,
  kWait,
  kRelease,
  kFetchShard,
  kShardReady,
  kDropShard,
  kStoreShard,
  kShardStored,
};

struct Action {
  ActionKind kind;
  GroupId group;
};

using Plan = std::vector<Action>;

struct TraceDeparture {
  std::int64_t trace_key;
  std::int64_t step;      // steps completed before the one that departed
  std::int64_t position;  // trace use index where execution left the trace
  GroupId expected;       // group the trace predicted; -1 when the trace had ended
  GroupId actual;         // group that came; -1 when the step ended before the trace did
};

struct CoordinatorStats {
  std::int64_t steps;                // completed end_step() calls
  std::int64_t aborted_steps;
  std::int64_t module_calls;         // before_module() calls
  std::int64_t gathers;              // kGather actions issued
  std::int64_t elements_gathered;
  std::int64_t bytes_gathered;       // elements times each group's element_size
  std::int64_t prefetch_gathers;     // of the gathers, those started ahead of use
  std::int64_t prefetch_hits;        // uses whose group had been prefetched (arrived or in flight)
  std::int64_t prefetch_misses;      // uses whose group was sharded: gathered on demand
  std::int64_t resident_hits;        // uses whose group was still gathered (persistent, kept, in use)
  std::int64_t prefetch_unused;      // prefetched groups released without being used
  std::int64_t releases;             // kRelease actions issued
  std::int64_t trace_departures;     // times execution left the trace (or ended before it)
  std::int64_t trace_resyncs;        // times it found its place in the trace again
  std::int64_t trace_recordings;     // traces adopted: first recordings and re-recordings
  std::int64_t live_elements;        // now
  std::int64_t peak_live_elements;   // since construction or reset_peak()
  std::int64_t persistent_elements;  // persistent groups gathered or in flight now
  std::int64_t shard_fetches;        // kFetchShard actions issued
  std::int64_t shard_bytes_fetched;
  std::int64_t shard_fetches_ahead;  // of the fetches, those issued ahead of the all-gather prefetch
  std::int64_t shard_fetches_unused;  // shards dropped without being all-gathered
  std::int64_t shard_stores;         // kStoreShard actions issued
  std::int64_t shard_bytes_stored;
  std::int64_t staged_bytes;         // now
  std::int64_t peak_staged_bytes;    // since construction or reset_peak()
};

class ParamCoordinator {
 public:
  // Throws Error(kInvalidArgument) naming the first negative config value.
  explicit ParamCoordinator(const CoordinatorConfig& config);

  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // A group of numel elements of element_size bytes each when gathered;
  // persistent when numel < persistence_threshold. Its shard is on the device.
  GroupId register_group(std::int64_t numel, std::int64_t element_size);
  // The same with the rank's shard of shard_numel elements (0 < shard_numel
  // <= numel; numel / world size for padded groups) on `tier`. Persistent
  // groups keep their shard on the device whatever the tier asked; NVMe
  // shards within nvme_host_elements stay in host memory. Throws
  // Error(kInvalidArgument) when an offloaded shard exceeds staging_bytes.
  GroupId register_group(std::int64_t numel, std::int64_t element_size,
                         std::int64_t shard_numel, ShardTier tier);
  // A module (or use site) that needs `groups` gathered while it runs; the
  // ids must be registered and distinct (an empty list is allowed).
  ModuleId register_module(const std::vector<GroupId>& groups);

  void begin_step(std::int64_t trace_key);
  // The returned plans stay valid until the next call.
  const Plan& before_module(ModuleId module);
  const Plan& after_module(ModuleId module);
  const Plan& end_step();
  // Ends the step (if any) without adopting its recording, forgets all users
  // and releases every non-persistent group (waiting those in flight).
  const Plan& abort_step();
  // Outside a step with no module running: releases every group, persistent
  // ones included (waiting those in flight).
  const Plan& release_all();
  // Between steps, after the optimizer step: starts writing back the shards
  // of `updated` (distinct ids, in the order given) that live on NVMe,
  // waiting a write still in flight for the same shard first. Other tiers
  // need no write: the optimizer updates device and host shards in place.
  // Throws Error(kInvalidState) inside a step.
  const Plan& store_shards(const std::vector<GroupId>& updated);
  // Waits every shard write in flight (before a checkpoint or shutdown). Any time.
  const Plan& finish_stores();

  std::optional<TraceDeparture> take_departure_notice();

  GroupState state(GroupId group) const;
  std::int64_t use_count(GroupId group) const;
  bool persistent(GroupId group) const;
  ShardTier shard_tier(GroupId group) const;  // the tier in effect (see register_group)
  ShardState shard_state(GroupId group) const;
  const std::vector<GroupId>& module_groups(ModuleId module) const;
  bool in_step() const { return step_ != StepState::kIdle; }
  // Whether the step's uses are being recorded rather than followed: the
  // step records its key's first trace, or departed and has not resynchronised.
  bool recording() const {
    return step_ == StepState::kRecording || step_ == StepState::kDeparted;
  }
  // Inside a step, whether before_module(module) would use a group that no
  // adopted trace expects there: always while recording, and at a departure.
  // False outside a step. Changes nothing. Ranks that have agreed so far
  // agree on it, so a caller can check across ranks (a collective) that they
  // all enter the same groups exactly when it holds, before gathering.
  bool unforeseen(ModuleId module) const;
  // The trace adopted for a key (empty before its first step ends).
  std::vector<GroupId> trace(std::int64_t trace_key) const;
  CoordinatorStats stats() const;
  // Restarts peak_live_elements and peak_staged_bytes from their values now.
  void reset_peak();
  const CoordinatorConfig& config() const { return config_; }
  std::size_t num_groups() const { return groups_.size(); }
  std::size_t num_modules() const { return modules_.size(); }

 private:
  // What the current step does with its trace. Orthogonal to the groups' states.
  enum class StepState : std::uint8_t {
    kIdle,       // no step: uses are not traced, nothing is prefetched or kept
    kRecording,  // no trace for this key yet: uses are recorded, gathered on demand
    kFollowing,  // uses match the trace: prefetch and reuse distance apply
    kDeparted,   // a use did not match and no resync yet: on demand until one does
  };

  struct TraceSlot {
    ExecutionTrace trace;
    bool notice_armed = true;  // the next departure is notified
  };

  struct StagedVictim {
    int rank;         // which kind of slot to free first; see make_staging_room
    std::size_t key;  // order within a rank
    GroupId group;
  };

  const std::vector<GroupId>& module(ModuleId module) const;
  void follow_trace(GroupId group);
  void note_departure(GroupId expected, GroupId actual);
  void make_room(const std::vector<GroupId>& entering);
  void prefetch(const std::vector<GroupId>& entering);
  bool evict(std::int64_t deficit, std::size_t min_next_use, bool all_or_nothing,
             const std::vector<GroupId>& keep);
  std::size_t next_use(GroupId group) const;
  // The group's next use needs an all-gather (gather) or a shard fetch again.
  void rewind_frontiers(GroupId group, bool gather);
  bool keep_after_use(GroupId group) const;
  void drain(bool release_persistent);
  void finish_step();
  std::int64_t live_limit(std::int64_t mandatory) const;

  // Shard tiers (coordinator_shards.cpp).
  // The tier a new shard asked for `tier` gets (nvme_host_elements).
  ShardTier tier_kept(ShardTier tier, std::int64_t shard_numel);
  bool fetch_entering(const std::vector<GroupId>& entering);
  void fetch_ahead();
  void stage_for_gather(GroupId group, const std::vector<GroupId>& entering);
  bool stage_for_prefetch(GroupId group);
  void make_staging_room(GroupId group, const std::vector<GroupId>& entering);
  void drain_shards(bool wait_stores);

  // Each emits one action and applies its transition; the gather actions'
  // are in coordinator.cpp, the shard actions' in coordinator_shards.cpp.
  void emit_gather(GroupId group, bool ahead_of_use);
  void emit_wait(GroupId group);
  void emit_release(GroupId group);
  void emit_fetch(GroupId group, bool ahead);  // waits a write in flight first
  void emit_shard_ready(GroupId group);
  void emit_drop(GroupId group);
  void emit_store(GroupId group);
  void emit_shard_stored(GroupId group);

  const CoordinatorConfig config_;
  ParamGroupTable groups_;
  ShardTierTable shards_;  // one entry per group, beside groups_
  std::int64_t nvme_kept_in_host_ = 0;  // elements of NVMe-tier shards kept in host memory
  bool nvme_spilled_ = false;           // a shard went to NVMe: later ones follow
  std::vector<std::vector<GroupId>> modules_;
  PrefetchScheduler scheduler_;
  FetchScheduler fetcher_;
  std::unordered_map<std::int64_t, TraceSlot> traces_;

  StepState step_ = StepState::kIdle;
  std::int64_t trace_key_ = 0;
  TraceSlot* slot_ = nullptr;  // the current step's; stable (unordered_map nodes do not move)
  ExecutionTrace recording_;   // this step's uses, adopted at its end if it departed
  bool step_departed_ = false;
  std::size_t position_ = 0;   // next trace use expected
  std::size_t frontier_ = 0;   // see prefetch.h
  std::size_t fetch_frontier_ = 0;  // see FetchScheduler in shard_tiers.h

  Plan plan_;
  std::vector<PrefetchCandidate> candidates_;
  std::vector<std::pair<std::size_t, GroupId>> victims_;
  std::vector<GroupId> fetches_;
  std::vector<StagedVictim> staged_victims_;
  std::optional<TraceDeparture> notice_;
  CoordinatorStats stats_{};
};

}  // namespace zcore
