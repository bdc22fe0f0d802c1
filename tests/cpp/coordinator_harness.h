// Property harness for ParamCoordinator, shared by the GoogleTest property
// tests (tests/cpp/test_coordinator.cpp and test_coordinator_shards.cpp, a
// few thousand traces each) and the fuzz target
// (bench/cpp/bench_coordinator.cpp, >= 10^5 traces); at its end, the helpers
// of the example tests (tests/cpp/test_coordinator*.cpp).
//
// FaithfulCaller plays the Python layer: it executes every plan action on its
// own view of the groups (built only from the actions, never read from the
// coordinator) and checks the coordinator's guarantees against that view:
//   - a module's groups have all arrived when before_module's plan is done;
//   - nothing is released while a module uses it, or while its gather is in flight;
//   - live elements never exceed max(budget, elements the running modules and
//     the module being entered need), after every single action;
//   - elements gathered ahead of use stay within the bucket (or are one group);
//   - after end_step/abort_step nothing is in flight and nothing
//     non-persistent is gathered; after release_all nothing is gathered;
//   - the coordinator's reported states, use counts, gather count and peak
//     agree with the caller's view.
// and, for groups whose shard is offloaded (host or NVMe; shard_tiers.h):
//   - shard actions come only for offloaded groups, writes only for NVMe ones;
//   - a kGather follows the shard's kFetchShard, and its kShardReady in the
//     same plan; a fetch never starts while the shard's write is in flight;
//   - every kWait is followed at once by the kDropShard of the same group,
//     and no shard is dropped while the all-gather reading it is in flight;
//   - staged bytes stay within staging_bytes (or are one shard alone);
//   - after end_step/abort_step no shard is staged and no fetch or write is
//     in flight; after release_all no shard is staged; after finish_stores no
//     write is in flight;
//   - shard states and statistics agree with the caller's view.
// It also counts the gathers whose shard fetch was issued in the same plan,
// outside the first plan of a step (a measure of how far fetches run ahead).
// RandomTrace generates a model (random group sizes, modules sharing groups)
// and steps of nested, repeated, re-entrant module calls, departing from the
// previous steps on some of them, under random budgets; with tiers, also
// random shard tiers, world sizes, staging budgets, fetch horizons and
// shard writes between steps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "zcore/coordinator.h"
#include "zcore/status.h"

namespace zcore::harness {

struct Call {
  bool enter;
  ModuleId module;
};
using Calls = std::vector<Call>;

class FaithfulCaller {
 public:
  // The modules' groups and the groups' sizes come from the test's model;
  // persistence follows from the configured threshold. Tiers and shard bytes
  // are those registered (empty: every shard on the device); persistent
  // groups keep their shard on the device whatever tier was asked.
  FaithfulCaller(ParamCoordinator& coordinator, std::vector<std::vector<GroupId>> modules,
                 std::vector<std::int64_t> numel, std::vector<ShardTier> tiers = {},
                 std::vector<std::int64_t> shard_bytes = {})
      : c_(coordinator), modules_(std::move(modules)), numel_(std::move(numel)),
        shard_bytes_(std::move(shard_bytes)) {
    const std::size_t n = numel_.size();
    view_.assign(n, View::kSharded);
    users_.assign(n, 0);
    ahead_.assign(n, false);
    for (std::int64_t e : numel_) persistent_.push_back(e < c_.config().persistence_threshold);
    tiers_.assign(n, ShardTier::kDevice);
    shard_bytes_.resize(n, 0);
    fetch_plan_.assign(n, -1);
    ready_plan_.assign(n, -1);
    for (std::size_t g = 0; g < n && g < tiers.size(); ++g) {
      if (!persistent_[g]) tiers_[g] = tiers[g];
    }
    for (std::size_t g = 0; g < n; ++g) {
      shard_.push_back(offloaded(g) ? ShardState::kStored : ShardState::kResident);
      if (c_.shard_tier(static_cast<GroupId>(g)) != tiers_[g]) {
        fail("group " + str(static_cast<std::int64_t>(g)) + " is on tier " +
             shard_tier_name(c_.shard_tier(static_cast<GroupId>(g))) + " for the coordinator, " +
             shard_tier_name(tiers_[g]) + " for the caller");
      }
    }
  }

