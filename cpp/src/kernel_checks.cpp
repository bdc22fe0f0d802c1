#include "kernel_checks.h"

namespace zcore::kernel_checks {
namespace {

constexpr int kMaxThreads = 1024;

}  // namespace

void invalid(const std::string& message, std::vector<std::pair<std::string, ErrorDetail>> details) {
  throw Error(StatusCode::kInvalidArgument, message, std::move(details));
}

void check_threads(int threads) {
  if (threads < 1 || threads > kMaxThreads) {
    invalid("threads=" + std::to_string(threads) + " is out of range; pass 1.." +
                std::to_string(kMaxThreads) + " (e.g. torch.get_num_threads())",
            {{"threads", std::int64_t{threads}}});
  }
}

void check_pointer(const void* ptr, std::int64_t element_size, const std::string& name) {
  if (ptr == nullptr) invalid(name + " is null", {{"name", name}});
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  if (address % static_cast<std::uintptr_t>(element_size) != 0) {
    invalid(name + " at address " + std::to_string(address) + " is not aligned to its element size " +
                std::to_string(element_size) + "; pass a buffer that starts on an element boundary",
            {{"name", name}, {"address", static_cast<std::int64_t>(address)},
             {"alignment", element_size}});
  }
}

std::string indexed(const char* what, std::size_t index) {
  return std::string(what) + "[" + std::to_string(index) + "]";
}

ByteRange byte_range(std::string name, const void* ptr, std::int64_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  return ByteRange{std::move(name), begin, begin + static_cast<std::uintptr_t>(bytes)};
}

void check_disjoint(const ByteRange& first, const ByteRange& second) {
  if (first.begin < second.end && second.begin < first.end) {
    invalid(first.name + " and " + second.name + " overlap in memory; pass distinct buffers",
            {{"first", first.name}, {"second", second.name}});
  }
}

}  // namespace zcore::kernel_checks
