#!/usr/bin/env bash
# Creates the virtual environment (runtime + test requirements) if needed and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/venv.sh
ensure_venv requirements-dev.txt
ensure_gpu_compiler
export JAX_PLATFORMS=cpu
GLIBC_TUNABLES="$("$PY" -m launch.huge_pages)" && export GLIBC_TUNABLES  # see launch/huge_pages.py
exec "$PY" -m pytest tests -q -n "${PYTEST_WORKERS:-2}" "$@"
