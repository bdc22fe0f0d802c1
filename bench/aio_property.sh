#!/usr/bin/env bash
# The I/O engine's property test (tests/cpp/test_aio_engine_property.cpp) run
# far longer than in CI: many more rounds and several seeds, for each backend,
# in the release build (build/py) and in the sanitizer build (build/asan,
# configured as scripts/sanitize.sh does: ASan + UBSan, any report fails).
# Prints one row per build and backend: build, backend, seeds, rounds (per
# seed), seconds (all seeds), result; exits non-zero when any run failed, and
# names the log and the command that replays it.
#
#   bench/aio_property.sh [--rounds N] [--seeds "1 2 3"] [--builds "release asan"]
#
# Defaults: 2000 rounds, seeds 1 2 3 4, both builds (roughly 10 minutes on a
# 2-core machine). Needs scripts/setup.sh to have run (build/py and .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=2000
seeds="1 2 3 4"
builds="release asan"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --builds) builds="$2"; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--seeds \"1 2 3\"] [--builds \"release asan\"]" >&2; exit 2 ;;
  esac
done

target=test_aio_engine_property
logs="$PWD/build/aio-property-logs"
mkdir -p "$logs"

build_dir() {  # the build tree of a build name; builds the test binary there
  case "$1" in
    release) echo build/py ;;
    asan) echo build/asan ;;
    *) echo "unknown build '$1' (release or asan)" >&2; exit 2 ;;
  esac
}

prepare() {
  local dir
  dir="$(build_dir "$1")"
  if [[ "$1" == asan && ! -f build/asan/CMakeCache.txt ]]; then
    cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DZCORE_SANITIZE=address,undefined -DZCORE_CUDA=OFF -DZCORE_BUILD_TESTS=ON \
      -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
      -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
  fi
  cmake --build "$dir" -j2 --target "$target" >/dev/null
}

# Runs every seed of one build and backend; prints the table row.
run_row() {
  local build="$1" backend="$2" dir start seconds result="pass" seed log out
  dir="$(build_dir "$build")"
  start=$(date +%s.%N)
  for seed in $seeds; do
    log="$logs/$build-$backend-seed$seed.log"
    # The test's scratch files go to its working directory: the build tree
    # (a real disk, where O_DIRECT works), as under ctest.
    if ! (cd "$dir/tests/cpp" &&
          ZCORE_AIO_PROPERTY_SEED="$seed" ZCORE_AIO_PROPERTY_ROUNDS="$rounds" \
          ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
          "./$target" --gtest_filter="*/$backend") >"$log" 2>&1; then
      result="FAIL (seed $seed; $log)"
      failures+=("(cd $dir/tests/cpp && ZCORE_AIO_PROPERTY_SEED=$seed ZCORE_AIO_PROPERTY_ROUNDS=$rounds ./$target --gtest_filter='*/$backend')")
      break
    fi
    if grep -q '\[  SKIPPED \]' "$log"; then
      out="$(grep -m1 -A1 'Skipped' "$log" | tail -1)"
      result="skipped: ${out:-see $log}"
      break
    fi
  done
  seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%-8s %-11s %-12s %7s %8s  %s\n' "$build" "$backend" "${seeds// /,}" "$rounds" "$seconds" "$result"
}

failures=()
for build in $builds; do prepare "$build"; done
printf '%-8s %-11s %-12s %7s %8s  %s\n' build backend seeds rounds seconds result
for build in $builds; do
  for backend in libaio threadpool; do run_row "$build" "$backend"; done
done
if [[ ${#failures[@]} -gt 0 ]]; then
  echo "replay (from the repository root):" >&2
  printf '  %s\n' "${failures[@]}" >&2
  exit 1
fi
