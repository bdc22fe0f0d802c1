#!/usr/bin/env bash
# Runs zcore's demonstration on a fresh machine (set-up and build first).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
