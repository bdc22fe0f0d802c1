// Microbenchmarks of the contiguous allocator's bookkeeping (no bytes move):
// per-call latency of allocate/free on ZeRO-3 parameter-group size mixes,
// in a steady state with N live blocks, with and without alignment, and the
// cost of planning a compaction.
//
// Sizes are the gathered bf16 bytes of one parameter group of a GPT model
// (the groups bench/arena_replay.py replays), drawn uniformly from the
// model's group list, so layer groups dominate and the embedding is rare.
//
//   build/py/bench/cpp/bench_allocator --benchmark_min_time=0.2
//
// --replay_trace=FILE (written by bench/arena_replay.py) adds BM_ReplayTrace,
// which replays that exact allocate/free sequence, so the Python script can
// set its figures beside the native one for the same sizes.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "zcore/allocator.h"
#include "zcore/status.h"

namespace {

using zcore::BlockHandle;
using zcore::ContiguousAllocator;

struct GptShape {
  std::int64_t vocab;
  std::int64_t positions;
  std::int64_t d;
  std::int64_t layers;
};

constexpr GptShape kGpt2Small{50257, 1024, 768, 12};
constexpr GptShape kGpt1B{50257, 2048, 2048, 24};  // GPT-3 XL shape, 1.3B parameters
constexpr std::int64_t kBf16 = 2;
constexpr std::int64_t kArenaAlignment = 256;  // zcore.Arena's default

// Gathered bf16 bytes of each parameter group, in module order: embedding
// (wte + wpe), per layer ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
// mlp.c_proj, then ln_f and the LM head (tied to wte).
std::vector<std::int64_t> group_bytes(const GptShape& s) {
  const std::int64_t d = s.d;
  std::vector<std::int64_t> elems{s.vocab * d + s.positions * d};
  for (std::int64_t layer = 0; layer < s.layers; ++layer) {
    const std::int64_t layer_groups[] = {2 * d,         d * 3 * d + 3 * d, d * d + d,
                                         2 * d,         d * 4 * d + 4 * d, 4 * d * d + d};
    elems.insert(elems.end(), std::begin(layer_groups), std::end(layer_groups));
  }
  elems.push_back(2 * d);
  elems.push_back(s.vocab * d);
  for (auto& e : elems) e *= kBf16;
  return elems;
}

// The size mixes, selected by the first benchmark argument. GPT group sizes
// are all multiples of 256 B (d is a multiple of 128), so alignment never
// leaves gaps with them; the odd mix adds 1..255 bytes to each size so that
// 256-byte alignment does.
enum Mix : std::int64_t { kGpt2SmallMix = 0, kGpt1BMix = 1, kGpt2SmallOddMix = 2 };

const char* mix_label(std::int64_t mix) {
  switch (mix) {
    case kGpt2SmallMix: return "gpt2-small";
    case kGpt1BMix: return "gpt-1.3b";
    default: return "gpt2-small+odd";
  }
}

// A fixed pseudo-random stream of sizes from a mix, precomputed so the
// timed loops do no RNG work; its length is a power of two for cheap wrap.
constexpr std::size_t kStream = 4096;

std::vector<std::int64_t> size_stream(std::int64_t mix, unsigned seed) {
  const std::vector<std::int64_t> groups = group_bytes(mix == kGpt1BMix ? kGpt1B : kGpt2Small);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> pick(0, groups.size() - 1);
  std::uniform_int_distribution<std::int64_t> odd(0, 127);
  std::vector<std::int64_t> out(kStream);
  for (auto& s : out) {
    s = groups[pick(rng)];
    if (mix == kGpt2SmallOddMix) s += 2 * odd(rng) + 1;
  }
  return out;
}

std::int64_t align_up(std::int64_t v, std::int64_t a) { return (v + a - 1) / a * a; }

// Capacity at which N live blocks of at most `largest` bytes never run out:
// at most N free ranges sit between N - 1 live blocks, and the free bytes
// then exceed N * (largest + alignment), so one range always fits.
std::int64_t steady_capacity(std::int64_t live, std::int64_t largest, std::int64_t alignment) {
  return (2 * live + 1) * (largest + alignment);
}

// Allocator holding `live` blocks drawn from the model's size mix.
struct SteadyState {
  explicit SteadyState(const benchmark::State& state)
      : live(state.range(1)),
        alignment(state.range(2)),
        sizes(size_stream(state.range(0), 1)),
        allocator(steady_capacity(live, *std::max_element(sizes.begin(), sizes.end()),
                                  alignment)) {
    std::mt19937_64 rng(2);
    std::uniform_int_distribution<std::int64_t> pick(0, live - 1);
    for (auto& v : victims) v = static_cast<std::size_t>(pick(rng));
    for (std::int64_t i = 0; i < live; ++i) {
      const std::int64_t bytes = sizes[static_cast<std::size_t>(i) % kStream];
      handles.push_back(allocator.allocate(bytes, alignment));
    }
  }

