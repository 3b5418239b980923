#!/usr/bin/env bash
# NVIDIA GPU hosts: the CUDA jaxlib environment, then launch.train / launch.eval on one host or as
# one process per host of a multi-host run (every host runs this with the same flags).
#
#   launch/gpu/run.sh [--dry-run] setup                                   # .venv with CUDA 12 jax
#   launch/gpu/run.sh [--dry-run] train|eval -- LAUNCH_FLAGS...           # one host, all its GPUs
#   launch/gpu/run.sh [--dry-run] train|eval --coordinator=HOST:PORT --num_hosts=N --host_id=I \
#                                            -- LAUNCH_FLAGS...          # host I of N
#
# HOST:PORT is host 0's address and a free port, reachable from every host. Under Slurm or Open MPI
# jax.distributed detects the hosts: pass --num_hosts=auto and omit the other two. --workdir must be
# on storage every host sees (Orbax writes each host's shards into the same step directory).
# --dry-run prints the commands.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "$0")/../common.sh"
cd "$(dirname "$0")/../.."

shift "$DRY_RUN"

(( $# >= 1 )) || usage
op="$1"
shift
case "$op" in
  setup)
    (( $# == 0 )) || usage
    run python3 -m venv .venv
    run .venv/bin/python -m pip install -q -r requirements-gpu.txt -r requirements-envs.txt
    ;;
  train|eval)
    coordinator="" num_hosts="" host_id=""
    while (( $# )) && [[ "$1" != "--" ]]; do
      case "$1" in
        --coordinator=*) coordinator="${1#*=}" ;;
        --num_hosts=*) num_hosts="${1#*=}" ;;
        --host_id=*) host_id="${1#*=}" ;;
        *) usage ;;
      esac
      shift
    done
    (( $# >= 2 )) || usage
    shift  # the --
    multihost=()
    if [[ "$num_hosts" == "auto" ]]; then
      [[ -z "$coordinator$host_id" ]] || usage
      multihost=(--multihost)
    elif [[ -n "$num_hosts$coordinator$host_id" ]]; then
      [[ -n "$coordinator" && "$num_hosts" =~ ^[1-9][0-9]*$ && "$host_id" =~ ^[0-9]+$ ]] || usage
      (( host_id < num_hosts )) || usage
      multihost=(--multihost --coordinator_address="$coordinator" --num_processes="$num_hosts"
                 --process_id="$host_id")
    fi
    run env JAX_PLATFORMS=cuda .venv/bin/python -m "launch.$op" "${multihost[@]}" "$@"
    ;;
  *)
    usage
    ;;
esac
