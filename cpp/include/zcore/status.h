// Error contract of the native core.
//
// Runtime conditions (bad arguments, an exhausted arena, an unknown handle,
// CUDA missing, I/O failures) are reported as a zcore::Error carrying a
// StatusCode, a message that names the values involved, and named details
// that the bindings pass on to the Python exception as attributes. The core
// never asserts, prints or exits on such conditions.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace zcore {

enum class StatusCode {
  kInvalidArgument,  // a caller passed a value the API does not accept
  kOutOfArena,       // no free range large enough, even after compaction
  kInvalidHandle,    // unknown, already freed, or from another arena
  kOutOfBudget,      // a host-memory byte budget would be exceeded
  kCudaUnavailable,  // built without CUDA, or no usable GPU/driver
  kCudaError,        // a CUDA runtime call failed
  kSystemError,      // an OS call failed (errno in the details)
  kInvalidState,     // a call that the object's current state does not allow (protocol misuse)
  kIoError,          // a file read or write failed (path, offset, errno in the details)
  kNoSpace,          // a write or a planned swap size does not fit on the filesystem
  kShortRead,        // a file ended before the bytes a read asked for (truncated under it)
  kFileTooSmall,     // a read asks for bytes past the end of the file
  kSwapFileLost,     // a swap file was deleted or replaced: the bytes swapped out are gone
  kSwapCorrupted,    // bytes swapped in differ from those swapped out (checksum mismatch)
};

const char* status_code_name(StatusCode code);

using ErrorDetail = std::variant<std::int64_t, std::string>;

class Error : public std::exception {
 public:
  Error(StatusCode code, std::string message,
        std::vector<std::pair<std::string, ErrorDetail>> details = {})
      : code_(code), message_(std::move(message)), details_(std::move(details)) {}

  StatusCode code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }
  const std::vector<std::pair<std::string, ErrorDetail>>& details() const noexcept {
    return details_;
  }

 private:
  StatusCode code_;
  std::string message_;
  std::vector<std::pair<std::string, ErrorDetail>> details_;
};

}  // namespace zcore