  void call(const Call& call) { call.enter ? enter(call.module) : leave(call.module); }

  void enter(ModuleId m) {
    const auto& entering = modules_[static_cast<std::size_t>(m)];
    for (GroupId g : entering) ahead_[idx(g)] = false;  // its use has come
    execute(c_.before_module(m), &entering);
    for (GroupId g : entering) {
      if (view_[idx(g)] != View::kArrived) fail("module " + str(m) + " runs before group " + str(g) + " arrived");
    }
    for (GroupId g : entering) ++users_[idx(g)];
    check_agreement("before_module");
  }

  void leave(ModuleId m) {
    for (GroupId g : modules_[static_cast<std::size_t>(m)]) --users_[idx(g)];
    execute(c_.after_module(m), nullptr);
    check_live_limit(nullptr, "after_module");
    check_agreement("after_module");
  }

  void begin_step(std::int64_t key) {
    c_.begin_step(key);
    step_first_plan_ = plans_ + 1;  // the next plan executed
  }
  void end_step() {
    finish(c_.end_step(), false, "end_step");
    step_first_plan_ = -1;
  }
  void abort_step() {
    std::fill(users_.begin(), users_.end(), 0);
    finish(c_.abort_step(), false, "abort_step");
    step_first_plan_ = -1;
  }
  void release_all() { finish(c_.release_all(), true, "release_all"); }
  void store_shards(const std::vector<GroupId>& updated) {
    execute(c_.store_shards(updated), nullptr);
    for (GroupId g : updated) {
      if (tiers_[idx(g)] == ShardTier::kNvme && shard_[idx(g)] != ShardState::kStoring) {
        fail("store_shards: the NVMe shard of group " + str(g) + " is not being written");
      }
    }
    check_agreement("store_shards");
  }
  void finish_stores() {
    execute(c_.finish_stores(), nullptr);
    for (std::size_t g = 0; g < shard_.size(); ++g) {
      if (shard_[g] == ShardState::kStoring) fail("finish_stores: group " + str(g) + " still storing");
    }
    check_agreement("finish_stores");
  }

  std::int64_t violations() const { return violations_; }
  const std::string& first_violation() const { return first_; }
  std::int64_t gathers() const { return gathers_; }
  std::int64_t peak_live() const { return peak_live_; }
  std::int64_t offloaded_gathers() const { return offloaded_gathers_; }
  // Gathers whose shard fetch was issued in the same plan, outside the first plan of a step.
  std::int64_t late_fetches() const { return late_fetches_; }

 private:
  enum class View { kSharded, kInFlight, kArrived };

  static std::size_t idx(GroupId g) { return static_cast<std::size_t>(g); }
  static std::string str(std::int64_t v) { return std::to_string(v); }

  void fail(const std::string& what) {
    if (violations_++ == 0) first_ = what;
  }

  std::int64_t live() const {
    std::int64_t live = 0;
    for (std::size_t g = 0; g < view_.size(); ++g) {
      if (!persistent_[g] && view_[g] != View::kSharded) live += numel_[g];
    }
    return live;
  }

  void check_live_limit(const std::vector<GroupId>* entering, const char* where) {
    std::int64_t mandatory = 0;
    for (std::size_t g = 0; g < view_.size(); ++g) {
      const bool needed = users_[g] > 0 ||
                          (entering && std::find(entering->begin(), entering->end(),
                                                 static_cast<GroupId>(g)) != entering->end());
      if (needed && !persistent_[g]) mandatory += numel_[g];
    }
    const std::int64_t limit = std::max(c_.config().max_live_elements, mandatory);
    if (live() > limit) {
      fail(std::string(where) + ": live " + str(live()) + " > max(budget, needed) " + str(limit));
    }
    std::int64_t ahead = 0, ahead_groups = 0;
    for (std::size_t g = 0; g < view_.size(); ++g) {
      if (ahead_[g]) ahead += numel_[g], ++ahead_groups;
    }
    if (ahead > c_.config().prefetch_bucket_elements && ahead_groups > 1) {
      fail(std::string(where) + ": " + str(ahead) + " elements gathered ahead of use > bucket");
    }
  }

