#include "zcore/build_info.h"

namespace zcore {

const char* io_backend() {
#if defined(ZCORE_WITH_LIBAIO)
  return "libaio";
#else
  return "threadpool";
#endif
}

const char* compiler() { return ZCORE_COMPILER; }

}  // namespace zcore
