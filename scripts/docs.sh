#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) into build/site with
# every warning an error: broken links and anchors, pages left out of the
# navigation, docstrings griffe cannot read, a stale configuration reference.
# Needs scripts/setup.sh to have run (the .venv with zcore installed).
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/python -m pip install -q -r requirements-docs.txt
# The configuration reference is generated from the schema of the installed zcore.
.venv/bin/python scripts/gen_config_reference.py --check
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
