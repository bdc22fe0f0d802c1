#!/usr/bin/env bash
# The Python tests against another torch than CI's 2.13.0, in a virtual
# environment of its own (.venv-torch<version>): zcore supports torch >= 2.4,
# and the lent GPU machine runs 2.11.0. scripts/setup.sh must have run (the
# system packages). PyPI's torch for Linux is a CUDA build (about 4 GB with its
# CUDA libraries), which runs on the CPU as well.
#   scripts/test_torch.sh                  # torch 2.11.0, the whole suite
#   TORCH_VERSION=2.4.1 scripts/test_torch.sh tests/python/test_engine.py
set -euo pipefail
cd "$(dirname "$0")/.."

version=${TORCH_VERSION:-2.11.0}
venv=.venv-torch$version
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$version"
"$venv/bin/python" -m pip install -q -r requirements-dev.txt
"$venv/bin/python" -m pip install -q --no-build-isolation -Cbuild-dir="build/torch$version" .
"$venv/bin/python" -c "import torch, zcore; print('torch', torch.__version__, 'zcore', zcore.__version__)"
"$venv/bin/python" -m pytest "$@"
