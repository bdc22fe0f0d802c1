// Fused CPU Adam against the memory-bandwidth ceiling of its access pattern,
// and the cost of handing work to threads (persistent pool vs a std::thread
// per call). Run alone, e.g.
//   build/py/bench/cpp/bench_adam --benchmark_min_time=0.2
// bench/cpu_adam.py runs BM_AdamPatternCeiling from this binary to put a
// bandwidth ceiling next to its Python-level comparison.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "zcore/adam.h"
#include "zcore/thread_pool.h"

namespace {

constexpr std::int64_t kBytesPerParam = 28;  // read p, g, m, v; write p, m, v (fp32)
constexpr std::int64_t kChunk = 1 << 16;

struct Fp32State {
  std::vector<float> p, g, m, v;
  explicit Fp32State(std::int64_t n) : p(n, 0.5f), g(n, 1e-3f), m(n, 0.0f), v(n, 0.0f) {}
};

// The Adam access pattern with trivial arithmetic: what the memory system
// allows for 4 streams read and 3 written, on the same thread count.
void BM_AdamPatternCeiling(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  Fp32State s(n);
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  for (auto _ : state) {
    zcore::parallel_for(chunks, threads, [&](std::int64_t c) {
      const std::int64_t end = std::min(n, (c + 1) * kChunk);
      float* __restrict p = s.p.data();
      const float* __restrict g = s.g.data();
      float* __restrict m = s.m.data();
      float* __restrict v = s.v.data();
      for (std::int64_t i = c * kChunk; i < end; ++i) {
        m[i] = 0.9f * m[i] + g[i];
        v[i] = 0.99f * v[i] + g[i];
        p[i] = p[i] - 1e-3f * m[i] + v[i];
      }
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * kBytesPerParam);
}
BENCHMARK(BM_AdamPatternCeiling)
    ->ArgsProduct({{100'000'000}, {1, 2, 4, 8, 16}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_AdamStepFp32(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  Fp32State s(n);
  zcore::AdamOptions o;
  o.weight_decay = 0.01;
  o.decoupled_weight_decay = true;
  zcore::AdamTensor t;
  t.params = s.p.data();
  t.grads = s.g.data();
  t.exp_avg = s.m.data();
  t.exp_avg_sq = s.v.data();
  t.numel = n;
  for (auto _ : state) {
    zcore::adam_step(o, {t}, static_cast<int>(state.range(1)));
    ++o.step;
  }
  state.SetBytesProcessed(state.iterations() * n * kBytesPerParam);
}
BENCHMARK(BM_AdamStepFp32)
    ->Args({100'000'000, 2})
    ->Args({100'000'000, 1})
    ->Args({1'000'000, 2})
    ->Args({65'536, 2})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Mixed precision: bf16 grads in, fp32 master and states, bf16 params out
// (also 28 bytes per parameter: 14 read, 14 written).
void BM_AdamStepBf16(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  Fp32State s(n);
  std::vector<std::uint16_t> g(n, 0x3A83), out(n);
  zcore::AdamOptions o;
  zcore::AdamTensor t;
  t.params = s.p.data();
  t.grads = g.data();
  t.grad_dtype = zcore::DType::kBFloat16;
  t.exp_avg = s.m.data();
  t.exp_avg_sq = s.v.data();
  t.params_out = out.data();
  t.out_dtype = zcore::DType::kBFloat16;
  t.numel = n;
  for (auto _ : state) {
    zcore::adam_step(o, {t}, static_cast<int>(state.range(1)));
    ++o.step;
  }
  state.SetBytesProcessed(state.iterations() * n * kBytesPerParam);
}
BENCHMARK(BM_AdamStepBf16)->Args({100'000'000, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

// Handing 2 tasks to 2 threads: a persistent pool (what the kernels use)...
void BM_DispatchPool(benchmark::State& state) {
  std::vector<std::int64_t> sink(2);
  for (auto _ : state) {
    zcore::parallel_for(2, 2, [&](std::int64_t i) { sink[static_cast<std::size_t>(i)] += i; });
  }
  benchmark::DoNotOptimize(sink.data());
}
BENCHMARK(BM_DispatchPool)->Unit(benchmark::kMicrosecond)->UseRealTime();

// ...against creating and joining a thread per call.
void BM_DispatchSpawn(benchmark::State& state) {
  std::vector<std::int64_t> sink(2);
  for (auto _ : state) {
    std::thread helper([&] { sink[1] += 1; });
    sink[0] += 0;
    helper.join();
  }
  benchmark::DoNotOptimize(sink.data());
}
BENCHMARK(BM_DispatchSpawn)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
