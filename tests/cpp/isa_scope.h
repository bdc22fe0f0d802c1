// The CPU ISA levels for kernel tests that run every level: the list of
// levels, those this CPU supports, and a scope that forces one.
#pragma once

#include <vector>

#include "zcore/cpu_isa.h"

namespace zcore::testing_support {

inline std::vector<CpuIsa> all_isas() { return {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}; }

inline std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : all_isas()) {
    if (cpu_isa_supported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Forces an ISA level for one scope, restoring the previous one.
class IsaScope {
 public:
  explicit IsaScope(CpuIsa isa) : previous_(active_cpu_isa()) { set_cpu_isa(isa); }
  ~IsaScope() { set_cpu_isa(previous_); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;

 private:
  CpuIsa previous_;
};

}  // namespace zcore::testing_support
