#include "zcore/status.h"

namespace zcore {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kOutOfArena: return "OutOfArena";
    case StatusCode::kInvalidHandle: return "InvalidHandle";
    case StatusCode::kOutOfBudget: return "OutOfBudget";
    case StatusCode::kCudaUnavailable: return "CudaUnavailable";
    case StatusCode::kCudaError: return "CudaError";
    case StatusCode::kSystemError: return "SystemError";
    case StatusCode::kInvalidState: return "InvalidState";
  }
  return "Unknown";
}

}  // namespace zcore
