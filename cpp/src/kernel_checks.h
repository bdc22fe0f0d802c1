// Argument checks shared by the kernel entry points (adam.cpp, quantize.cpp):
// each failure throws Error(kInvalidArgument) naming the value and the fix,
// before any kernel starts, so a bad call writes nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "zcore/status.h"

namespace zcore::kernel_checks {

[[noreturn]] void invalid(const std::string& message,
                          std::vector<std::pair<std::string, ErrorDetail>> details = {});

// threads is in 1..1024.
void check_threads(int threads);

// A pointer must be non-null and aligned to its element size.
void check_pointer(const void* ptr, std::int64_t element_size, const std::string& name);

// "what[index]", the name of one entry of a list argument.
std::string indexed(const char* what, std::size_t index);

// A buffer's bytes, named for error messages.
struct ByteRange {
  std::string name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

ByteRange byte_range(std::string name, const void* ptr, std::int64_t bytes);

// Throws when the two ranges share a byte.
void check_disjoint(const ByteRange& first, const ByteRange& second);

}  // namespace zcore::kernel_checks
