#!/usr/bin/env bash
# Creates the virtual environment (runtime requirements only) if needed and runs the main job on CPU:
# the built-in demo (warm start, CoPE training, evaluation and plot) in runs/demo (resumed if present).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/venv.sh
ensure_venv requirements.txt
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
WORKDIR="${WORKDIR:-runs/demo}"
"$PY" -m launch.train --config=configs/demo.py --workdir="$WORKDIR" "$@"
# the evaluation gets the same config overrides (a run directory refuses a different config)
overrides=()
for arg in "$@"; do [[ "$arg" == --config.* ]] && overrides+=("$arg"); done
"$PY" -m launch.eval --config=configs/demo.py --workdir="$WORKDIR" "${overrides[@]}"
echo "report: $WORKDIR/eval.md   curves: $WORKDIR/learning_curves.png"
