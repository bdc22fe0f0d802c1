# ZCORE_SANITIZE builds everything compiled here (core, tests, the Python
# module) with GCC/Clang sanitizers. A report fails the program: UBSan does
# not recover, and ASan stops at the first error by default.
set(ZCORE_SANITIZE "" CACHE STRING "Sanitizers for a checking build: empty, address, undefined or address,undefined")
set_property(CACHE ZCORE_SANITIZE PROPERTY STRINGS "" address undefined "address,undefined")
if(ZCORE_SANITIZE)
  if(NOT ZCORE_SANITIZE MATCHES "^(address|undefined|address,undefined|undefined,address)$")
    message(FATAL_ERROR "ZCORE_SANITIZE must be empty, address, undefined or address,undefined, not '${ZCORE_SANITIZE}'.")
  endif()
  # CXX only: nvcc does not take -fsanitize (the sanitizer build has ZCORE_CUDA=OFF).
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${ZCORE_SANITIZE};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
  add_link_options("-fsanitize=${ZCORE_SANITIZE}")
  message(STATUS "zcore: sanitizers ${ZCORE_SANITIZE}")
endif()
