#!/usr/bin/env bash
# Creates the virtual environment (runtime requirements only) if needed and runs the main job on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/venv.sh
ensure_venv requirements.txt
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$PY" -m launch.smoke "$@"
