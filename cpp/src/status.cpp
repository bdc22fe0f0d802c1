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
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kNoSpace: return "NoSpace";
    case StatusCode::kShortRead: return "ShortRead";
    case StatusCode::kFileTooSmall: return "FileTooSmall";
    case StatusCode::kSwapFileLost: return "SwapFileLost";
    case StatusCode::kSwapCorrupted: return "SwapCorrupted";
  }
  return "Unknown";
}

}  // namespace zcore