  std::int64_t live;
  std::int64_t alignment;
  std::vector<std::int64_t> sizes;
  std::size_t victims[kStream];
  ContiguousAllocator allocator;
  std::vector<BlockHandle> handles;
};

void label(benchmark::State& state) {
  state.SetLabel(std::string(mix_label(state.range(0))) + " live=" +
                 std::to_string(state.range(1)) + " align=" + std::to_string(state.range(2)));
}

// Seconds per call (the console prints it with an SI prefix: 95.2n = 95.2 ns).
void set_time_per_call(benchmark::State& state, double calls_per_iteration) {
  state.counters["per_call"] = benchmark::Counter(
      calls_per_iteration,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// Churn: free a random live block, allocate a new one from the mix; the
// live count stays N. One iteration is one free plus one allocate.
void BM_SteadyChurn(benchmark::State& state) {
  SteadyState s(state);
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = i++ & (kStream - 1);
    BlockHandle& victim = s.handles[s.victims[k]];
    s.allocator.free(victim);
    victim = s.allocator.allocate(s.sizes[k], s.alignment);
    benchmark::DoNotOptimize(victim);
  }
  set_time_per_call(state, 2.0);
  label(state);
}

// Allocate and free apart: a batch of allocations on top of the N live
// blocks is timed on its own, then freed (untimed, or timed for BM_Free).
// Freeing the batch restores the exact layout: free ranges are the maximal
// gaps between live blocks, so they depend only on the live set.
constexpr std::size_t kBatch = 64;

void BM_Allocate(benchmark::State& state) {
  SteadyState s(state);
  std::vector<BlockHandle> batch(kBatch);
  std::size_t i = 0;
  for (auto _ : state) {
    for (auto& h : batch) h = s.allocator.allocate(s.sizes[i++ & (kStream - 1)], s.alignment);
    state.PauseTiming();
    for (auto h : batch) s.allocator.free(h);
    state.ResumeTiming();
  }
  set_time_per_call(state, kBatch);
  label(state);
}

void BM_Free(benchmark::State& state) {
  SteadyState s(state);
  std::vector<BlockHandle> batch(kBatch);
  std::mt19937_64 rng(3);
  std::size_t i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (auto& h : batch) h = s.allocator.allocate(s.sizes[i++ & (kStream - 1)], s.alignment);
    std::shuffle(batch.begin(), batch.end(), rng);
    state.ResumeTiming();
    for (auto h : batch) s.allocator.free(h);
  }
  set_time_per_call(state, kBatch);
  label(state);
}

void steady_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t mix : {kGpt2SmallMix, kGpt1BMix, kGpt2SmallOddMix}) {
    for (std::int64_t live : {8, 64, 1024}) {
      for (std::int64_t alignment : {std::int64_t{1}, kArenaAlignment}) {
        b->Args({mix, live, alignment});
      }
    }
  }
  b->ArgNames({"mix", "live", "align"});
}

BENCHMARK(BM_SteadyChurn)->Apply(steady_args);
BENCHMARK(BM_Allocate)->Apply(steady_args);
BENCHMARK(BM_Free)->Apply(steady_args);

