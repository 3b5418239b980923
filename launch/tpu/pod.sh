#!/usr/bin/env bash
# Cloud TPU VM slices (one or many hosts): create, set up every worker, bring the checkpoint,
# train / evaluate on all workers with the same flags, delete. Every host runs the same program
# (launch.train --multihost: jax.distributed detects the slice's hosts by itself).
#
#   launch/tpu/pod.sh [--dry-run] create  NAME ZONE ACCELERATOR [RUNTIME]   # e.g. v5p-32 v2-alpha-tpuv5
#   launch/tpu/pod.sh [--dry-run] setup   NAME ZONE                 # copy this checkout, venv, Java 17
#   launch/tpu/pod.sh [--dry-run] mount   NAME ZONE BUCKET DIR      # gcsfuse-mount a bucket on every worker
#   launch/tpu/pod.sh [--dry-run] copy    NAME ZONE SRC DST         # gcloud storage cp -r SRC DST on every worker
#   launch/tpu/pod.sh [--dry-run] train   NAME ZONE -- LAUNCH_TRAIN_FLAGS...
#   launch/tpu/pod.sh [--dry-run] eval    NAME ZONE -- LAUNCH_EVAL_FLAGS...
#   launch/tpu/pod.sh [--dry-run] delete  NAME ZONE
#
# --workdir must be on storage every worker sees (the mounted bucket): Orbax writes each host's
# shards of a checkpoint into the same step directory. --dry-run prints the gcloud commands.
set -euo pipefail

REMOTE_DIR="cope_jax"  # the checkout's directory in each worker's home
DEFAULT_RUNTIME="tpu-ubuntu2204-base"

# shellcheck source=launch/common.sh
source "$(dirname "$0")/../common.sh"

shift "$DRY_RUN"

# on every worker of the slice, from the checkout's directory
on_all() {
  local name="$1" zone="$2" cmd="$3"
  run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="cd ~/$REMOTE_DIR && $cmd"
}

# the launch binary's flags, quoted for the remote shell
quoted() {
  local out=""
  for arg in "$@"; do out+=" $(printf '%q' "$arg")"; done
  printf '%s' "$out"
}

(( $# >= 1 )) || usage
op="$1"
shift
case "$op" in
  create)
    (( $# == 3 || $# == 4 )) || usage
    run gcloud compute tpus tpu-vm create "$1" --zone="$2" --accelerator-type="$3" --version="${4:-$DEFAULT_RUNTIME}"
    ;;
  setup)
    (( $# == 2 )) || usage
    repo="$(cd "$(dirname "$0")/../.." && pwd)"
    run gcloud compute tpus tpu-vm ssh "$1" --zone="$2" --worker=all --command="mkdir -p ~/$REMOTE_DIR"
    run gcloud compute tpus tpu-vm scp --recurse --zone="$2" --worker=all \
      "$repo/configs" "$repo/cope_jax" "$repo/envs" "$repo/launch" "$repo/models" \
      "$repo"/requirements*.txt "$1:~/$REMOTE_DIR/"
    on_all "$1" "$2" "sudo apt-get update -q && sudo apt-get install -y -q openjdk-17-jre-headless python3-venv \
&& python3 -m venv .venv && .venv/bin/pip install -q -r requirements-tpu.txt -r requirements-envs.txt"
    ;;
  mount)
    (( $# == 4 )) || usage
    on_all "$1" "$2" "mkdir -p $(printf '%q' "$4") && gcsfuse --implicit-dirs $(printf '%q' "$3") $(printf '%q' "$4")"
    ;;
  copy)
    (( $# == 4 )) || usage
    on_all "$1" "$2" "gcloud storage cp -r $(printf '%q' "$3") $(printf '%q' "$4")"
    ;;
  train|eval)
    (( $# >= 3 )) && [[ "$3" == "--" ]] || usage
    name="$1" zone="$2"
    shift 3
    (( $# >= 1 )) || usage
    on_all "$name" "$zone" ".venv/bin/python -m launch.$op --multihost$(quoted "$@")"
    ;;
  delete)
    (( $# == 2 )) || usage
    run gcloud compute tpus tpu-vm delete "$1" --zone="$2" --quiet
    ;;
  *)
    usage
    ;;
esac