  bool offloaded(std::size_t g) const { return tiers_[g] != ShardTier::kDevice; }

  void execute(const Plan& plan, const std::vector<GroupId>* entering) {
    ++plans_;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      const Action& a = plan[i];
      const std::size_t g = idx(a.group);
      switch (a.kind) {
        case ActionKind::kGather:
          if (view_[g] != View::kSharded) fail("gather of group " + str(a.group) + " that is not sharded");
          if (offloaded(g)) gather_offloaded(g);
          view_[g] = View::kInFlight;
          ahead_[g] = !entering || std::find(entering->begin(), entering->end(), a.group) ==
                                       entering->end();
          ++gathers_;
          break;
        case ActionKind::kWait:
          if (view_[g] != View::kInFlight) fail("wait for group " + str(a.group) + " not in flight");
          view_[g] = View::kArrived;
          if (offloaded(g) && (i + 1 == plan.size() || plan[i + 1].kind != ActionKind::kDropShard ||
                               plan[i + 1].group != a.group)) {
            fail("wait for offloaded group " + str(a.group) + " not followed by its kDropShard");
          }
          break;
        case ActionKind::kRelease:
          if (view_[g] == View::kInFlight) fail("release of group " + str(a.group) + " in flight");
          if (users_[g] > 0) fail("release of group " + str(a.group) + " in use");
          view_[g] = View::kSharded;
          ahead_[g] = false;
          break;
        default:
          shard_action(a);
          break;
      }
      peak_live_ = std::max(peak_live_, live());
      if (entering) check_live_limit(entering, "before_module");
    }
  }

  void gather_offloaded(std::size_t g) {
    if (shard_[g] != ShardState::kFetched || ready_plan_[g] != plans_) {
      fail("gather of group " + str(static_cast<std::int64_t>(g)) +
           " without its shard's kShardReady in the same plan");
    }
    ++offloaded_gathers_;
    if (fetch_plan_[g] == plans_ && plans_ != step_first_plan_ && step_first_plan_ >= 0) {
      ++late_fetches_;
    }
  }

  void shard_action(const Action& a) {
    const std::size_t g = idx(a.group);
    const std::string group = "group " + str(a.group);
    const auto expect = [&](ShardState from, ShardState to, const char* what) {
      if (shard_[g] != from) {
        fail(std::string(what) + " of " + group + " whose shard is " + shard_state_name(shard_[g]));
      }
      shard_[g] = to;
    };
    if (!offloaded(g)) {
      fail("shard action " + str(static_cast<std::int64_t>(a.kind)) + " for " + group +
           " on the device tier");
      return;
    }
    switch (a.kind) {
      case ActionKind::kFetchShard:
        expect(ShardState::kStored, ShardState::kFetching, "fetch");
        staged_ += shard_bytes_[g];
        if (staged_ > c_.config().staging_bytes && staged_ != shard_bytes_[g]) {
          fail("fetch of " + group + ": " + str(staged_) + " bytes staged > staging_bytes " +
               str(c_.config().staging_bytes));
        }
        peak_staged_ = std::max(peak_staged_, staged_);
        fetch_plan_[g] = plans_;
        ++fetches_;
        fetched_bytes_ += shard_bytes_[g];
        break;
      case ActionKind::kShardReady:
        expect(ShardState::kFetching, ShardState::kFetched, "shard ready");
        ready_plan_[g] = plans_;
        break;
      case ActionKind::kDropShard:
        if (view_[g] == View::kInFlight) fail("drop of " + group + "'s shard while its all-gather is in flight");
        expect(ShardState::kFetched, ShardState::kStored, "drop");
        staged_ -= shard_bytes_[g];
        break;
      case ActionKind::kStoreShard:
        if (tiers_[g] != ShardTier::kNvme) fail("store of " + group + " not on NVMe");
        expect(ShardState::kStored, ShardState::kStoring, "store");
        ++stores_;
        stored_bytes_ += shard_bytes_[g];
        break;
      case ActionKind::kShardStored:
        expect(ShardState::kStoring, ShardState::kStored, "shard stored");
        break;
      default:
        fail("unknown action " + str(static_cast<std::int64_t>(a.kind)));
        break;
    }
  }