// Planning a compaction of N live blocks that alternate with N holes (the
// worst case: every live block moves). The arena is exactly the
// size of the 2N blocks; rebuilding the fragmented layout is untimed.
void BM_DefragmentPlan(benchmark::State& state) {
  const std::int64_t live = state.range(1);
  const std::vector<std::int64_t> sizes = size_stream(state.range(0), 4);
  std::int64_t capacity = 0;
  for (std::int64_t i = 0; i < 2 * live; ++i) {
    capacity += align_up(sizes[static_cast<std::size_t>(i) % kStream], kArenaAlignment);
  }
  std::size_t moves = 0;
  std::uint64_t moved = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto allocator = std::make_unique<ContiguousAllocator>(capacity);
    std::vector<BlockHandle> handles;
    for (std::int64_t i = 0; i < 2 * live; ++i) {
      handles.push_back(
          allocator->allocate(sizes[static_cast<std::size_t>(i) % kStream], kArenaAlignment));
    }
    for (std::size_t i = 0; i < handles.size(); i += 2) allocator->free(handles[i]);
    state.ResumeTiming();
    const std::vector<zcore::Move> plan = allocator->defragment();
    state.PauseTiming();
    moves = plan.size();
    moved = 0;
    for (const auto& m : plan) moved += m.bytes;
    allocator.reset();  // destruction stays out of the timed region
    state.ResumeTiming();
  }
  state.counters["moves"] = static_cast<double>(moves);
  state.counters["MiB_moved"] = static_cast<double>(moved) / (1 << 20);
  state.counters["per_live_block"] = benchmark::Counter(
      static_cast<double>(live),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(mix_label(state.range(0))) + " live=" + std::to_string(live));
}

BENCHMARK(BM_DefragmentPlan)
    ->ArgsProduct({{kGpt2SmallMix, kGpt1BMix}, {64, 1024}})
    ->ArgNames({"mix", "live"});

// A recorded allocate/free sequence: "capacity BYTES" on the first line,
// then "a SLOT BYTES ALIGNMENT" or "f SLOT" per call.
struct TraceOp {
  bool allocate;
  std::size_t slot;
  std::int64_t bytes;
  std::int64_t alignment;
};

struct Trace {
  std::int64_t capacity = 0;
  std::size_t slots = 0;
  std::vector<TraceOp> ops;
};

bool read_trace(const std::string& path, Trace& trace, std::string& error) {
  std::ifstream in(path);
  if (!in) {
    error = "cannot open replay trace " + path;
    return false;
  }
  std::string word;
  if (!(in >> word >> trace.capacity) || word != "capacity" || trace.capacity <= 0) {
    error = path + ": the first line must be 'capacity BYTES'";
    return false;
  }
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    TraceOp op{};
    std::string kind;
    fields >> kind >> op.slot;
    op.allocate = kind == "a";
    if (op.allocate) fields >> op.bytes >> op.alignment;
    if (!fields || (kind != "a" && kind != "f")) {
      error = path + ": cannot parse line '" + line + "'";
      return false;
    }
    trace.slots = std::max(trace.slots, op.slot + 1);
    trace.ops.push_back(op);
  }
  return true;
}

void BM_ReplayTrace(benchmark::State& state, const Trace* trace) {
  ContiguousAllocator allocator(trace->capacity);
  std::vector<BlockHandle> slots(trace->slots);
  for (auto _ : state) {
    try {
      for (const TraceOp& op : trace->ops) {
        if (op.allocate) {
          slots[op.slot] = allocator.allocate(op.bytes, op.alignment);
        } else {
          allocator.free(slots[op.slot]);
        }
      }
    } catch (const zcore::Error& e) {
      state.SkipWithError(e.what());
      break;
    }
    benchmark::DoNotOptimize(slots.data());
  }
  if (!state.error_occurred() && allocator.stats().live_blocks != 0) {
    state.SkipWithError("the trace leaves blocks live; each pass must free what it allocates");
  }
  set_time_per_call(state, static_cast<double>(trace->ops.size()));
  state.SetLabel(std::to_string(trace->ops.size()) + " calls");
}

}  // namespace

int main(int argc, char** argv) {
  // Our flag is taken out before Google Benchmark sees the rest.
  const char* const kTraceFlag = "--replay_trace=";
  std::string trace_path;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], kTraceFlag, std::strlen(kTraceFlag)) == 0) {
      trace_path = argv[i] + std::strlen(kTraceFlag);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;

  Trace trace;
  if (!trace_path.empty()) {
    std::string error;
    if (!read_trace(trace_path, trace, error)) {
      std::fprintf(stderr, "bench_allocator: %s\n", error.c_str());
      return 2;
    }
    benchmark::RegisterBenchmark("BM_ReplayTrace", BM_ReplayTrace, &trace);
  }

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
