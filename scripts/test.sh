#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up and build, then the C++
# tests (ctest) and the Python tests (pytest). Fails if any test fails or if
# either runner finds no tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
ctest --test-dir build/py --output-on-failure --no-tests=error -j2
# pytest exits 5 when it collects nothing; set -e turns that into a failure.
.venv/bin/python -m pytest "$@"