  void finish(const Plan& plan, bool everything, const char* where) {
    execute(plan, nullptr);
    for (std::size_t g = 0; g < view_.size(); ++g) {
      if (view_[g] == View::kInFlight) fail(std::string(where) + ": group " + str(g) + " left in flight");
      if (view_[g] == View::kArrived && (everything || !persistent_[g])) {
        fail(std::string(where) + ": group " + str(g) + " left gathered");
      }
      const ShardState s = shard_[g];
      if (s == ShardState::kFetching || s == ShardState::kFetched ||
          (!everything && s == ShardState::kStoring)) {
        fail(std::string(where) + ": the shard of group " + str(g) + " left " + shard_state_name(s));
      }
    }
    check_agreement(where);
  }

  void check_agreement(const char* where) {
    for (std::size_t g = 0; g < view_.size(); ++g) {
      const GroupState s = c_.state(static_cast<GroupId>(g));
      GroupState expected = GroupState::kSharded;
      if (view_[g] == View::kInFlight) expected = GroupState::kGathering;
      if (view_[g] == View::kArrived) expected = users_[g] > 0 ? GroupState::kInUse : GroupState::kGathered;
      if (s != expected || c_.use_count(static_cast<GroupId>(g)) != users_[g]) {
        fail(std::string(where) + ": group " + str(g) + " is " + group_state_name(s) +
             " for the coordinator, " + group_state_name(expected) + " for the caller");
      }
    }
    for (std::size_t g = 0; g < shard_.size(); ++g) {
      const ShardState s = c_.shard_state(static_cast<GroupId>(g));
      if (s != shard_[g]) {
        fail(std::string(where) + ": the shard of group " + str(g) + " is " + shard_state_name(s) +
             " for the coordinator, " + shard_state_name(shard_[g]) + " for the caller");
      }
    }
    const CoordinatorStats s = c_.stats();
    if (s.gathers != gathers_ || s.peak_live_elements != peak_live_ || s.live_elements != live()) {
      fail(std::string(where) + ": statistics disagree with the executed plans");
    }
    if (s.shard_fetches != fetches_ || s.shard_bytes_fetched != fetched_bytes_ ||
        s.shard_stores != stores_ || s.shard_bytes_stored != stored_bytes_ ||
        s.staged_bytes != staged_ || s.peak_staged_bytes != peak_staged_) {
      fail(std::string(where) + ": shard statistics disagree with the executed plans");
    }
  }

  ParamCoordinator& c_;
  std::vector<std::vector<GroupId>> modules_;
  std::vector<std::int64_t> numel_;
  std::vector<bool> persistent_;
  std::vector<View> view_;
  std::vector<std::int64_t> users_;
  std::vector<bool> ahead_;  // gathered ahead of use, not used since
  std::vector<ShardTier> tiers_;
  std::vector<std::int64_t> shard_bytes_;
  std::vector<ShardState> shard_;  // the caller's view, from the shard actions
  std::vector<std::int64_t> fetch_plan_;  // the plan that last fetched each shard
  std::vector<std::int64_t> ready_plan_;  // the plan that last waited each fetch
  std::int64_t plans_ = 0;                // plans executed
  std::int64_t step_first_plan_ = -1;     // the current step's first plan; -1 outside a step
  std::int64_t staged_ = 0;
  std::int64_t peak_staged_ = 0;
  std::int64_t fetches_ = 0;
  std::int64_t fetched_bytes_ = 0;
  std::int64_t stores_ = 0;
  std::int64_t stored_bytes_ = 0;
  std::int64_t offloaded_gathers_ = 0;
  std::int64_t late_fetches_ = 0;
  std::int64_t gathers_ = 0;
  std::int64_t peak_live_ = 0;
  std::int64_t violations_ = 0;
  std::string first_;
};

