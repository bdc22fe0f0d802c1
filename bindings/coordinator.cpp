// Bindings of the ZeRO-3 parameter coordinator (zcore/coordinator.h, where
// the calling protocol is documented). The calls are bookkeeping of tens of
// nanoseconds, so they keep the GIL: releasing it would cost more than the
// call, and the GIL is what serializes the (not thread-safe) coordinator.
#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>

#include "bindings.h"
#include "zcore/coordinator.h"

namespace py = pybind11;

namespace zcore::bindings {

namespace {

// A plan as a list of (Action, group id) tuples; the Action members are
// looked up once, so a hook pays for one list and one tuple per action.
class PlanConverter {
 public:
  explicit PlanConverter(const py::module_& m) {
    const py::object action = m.attr("Action");
    kinds_ = {action.attr("GATHER"),      action.attr("WAIT"),        action.attr("RELEASE"),
              action.attr("FETCH_SHARD"), action.attr("SHARD_READY"), action.attr("DROP_SHARD"),
              action.attr("STORE_SHARD"), action.attr("SHARD_STORED")};
  }
  py::list operator()(const Plan& plan) const {
    py::list out(plan.size());
    for (std::size_t i = 0; i < plan.size(); ++i) {
      out[i] = py::make_tuple(kinds_[static_cast<std::size_t>(plan[i].kind)], plan[i].group);
    }
    return out;
  }

