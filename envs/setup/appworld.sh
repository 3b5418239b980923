#!/usr/bin/env bash
# AppWorld's own interpreter: the `appworld` package pins pydantic 1 (and its own FastAPI stack),
# which the main stack (pydantic 2) cannot share, so its pool workers run under this venv.
#
#   envs/setup/appworld.sh [VENV (.venv-appworld)] [APPWORLD_ROOT (./appworld-root)]
#
# then, for training / evaluation:
#   export COPE_ENV_PYTHON_APPWORLD=<VENV>/bin/python APPWORLD_ROOT=<APPWORLD_ROOT>
#
# `appworld install` unpacks the apps shipped in the package; `appworld download data` fetches the
# tasks and databases from AppWorld's release (not a package index): where that cannot reach the
# network, copy a `data/` folder obtained elsewhere into APPWORLD_ROOT. Without it the family
# fails at start naming the missing folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${1:-.venv-appworld}"
root="$(mkdir -p "${2:-appworld-root}" && cd "${2:-appworld-root}" && pwd)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "appworld==0.1.3.post1"
(cd "$root" && APPWORLD_ROOT="$root" "$venv/bin/appworld" install)
if [ ! -d "$root/data/tasks" ]; then
  (cd "$root" && APPWORLD_ROOT="$root" "$venv/bin/appworld" download data) || \
    echo "AppWorld's data could not be downloaded: put its data/ folder under $root" >&2
fi
echo "export COPE_ENV_PYTHON_APPWORLD=$(cd "$venv" && pwd)/bin/python APPWORLD_ROOT=$root"
