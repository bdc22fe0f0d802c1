#!/usr/bin/env bash
# The native core under AddressSanitizer and UndefinedBehaviorSanitizer: the
# C++ tests, then the Python tests that drive the native core, against a
# sanitizer build of zcore._C (build/asan; the .venv install is untouched).
# Any report fails the run. Needs scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."

# CUDA off: nvcc takes no -fsanitize, and no GPU runs here anyway.
cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DZCORE_SANITIZE=address,undefined -DZCORE_CUDA=OFF -DZCORE_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
  -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
cmake --build build/asan -j2

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 \
  ctest --test-dir build/asan --output-on-failure --no-tests=error -j2

# The package with the sanitizer build of its module, ahead of .venv's on the path.
rm -rf build/asan/site
mkdir -p build/asan/site
cp -r python/zcore build/asan/site/
# A module already in the tree (a developer's link to .venv's build) would
# take the copy below through the link: removed first.
rm -f build/asan/site/zcore/_C*.so
cp build/asan/bindings/_C*.so build/asan/site/zcore/
# Python is not built with ASan, so its runtime is preloaded, with libstdc++
# ahead of torch's loading (ASan's __cxa_throw interceptor needs it at start).
# Leak checking is off: CPython and torch keep memory until exit by design.
native_tests=(test_aio.py test_swap.py test_arena.py test_host_memory.py test_coordinator_bindings.py
  test_cpu_adam.py test_fused_optimizer_kernels.py test_direct_file.py test_tensor_file.py)
echo "zcore sanitize: pytest on ${native_tests[*]} (the training and checkpoint tests also pass" \
  "under this build, in 5 minutes more: scripts/sanitize.sh runs only the native-core files)"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 PYTHONPATH=build/asan/site \
  .venv/bin/python -m pytest -q -p no:cacheprovider "${native_tests[@]/#/tests/python/}"