 private:
  std::array<py::object, 8> kinds_;  // indexed by ActionKind
};

}  // namespace

void bind_coordinator(py::module_& m) {
  py::native_enum<GroupState>(m, "GroupState", "enum.Enum",
                              "Where a parameter group's full parameters are.")
      .value("SHARDED", GroupState::kSharded, "only this rank's shard exists")
      .value("GATHERING", GroupState::kGathering, "an all-gather is in flight, not yet waited")
      .value("GATHERED", GroupState::kGathered, "full parameters present, no module uses them")
      .value("IN_USE", GroupState::kInUse, "full parameters present, a module runs with them")
      .finalize();

  py::native_enum<ActionKind>(m, "Action", "enum.Enum", "One step of a coordinator plan.")
      .value("GATHER", ActionKind::kGather, "take a buffer and start the group's async all-gather")
      .value("WAIT", ActionKind::kWait, "wait for the group's all-gather")
      .value("RELEASE", ActionKind::kRelease, "drop the group's full parameters, return the buffer")
      .value("FETCH_SHARD", ActionKind::kFetchShard,
             "take a staging slot and start copying/reading the group's offloaded shard into it")
      .value("SHARD_READY", ActionKind::kShardReady, "wait for the shard's copy/read")
      .value("DROP_SHARD", ActionKind::kDropShard, "the staged shard is not needed: return its slot")
      .value("STORE_SHARD", ActionKind::kStoreShard,
             "start writing the group's updated shard back to its tier (NVMe)")
      .value("SHARD_STORED", ActionKind::kShardStored, "wait for the shard's write")
      .finalize();

  py::native_enum<ShardTier>(m, "ShardTier", "enum.Enum",
                             "Where a parameter group's shard lives at rest.")
      .value("DEVICE", ShardTier::kDevice, "on the compute device; all-gathered in place")
      .value("HOST", ShardTier::kHost, "in host memory; copied to a staging slot to be all-gathered")
      .value("NVME", ShardTier::kNvme, "on NVMe; read into a staging slot to be all-gathered")
      .finalize();

  py::native_enum<ShardState>(m, "ShardState", "enum.Enum",
                              "What is happening to a parameter group's shard.")
      .value("RESIDENT", ShardState::kResident, "tier DEVICE: always usable")
      .value("STORED", ShardState::kStored, "only in its tier")
      .value("FETCHING", ShardState::kFetching, "a copy/read into a staging slot is in flight")
      .value("FETCHED", ShardState::kFetched, "in a staging slot, usable as the all-gather's input")
      .value("STORING", ShardState::kStoring, "an updated shard is being written to its tier")
      .finalize();

  py::class_<CoordinatorConfig>(
      m, "CoordinatorConfig",
      "Budgets of the coordinator, in parameter elements (staging_bytes in bytes).")
      .def(py::init([](std::int64_t bucket, std::int64_t live, std::int64_t reuse,
                       std::int64_t persistence, std::int64_t window, std::int64_t staging,
                       std::int64_t horizon, std::int64_t nvme_host) {
             return CoordinatorConfig{bucket, live, reuse, persistence, window, staging, horizon,
                                      nvme_host};
           }),
           py::kw_only(), py::arg("prefetch_bucket_elements") = 50'000'000,
           py::arg("max_live_elements") = 1'000'000'000,
           py::arg("max_reuse_distance") = 1'000'000'000,
           py::arg("persistence_threshold") = 100'000, py::arg("resync_window") = 64,
           py::arg("staging_bytes") = 0, py::arg("fetch_horizon_uses") = 64,
           py::arg("nvme_host_elements") = 0,
           "Defaults are DeepSpeed's stage3_prefetch_bucket_size, stage3_max_live_parameters, "
           "stage3_max_reuse_distance and stage3_param_persistence_threshold. staging_bytes: "
           "device staging for offloaded shards (at least the largest one); "
           "fetch_horizon_uses: trace uses ahead of the position that shard fetches may start; "
           "nvme_host_elements: elements of NVMe-tier shards kept in host memory (max_in_cpu).")
      .def_readwrite("prefetch_bucket_elements", &CoordinatorConfig::prefetch_bucket_elements)
      .def_readwrite("max_live_elements", &CoordinatorConfig::max_live_elements)
      .def_readwrite("max_reuse_distance", &CoordinatorConfig::max_reuse_distance)
      .def_readwrite("persistence_threshold", &CoordinatorConfig::persistence_threshold)
      .def_readwrite("resync_window", &CoordinatorConfig::resync_window)
      .def_readwrite("staging_bytes", &CoordinatorConfig::staging_bytes)
      .def_readwrite("fetch_horizon_uses", &CoordinatorConfig::fetch_horizon_uses)
      .def_readwrite("nvme_host_elements", &CoordinatorConfig::nvme_host_elements);

  py::class_<TraceDeparture>(m, "TraceDeparture",
                             "Where a step left its recorded trace (-1: none).")
      .def_readonly("trace_key", &TraceDeparture::trace_key)
      .def_readonly("step", &TraceDeparture::step)
      .def_readonly("position", &TraceDeparture::position)
      .def_readonly("expected", &TraceDeparture::expected)
      .def_readonly("actual", &TraceDeparture::actual);

  py::class_<CoordinatorStats>(m, "CoordinatorStats")
      .def_readonly("steps", &CoordinatorStats::steps)
      .def_readonly("aborted_steps", &CoordinatorStats::aborted_steps)
      .def_readonly("module_calls", &CoordinatorStats::module_calls)
      .def_readonly("gathers", &CoordinatorStats::gathers)
      .def_readonly("elements_gathered", &CoordinatorStats::elements_gathered)
      .def_readonly("bytes_gathered", &CoordinatorStats::bytes_gathered)
      .def_readonly("prefetch_gathers", &CoordinatorStats::prefetch_gathers)
      .def_readonly("prefetch_hits", &CoordinatorStats::prefetch_hits)
      .def_readonly("prefetch_misses", &CoordinatorStats::prefetch_misses)
      .def_readonly("resident_hits", &CoordinatorStats::resident_hits)
      .def_readonly("prefetch_unused", &CoordinatorStats::prefetch_unused)
      .def_readonly("releases", &CoordinatorStats::releases)
      .def_readonly("trace_departures", &CoordinatorStats::trace_departures)
      .def_readonly("trace_resyncs", &CoordinatorStats::trace_resyncs)
      .def_readonly("trace_recordings", &CoordinatorStats::trace_recordings)
      .def_readonly("live_elements", &CoordinatorStats::live_elements)
      .def_readonly("peak_live_elements", &CoordinatorStats::peak_live_elements)
      .def_readonly("persistent_elements", &CoordinatorStats::persistent_elements)
      .def_readonly("shard_fetches", &CoordinatorStats::shard_fetches)
      .def_readonly("shard_bytes_fetched", &CoordinatorStats::shard_bytes_fetched)
      .def_readonly("shard_fetches_ahead", &CoordinatorStats::shard_fetches_ahead)
      .def_readonly("shard_fetches_unused", &CoordinatorStats::shard_fetches_unused)
      .def_readonly("shard_stores", &CoordinatorStats::shard_stores)
      .def_readonly("shard_bytes_stored", &CoordinatorStats::shard_bytes_stored)
      .def_readonly("staged_bytes", &CoordinatorStats::staged_bytes)
      .def_readonly("peak_staged_bytes", &CoordinatorStats::peak_staged_bytes);

  const PlanConverter to_list(m);
  py::class_<ParamCoordinator>(
      m, "ParamCoordinator",
      "ZeRO-3 gather/release planner. Plans are lists of (Action, group) to execute in order "
      "before the next call; see cpp/include/zcore/coordinator.h for the protocol.")
      .def(py::init<const CoordinatorConfig&>(), py::arg("config"))
      .def("register_group",
           [](ParamCoordinator& c, std::int64_t numel, std::int64_t element_size,
              std::optional<std::int64_t> shard_numel, ShardTier tier) {
             return c.register_group(numel, element_size, shard_numel.value_or(numel), tier);
           },
           py::arg("numel"), py::arg("element_size"), py::kw_only(),
           py::arg("shard_numel") = py::none(), py::arg("tier") = ShardTier::kDevice,
           "Registers a group; returns its id (0, 1, ...). shard_numel: the rank's shard "
           "(default numel); tier: where the shard lives (persistent groups stay on DEVICE; "
           "shard_tier() tells the tier in effect).")
      .def("register_module", &ParamCoordinator::register_module, py::arg("groups"),
           "Registers a module or use site needing `groups` gathered; returns its id.")
      .def("begin_step", &ParamCoordinator::begin_step, py::arg("trace_key") = 0,
           "Starts a step; each trace_key (training, eval, generation) keeps its own trace.")
      .def("before_module", [to_list](ParamCoordinator& c, ModuleId module) {
             return to_list(c.before_module(module));
           }, py::arg("module"), "Plan to execute before the module runs.")
      .def("after_module", [to_list](ParamCoordinator& c, ModuleId module) {
             return to_list(c.after_module(module));
           }, py::arg("module"), "Plan to execute after the module ran.")
      .def("end_step", [to_list](ParamCoordinator& c) { return to_list(c.end_step()); },
           "Ends the step: waits what is in flight, releases all non-persistent groups, drops "
           "every staged shard and waits the shard writes in flight.")
      .def("abort_step", [to_list](ParamCoordinator& c) { return to_list(c.abort_step()); },
           "After an exception: forgets users, releases all non-persistent groups, drops every "
           "staged shard and waits the shard writes in flight.")
      .def("release_all", [to_list](ParamCoordinator& c) { return to_list(c.release_all()); },
           "Between steps: releases every group, persistent ones included.")
      .def("store_shards", [to_list](ParamCoordinator& c, const std::vector<GroupId>& updated) {
             return to_list(c.store_shards(updated));
           }, py::arg("updated"),
           "Between steps: plan writing back the NVMe shards of the updated groups.")
      .def("finish_stores", [to_list](ParamCoordinator& c) { return to_list(c.finish_stores()); },
           "Plan waiting every shard write in flight (before a checkpoint or shutdown).")
      .def("take_departure_notice", &ParamCoordinator::take_departure_notice,
           "The first departure from the trace since the trace was last followed, once; else None.")
      .def("state", &ParamCoordinator::state, py::arg("group"))
      .def("use_count", &ParamCoordinator::use_count, py::arg("group"))
      .def("persistent", &ParamCoordinator::persistent, py::arg("group"))
      .def("shard_tier", &ParamCoordinator::shard_tier, py::arg("group"),
           "Where the group's shard lives (DEVICE for persistent groups, whatever was asked).")
      .def("shard_state", &ParamCoordinator::shard_state, py::arg("group"))
      .def("module_groups", &ParamCoordinator::module_groups, py::arg("module"))
      .def("trace", &ParamCoordinator::trace, py::arg("trace_key") = 0,
           "Group ids of the trace adopted for trace_key, one per use.")
      .def("stats", &ParamCoordinator::stats)
      .def("reset_peak", &ParamCoordinator::reset_peak,
           "Restarts peak_live_elements and peak_staged_bytes from their current values.")
      .def_property_readonly("in_step", &ParamCoordinator::in_step)
      .def_property_readonly("recording", &ParamCoordinator::recording,
                             "Whether the step records its uses (first step of its key, or "
                             "departed and not resynchronised).")
      .def("unforeseen", &ParamCoordinator::unforeseen, py::arg("module"),
           "Inside a step, whether before_module(module) would use a group no adopted trace "
           "expects there (recording, or a departure); changes nothing.")
      .def_property_readonly("config", &ParamCoordinator::config)
      .def_property_readonly("num_groups", &ParamCoordinator::num_groups)
      .def_property_readonly("num_modules", &ParamCoordinator::num_modules);
}

}  // namespace zcore::bindings
