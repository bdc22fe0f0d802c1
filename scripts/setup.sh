#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine for zcore and builds it into .venv:
# system packages, a virtual environment with torch 2.13.0 (CPU wheel) and the
# dev tools, then an incremental build of the package with its C++ tests and
# microbenchmarks (persistent build dir: build/py).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(libaio-dev libgtest-dev libbenchmark-dev ninja-build)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "zcore setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  $sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Pinned: an unpinned torch pulls the newest CUDA build (gigabytes).
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements-dev.txt

.venv/bin/python -m pip install -q --no-build-isolation \
  -Cbuild-dir=build/py \
  -Ccmake.define.ZCORE_BUILD_TESTS=ON \
  -Ccmake.define.ZCORE_BUILD_BENCH=ON \
  .