// One random model, configuration and sequence of steps, from one seed.
class RandomTrace {
 public:
  static constexpr std::int64_t kElementSize = 2;

  // Without tiers every shard is on the device and the draws are those of
  // the traces before shard tiers existed (the same seeds, the same traces).
  explicit RandomTrace(std::uint64_t seed, bool tiered = false) : rng_(seed), tiered_(tiered) {
    const int n_groups = uniform(1, 24);
    for (int g = 0; g < n_groups; ++g) {
      numel_.push_back(static_cast<std::int64_t>(std::pow(10.0, real(0.0, 6.0))));
      total_ += numel_.back();
      largest_ = std::max(largest_, numel_.back());
    }
    const int n_modules = uniform(1, 16);
    for (int m = 0; m < n_modules; ++m) {
      std::vector<GroupId> groups;
      const int k = chance(0.8) ? 1 : uniform(0, std::min(3, n_groups));
      while (static_cast<int>(groups.size()) < k) {
        const GroupId g = uniform(0, n_groups - 1);  // shared groups: tied weights
        if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
      }
      modules_.push_back(groups);
    }
    config_.max_live_elements = pick({0, largest_ / 2, uniform64(largest_, total_), 10 * total_});
    config_.prefetch_bucket_elements = pick({0, uniform64(1, total_), 10 * total_});
    config_.max_reuse_distance = pick({0, uniform64(0, total_), 10 * total_});
    config_.persistence_threshold = pick({0, uniform64(1, 1000), uniform64(1, largest_)});
    config_.resync_window = pick({0, 1, 4, 64});
    if (tiered_) draw_tiers();
  }

  const CoordinatorConfig& config() const { return config_; }
  const std::vector<ShardTier>& tiers() const { return tiers_; }
  const std::vector<std::int64_t>& shard_numel() const { return shard_numel_; }
  std::vector<std::int64_t> shard_bytes() const {
    std::vector<std::int64_t> bytes;
    for (std::int64_t n : shard_numel_) bytes.push_back(n * kElementSize);
    return bytes;
  }

  // Plays `steps` steps (and some untraced calls, aborts and release_all
  // between them) through the caller, which records any violation.
  void run(FaithfulCaller& caller, int steps) {
    std::vector<Calls> forward = random_forward();
    for (int s = 0; s < steps; ++s) {
      const std::int64_t key = chance(0.8) ? 0 : 1;
      std::vector<Calls> step = chance(0.35) ? depart(forward) : forward;
      if (chance(0.2)) forward = step;
      caller.begin_step(key);
      Calls calls = flatten(step);
      if (chance(0.7)) append_backward(&calls);
      if (chance(0.05)) {
        play_prefix(caller, calls, uniform(0, static_cast<int>(calls.size())));
        caller.abort_step();
      } else {
        for (const Call& c : calls) caller.call(c);
        caller.end_step();
      }
      if (chance(0.1)) {
        for (const Call& c : random_subtree(0)) caller.call(c);  // untraced, outside a step
      }
      if (chance(0.1)) caller.release_all();
      if (tiered_ && chance(0.6)) caller.store_shards(random_subset());
      if (tiered_ && chance(0.2)) caller.finish_stores();
    }
    if (tiered_) caller.finish_stores();
  }

  const std::vector<std::vector<GroupId>>& modules() const { return modules_; }
  const std::vector<std::int64_t>& numel() const { return numel_; }

