#include "zcore/cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "zcore/status.h"

namespace zcore {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_active{kUnset};
std::once_flag g_env_once;

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

CpuIsa parse_cpu_isa(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpu_isa_name(isa)) return isa;
  }
  throw Error(StatusCode::kInvalidArgument,
              "unknown CPU ISA level '" + name + "'; use one of: scalar, avx2, avx512",
              {{"isa", name}});
}

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
#if defined(ZCORE_X86_KERNELS)
    // __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state.
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return cpu_isa_supported(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512: return false;
#endif
  }
  return false;
}

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_isa_supported(isa)) return isa;
  }
  return CpuIsa::kScalar;
}

void set_cpu_isa(CpuIsa isa) {
  if (!cpu_isa_supported(isa)) {
    throw Error(StatusCode::kInvalidArgument,
                std::string("CPU ISA level '") + cpu_isa_name(isa) +
                    "' is not supported by this CPU or build; the best supported is '" +
                    cpu_isa_name(best_cpu_isa()) + "'",
                {{"isa", std::string(cpu_isa_name(isa))},
                 {"best", std::string(cpu_isa_name(best_cpu_isa()))}});
  }
  g_active.store(static_cast<int>(isa));
}

CpuIsa active_cpu_isa() {
  std::call_once(g_env_once, [] {
    // An explicit set_cpu_isa() before the first kernel call wins.
    if (g_active.load() != kUnset) return;
    const char* env = std::getenv("ZCORE_CPU_ISA");
    if (env == nullptr || *env == '\0') {
      g_active.store(static_cast<int>(best_cpu_isa()));
      return;
    }
    set_cpu_isa(parse_cpu_isa(env));
  });
  return static_cast<CpuIsa>(g_active.load());
}

}  // namespace zcore
