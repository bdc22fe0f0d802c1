// Parameter coordinator: fuzzing of its guarantees over random module traces,
// and its host overhead per before_module/after_module call.
//
//   build/py/bench/cpp/bench_coordinator --fuzz_traces=100000 --benchmark_min_time=0.2
//
// --fuzz_traces=N (default 100000; 0 skips) first checks N random traces with
// the property harness of tests/cpp/coordinator_harness.h (the GoogleTest
// runs a few thousand of the same traces) and exits 1 if any violates a
// guarantee. Then the benchmarks time whole steps (begin_step, forward and
// backward through every module, end_step) on a deep model of tiny layers,
// where the coordinator's overhead matters most, and report it per call.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "coordinator_harness.h"
#include "zcore/coordinator.h"

namespace {

using zcore::CoordinatorConfig;
using zcore::ModuleId;
using zcore::ParamCoordinator;

constexpr std::int64_t kLayerNumel = 16'384;  // a 128x128 linear layer: tiny, not persistent

enum Scenario : std::int64_t {
  kFollowDefaults,  // DeepSpeed's defaults (no persistence): everything prefetched and kept
  kFollowTight,     // budget of 8 layers, bucket of 4, reuse 0: releases and prefetches at every call
  kDepartEachStep,  // tight, and a layer skipped every other step: departures and re-recording
};

const char* scenario_label(std::int64_t s) {
  switch (s) {
    case kFollowDefaults: return "follow, DeepSpeed defaults";
    case kFollowTight: return "follow, tight budget";
    case kDepartEachStep: return "depart every other step, tight";
  }
  return "?";
}

CoordinatorConfig scenario_config(std::int64_t s) {
  CoordinatorConfig c;  // DeepSpeed's defaults, except:
  c.persistence_threshold = 0;  // tiny layers would all persist: then there would be nothing to do
  if (s != kFollowDefaults) {
    c.max_live_elements = 8 * kLayerNumel;
    c.prefetch_bucket_elements = 4 * kLayerNumel;
    c.max_reuse_distance = 0;
  }
  return c;
}

// Forward through every layer, backward in reverse; one iteration is one step.
void BM_Step(benchmark::State& state) {
  const std::int64_t scenario = state.range(0);
  const auto layers = static_cast<ModuleId>(state.range(1));
  ParamCoordinator c(scenario_config(scenario));
  for (ModuleId m = 0; m < layers; ++m) c.register_module({c.register_group(kLayerNumel, 2)});
  std::int64_t step = 0;
  std::size_t actions = 0;
  std::int64_t calls = 0;
  for (auto _ : state) {
    const ModuleId skipped = scenario == kDepartEachStep && step % 2 ? layers / 2 : -1;
    c.begin_step(0);
    for (ModuleId m = 0; m < layers; ++m) {
      if (m == skipped) continue;
      actions += c.before_module(m).size();
      actions += c.after_module(m).size();
      calls += 2;
    }
    for (ModuleId m = layers; m-- > 0;) {
      if (m == skipped) continue;
      actions += c.before_module(m).size();
      actions += c.after_module(m).size();
      calls += 2;
    }
    actions += c.end_step().size();
    ++step;
  }
  benchmark::DoNotOptimize(actions);
  const zcore::CoordinatorStats s = c.stats();
  state.counters["per_call"] = benchmark::Counter(static_cast<double>(calls),
                                                  benchmark::Counter::kIsRate |
                                                      benchmark::Counter::kInvert);
  state.counters["actions_per_call"] =
      static_cast<double>(actions) / static_cast<double>(std::max<std::int64_t>(calls, 1));
  state.counters["hit_rate"] =
      static_cast<double>(s.prefetch_hits) /
      static_cast<double>(std::max<std::int64_t>(s.prefetch_hits + s.prefetch_misses, 1));
  state.SetLabel(std::string(scenario_label(scenario)) + ", " + std::to_string(layers) + " layers");
}

BENCHMARK(BM_Step)
    ->ArgsProduct({{kFollowDefaults, kFollowTight, kDepartEachStep}, {64, 1024}})
    ->ArgNames({"scenario", "layers"});

// Returns the number of traces that violated a guarantee.
std::int64_t fuzz(std::int64_t traces) {
  const auto start = std::chrono::steady_clock::now();
  std::int64_t violations = 0, calls = 0, departures = 0, resyncs = 0, hits = 0;
  for (std::int64_t seed = 1; seed <= traces; ++seed) {
    const zcore::harness::PropertyVerdict v =
        zcore::harness::check_random_trace(static_cast<std::uint64_t>(seed));
    if (v.violations > 0 && violations++ < 5) std::fprintf(stderr, "%s\n", v.first_violation.c_str());
    calls += v.stats.module_calls;
    departures += v.stats.trace_departures;
    resyncs += v.stats.trace_resyncs;
    hits += v.stats.prefetch_hits;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "fuzz: %lld random traces, %lld violating a guarantee; %lld module calls, %lld trace "
      "departures, %lld resyncs, %lld prefetch hits; %.1f s\n",
      static_cast<long long>(traces), static_cast<long long>(violations),
      static_cast<long long>(calls), static_cast<long long>(departures),
      static_cast<long long>(resyncs), static_cast<long long>(hits), seconds);
  std::fflush(stdout);
  return violations;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t traces = 100'000;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    constexpr const char kFlag[] = "--fuzz_traces=";
    if (std::strncmp(argv[i], kFlag, sizeof(kFlag) - 1) == 0) {
      traces = std::atoll(argv[i] + sizeof(kFlag) - 1);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (traces > 0 && fuzz(traces) > 0) return 1;
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