 private:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  std::int64_t uniform64(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, std::max(lo, hi))(rng_);
  }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  std::int64_t pick(std::initializer_list<std::int64_t> options) {
    return *(options.begin() + uniform(0, static_cast<int>(options.size()) - 1));
  }

  // A module call with nested calls inside, sometimes of the same module.
  Calls random_subtree(int depth) {
    const ModuleId m = uniform(0, static_cast<int>(modules_.size()) - 1);
    Calls calls{{true, m}};
    if (depth < 3 && chance(0.3)) {
      for (int k = uniform(1, 2); k > 0; --k) {
        Calls inner = chance(0.1) ? Calls{{true, m}, {false, m}} : random_subtree(depth + 1);
        calls.insert(calls.end(), inner.begin(), inner.end());
      }
    }
    calls.push_back({false, m});
    return calls;
  }

  // Shards on NVMe, on the host or on the device (the mix varies by trace), a
  // world size, and staging from the least register_group accepts to plenty.
  void draw_tiers() {
    const std::int64_t world = uniform(1, 8);
    const int mix = uniform(0, 3);
    std::int64_t largest = 0, total = 0;
    for (std::int64_t numel : numel_) {
      const ShardTier tier = mix == 0   ? ShardTier::kNvme
                             : mix == 1 ? ShardTier::kHost
                                        : static_cast<ShardTier>(uniform(0, 2));
      tiers_.push_back(tier);
      shard_numel_.push_back((numel + world - 1) / world);
      if (tier != ShardTier::kDevice && numel >= config_.persistence_threshold) {
        largest = std::max(largest, shard_numel_.back() * kElementSize);
        total += shard_numel_.back() * kElementSize;
      }
    }
    config_.staging_bytes = pick({largest, uniform64(largest, 2 * largest), uniform64(largest, total),
                                  10 * total});
    config_.fetch_horizon_uses = pick({0, 1, 4, 64});
  }

  // Distinct groups in random order: the groups an optimizer step updated.
  std::vector<GroupId> random_subset() {
    std::vector<GroupId> ids(numel_.size());
    for (std::size_t g = 0; g < ids.size(); ++g) ids[g] = static_cast<GroupId>(g);
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(static_cast<std::size_t>(uniform(0, static_cast<int>(ids.size()))));
    return ids;
  }

  std::vector<Calls> random_forward() {
    std::vector<Calls> forward;
    for (int k = uniform(1, 12); k > 0; --k) forward.push_back(random_subtree(0));
    return forward;
  }

  // Departures at the granularity of top-level calls, so nesting stays
  // balanced: a call skipped, one inserted, the step cut short, or a new program.
  std::vector<Calls> depart(std::vector<Calls> forward) {
    const int kind = uniform(0, 3);
    const auto at = [&](std::size_t extra) {
      return forward.begin() + uniform(0, static_cast<int>(forward.size() + extra) - 1);
    };
    if (kind == 0 && !forward.empty()) forward.erase(at(0));
    if (kind == 1) forward.insert(at(1), random_subtree(0));
    if (kind == 2 && !forward.empty()) forward.erase(at(0), forward.end());
    if (kind == 3) forward = random_forward();
    return forward;
  }

  static Calls flatten(const std::vector<Calls>& parts) {
    Calls calls;
    for (const Calls& p : parts) calls.insert(calls.end(), p.begin(), p.end());
    return calls;
  }

  // Backward visits the forward calls in reverse, nested the same way.
  static void append_backward(Calls* calls) {
    const std::size_t n = calls->size();
    for (std::size_t i = n; i-- > 0;) calls->push_back({!(*calls)[i].enter, (*calls)[i].module});
  }

  static void play_prefix(FaithfulCaller& caller, const Calls& calls, int count) {
    for (int i = 0; i < count; ++i) caller.call(calls[static_cast<std::size_t>(i)]);
  }

  std::mt19937_64 rng_;
  bool tiered_;
  std::vector<ShardTier> tiers_;         // empty without tiers
  std::vector<std::int64_t> shard_numel_;
  std::vector<std::int64_t> numel_;
  std::vector<std::vector<GroupId>> modules_;
  std::int64_t total_ = 0;
  std::int64_t largest_ = 0;
  CoordinatorConfig config_;
};

