// What this build of the native core was compiled with.
#pragma once

namespace zcore {

// "libaio" or "threadpool": the backend the I/O engine is built on.
const char* io_backend();
// Compiler id and version, e.g. "GNU 12.2.0".
const char* compiler();

}  // namespace zcore
