#!/usr/bin/env bash
# Runs zcore's demonstration on a fresh machine (set-up and build first): a
# small GPT trained with ZeRO-3 on two local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
# ZeRO-3 on 2 local ranks, started through torch's launcher (zcore demo --help).
.venv/bin/zcore demo "$@"
