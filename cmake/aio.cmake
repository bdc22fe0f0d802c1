# Finds libaio (Debian ships no pkg-config file for it) unless the
# thread-pool fallback was chosen explicitly.
if(ZCORE_AIO STREQUAL "LIBAIO")
  find_path(LIBAIO_INCLUDE_DIR libaio.h)
  # Prefer the static archive so the wheel does not depend on libaio.so.1.
  find_library(LIBAIO_LIBRARY NAMES libaio.a aio)
  if(NOT LIBAIO_INCLUDE_DIR OR NOT LIBAIO_LIBRARY)
    message(FATAL_ERROR
      "libaio was not found. Install it (Debian/Ubuntu: apt-get install libaio-dev; "
      "Fedora/RHEL: dnf install libaio-devel), or build the pread/pwrite fallback "
      "engine with -DZCORE_AIO=THREADPOOL (pip: -Ccmake.define.ZCORE_AIO=THREADPOOL).")
  endif()
  add_library(zcore_libaio INTERFACE)
  target_include_directories(zcore_libaio INTERFACE ${LIBAIO_INCLUDE_DIR})
  target_link_libraries(zcore_libaio INTERFACE ${LIBAIO_LIBRARY})
  message(STATUS "zcore: I/O engine on libaio (${LIBAIO_LIBRARY})")
elseif(ZCORE_AIO STREQUAL "THREADPOOL")
  message(STATUS "zcore: I/O engine on the pread/pwrite thread-pool fallback")
else()
  message(FATAL_ERROR "ZCORE_AIO must be LIBAIO or THREADPOOL, not '${ZCORE_AIO}'.")
endif()
