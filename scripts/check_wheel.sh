#!/usr/bin/env bash
# Builds the wheel users install (isolated build, as on PyPI), installs it
# into a fresh virtual environment and checks that it imports and works there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The system packages the build links (libaio); also makes sure the Python
# used below can create virtual environments.
scripts/setup.sh

rm -rf dist build/wheel-venv
"${PYTHON:-python3}" -m venv build/wheel-venv
# The fresh environment's own pip builds the wheel: the system Python may have
# none (Debian ships pip separately).
build/wheel-venv/bin/python -m pip wheel . -w dist --no-deps -q
wheel=$(ls dist/zcore-*.whl)
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1))"

build/wheel-venv/bin/python -m pip install -q torch==2.13.0 numpy
build/wheel-venv/bin/python -m pip install -q "$wheel"
so=$(build/wheel-venv/bin/python -c "import zcore._C as c; print(c.__file__)" 2>/dev/null || true)
[ -n "$so" ] || { echo "zcore._C did not import from the wheel"; exit 1; }
echo "external libraries of $(basename "$so"):"
readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/  \1/p'
# Run from / so that the source tree's python/ cannot shadow the wheel.
(cd / && "$OLDPWD/build/wheel-venv/bin/python" "$OLDPWD/scripts/wheel_smoke.py")