struct PropertyVerdict {
  std::int64_t violations = 0;
  std::string first_violation;
  CoordinatorStats stats{};  // what the trace exercised
  std::int64_t offloaded_gathers = 0;
  std::int64_t late_fetches = 0;  // see FaithfulCaller::late_fetches()
};

// One random trace checked end to end; deterministic in the seed. A
// zcore::Error thrown by the coordinator counts as a violation: the harness
// follows the protocol, so the coordinator must never reject it.
inline PropertyVerdict check_random_trace(std::uint64_t seed, bool tiered = false) {
  RandomTrace trace(seed, tiered);
  ParamCoordinator coordinator(trace.config());
  for (std::size_t g = 0; g < trace.numel().size(); ++g) {
    if (tiered) {
      coordinator.register_group(trace.numel()[g], RandomTrace::kElementSize,
                                 trace.shard_numel()[g], trace.tiers()[g]);
    } else {
      coordinator.register_group(trace.numel()[g], RandomTrace::kElementSize);
    }
  }
  for (const auto& groups : trace.modules()) coordinator.register_module(groups);
  FaithfulCaller caller(coordinator, trace.modules(), trace.numel(), trace.tiers(),
                        trace.shard_bytes());
  PropertyVerdict verdict;
  try {
    trace.run(caller, 2 + static_cast<int>(seed % 5));
    verdict = {caller.violations(), caller.first_violation(), coordinator.stats(),
               caller.offloaded_gathers(), caller.late_fetches()};
  } catch (const Error& e) {
    verdict = {caller.violations() + 1, std::string("coordinator threw: ") + e.what(),
               coordinator.stats(), caller.offloaded_gathers(), caller.late_fetches()};
  }
  if (verdict.violations > 0) verdict.first_violation = "seed " + std::to_string(seed) + ": " +
                                                        verdict.first_violation;
  return verdict;
}

}  // namespace zcore::harness

// Helpers of the example tests (test_coordinator*.cpp), which write the plans
// they expect as lists of {kind, group} and print them as G0 W0 R0 Fetch0 ...
// when a test fails.
namespace zcore {

inline bool operator==(const Action& a, const Action& b) { return a.kind == b.kind && a.group == b.group; }

inline void PrintTo(const Action& a, std::ostream* os) {
  static const char* const kNames[] = {"G", "W", "R", "Fetch", "Ready", "Drop", "Store", "Stored"};
  *os << kNames[static_cast<int>(a.kind)] << a.group;
}

}  // namespace zcore

namespace zcore::harness {

constexpr ActionKind G = ActionKind::kGather;
constexpr ActionKind W = ActionKind::kWait;
constexpr ActionKind R = ActionKind::kRelease;
constexpr ActionKind Fetch = ActionKind::kFetchShard;
constexpr ActionKind Ready = ActionKind::kShardReady;
constexpr ActionKind Drop = ActionKind::kDropShard;
constexpr ActionKind Store = ActionKind::kStoreShard;
constexpr ActionKind Stored = ActionKind::kShardStored;
constexpr std::int64_t S = 1'000'000;  // a layer-sized group, above the persistence threshold

inline Plan plan(std::initializer_list<Action> actions) { return Plan(actions); }

inline CoordinatorConfig config(std::int64_t bucket, std::int64_t live, std::int64_t reuse) {
  CoordinatorConfig c;
  c.prefetch_bucket_elements = bucket;
  c.max_live_elements = live;
  c.max_reuse_distance = reuse;
  return c;
}

// n groups of `numel` elements and one module per group (module i uses group i).
struct Chain {
  explicit Chain(const CoordinatorConfig& cfg, int n, std::int64_t numel = S) : c(cfg) {
    for (int i = 0; i < n; ++i) c.register_module({c.register_group(numel, 2)});
  }
  void run(const std::vector<ModuleId>& order) {
    for (ModuleId m : order) {
      c.before_module(m);
      c.after_module(m);
    }
  }
  void step(const std::vector<ModuleId>& order, std::int64_t key = 0) {
    c.begin_step(key);
    run(order);
    c.end_step();
  }
  ParamCoordinator c;
};

}  // namespace zcore::harness
