// A 64-bit value as 16 lowercase hex digits: the random part of swap file
// names (swap_file.cpp) and the checksums that swap_manager.cpp reports.
#pragma once

#include <cstdint>
#include <string>

namespace zcore {

inline std::string hex(std::uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = digits[v & 0xf];
  return out;
}

}  // namespace zcore
