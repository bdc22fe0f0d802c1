#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine for zcore and builds it into .venv:
# system packages (as root, or through sudo), a virtual environment with torch
# 2.13.0 and the dev tools, then an incremental build of the package with its
# C++ tests and microbenchmarks (persistent build dir: build/py).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "zcore setup: $*" >&2
  exit 1
}

python=${PYTHON:-python3}
command -v "$python" >/dev/null || fail "no '$python' on PATH: install Python 3.9 or newer (apt-get install -y python3), or set PYTHON to one"
# One question to the interpreter: its version, whether it has its C headers
# (the build needs Python.h) and its prefix (last: it may hold spaces).
facts=$("$python" -c '
import os, sys, sysconfig
headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print("%d.%d" % sys.version_info[:2], int(headers), sys.base_prefix)') \
  || fail "$python does not run: install Python 3.9 or newer, or set PYTHON to one"
read -r py_version py_headers py_prefix <<<"$facts"
[ "$(printf '%s\n3.9\n' "$py_version" | sort -V | head -n1)" = 3.9 ] \
  || fail "$python is Python $py_version: zcore needs 3.9 or newer (set PYTHON to one)"

installed() {
  local status
  status=$(dpkg -s "$1" 2>/dev/null) || return 1
  # dpkg still knows a removed package whose configuration files remain.
  ! grep -q '^Status: ' <<<"$status" || grep -Eq '^Status: [a-z]+ [a-z]+ installed$' <<<"$status"
}

# What the build needs from the system. Tools count as present when they are on
# PATH, however they got there; libraries only when their Debian package is.
missing=()
command -v c++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
if command -v dpkg >/dev/null; then
  for pkg in ninja-build libaio-dev libxxhash-dev libgtest-dev libbenchmark-dev; do
    installed "$pkg" || missing+=("$pkg")
  done
else
  echo "zcore setup: no dpkg (not Debian/Ubuntu): install libaio, xxHash, GoogleTest, Google Benchmark and ninja yourself; the build names what it cannot find" >&2
fi
# Debian's own Python ships venv (ensurepip) and its C headers as separate
# packages; any other Python (pyenv, conda, python.org builds) brings both.
make_venv() {
  [ -x .venv/bin/python ] || "$python" -m venv .venv >/dev/null 2>&1 || { rm -rf .venv; return 1; }
}
if ! make_venv; then
  [ "$py_prefix" = /usr ] || fail "$python ($py_prefix) cannot create a virtual environment ($python -m venv .venv fails): use a Python that can, or set PYTHON to one"
  missing+=("python$py_version-venv")
fi
if [ "$py_headers" = 0 ]; then
  [ "$py_prefix" = /usr ] || fail "$python ($py_prefix) has no C headers (Python.h), which the build needs: use a Python that has them, or set PYTHON to one"
  missing+=("python$py_version-dev")
fi

if ((${#missing[@]})); then
  install_command="apt-get update && apt-get install -y ${missing[*]}"
  command -v apt-get >/dev/null \
    || fail "missing system packages ${missing[*]} (Debian names), and this machine has no apt-get: install their equivalents, then run this again"
  if [ "$(id -u)" -eq 0 ]; then
    as_root() { "$@"; }
  elif command -v sudo >/dev/null; then
    as_root() { sudo "$@"; }
  else
    fail "missing system packages ${missing[*]}; installing them needs root, and you are not root and have no sudo. Ask an administrator to run: $install_command"
  fi
  echo "zcore setup: installing ${missing[*]}"
  # `env` makes the variable an argument, so the same words work with and without sudo.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
    && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || fail "could not install ${missing[*]}: run as root: $install_command"
fi

cmake_version=$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
[ "$(printf '%s\n3.24\n' "$cmake_version" | sort -V | head -n1)" = 3.24 ] \
  || fail "cmake $cmake_version is too old: zcore needs 3.24 or newer (Debian 12 and Ubuntu 24.04 have it)"

make_venv || fail "$python -m venv .venv still fails after installing python$py_version-venv: run it to see why"
# Pinned: an unpinned torch pulls the newest CUDA build (gigabytes).
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements-dev.txt

.venv/bin/python -m pip install -q --no-build-isolation \
  -Cbuild-dir=build/py \
  -Ccmake.define.ZCORE_BUILD_TESTS=ON \
  -Ccmake.define.ZCORE_BUILD_BENCH=ON \
  .
