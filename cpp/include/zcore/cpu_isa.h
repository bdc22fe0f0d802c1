// Which SIMD instruction set the CPU kernels use, chosen at run time.
//
// One binary carries a portable scalar path and, on x86-64, AVX2 and AVX-512
// paths compiled with per-file target flags; the best one the CPU supports is
// used unless the ZCORE_CPU_ISA environment variable (scalar, avx2, avx512),
// read once at the first kernel call, or set_cpu_isa() says otherwise. Tests
// force each level the CPU supports in turn.
#pragma once

#include <string>

namespace zcore {

enum class CpuIsa : int {
  kScalar = 0,  // portable C++, any CPU
  kAvx2 = 1,    // AVX2 + FMA + F16C (Haswell, Zen 1 and later)
  kAvx512 = 2,  // AVX-512 F/BW/VL (Skylake-SP, Ice Lake, Zen 4 and later)
};

const char* cpu_isa_name(CpuIsa isa);

// "scalar", "avx2" or "avx512"; throws Error(kInvalidArgument) otherwise.
CpuIsa parse_cpu_isa(const std::string& name);

// Whether this build contains the level and this CPU (and OS) can run it.
bool cpu_isa_supported(CpuIsa isa);

// The highest supported level.
CpuIsa best_cpu_isa();

// The level the kernels use now. The first call reads ZCORE_CPU_ISA and
// throws Error(kInvalidArgument) if it names an unknown or unsupported level.
CpuIsa active_cpu_isa();

// Forces a level for every later kernel call; throws Error(kInvalidArgument)
// if the CPU or the build does not support it.
void set_cpu_isa(CpuIsa isa);

}  // namespace zcore
