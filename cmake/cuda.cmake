# Decides ZCORE_WITH_CUDA from ZCORE_CUDA and enables the CUDA language.
set(ZCORE_WITH_CUDA OFF)
if(NOT ZCORE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(ZCORE_WITH_CUDA ON)
  elseif(ZCORE_CUDA STREQUAL "ON")
    message(FATAL_ERROR
      "ZCORE_CUDA=ON but no CUDA compiler was found. Put nvcc on PATH "
      "(or set CMAKE_CUDA_COMPILER), or configure with -DZCORE_CUDA=AUTO/OFF.")
  endif()
endif()

if(ZCORE_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  # Static runtime: the wheel then needs only the driver (libcuda), which is
  # loaded at run time, so import works on machines with no GPU.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "zcore: CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
else()
  message(STATUS "zcore: building without CUDA")
endif()
