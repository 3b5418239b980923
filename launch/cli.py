"""What every launch binary does first: reject stray arguments, keep the console readable and, for
the binaries that run on several hosts, join the multi-host run."""
from __future__ import annotations

from absl import app, flags, logging


def define_multihost_flags() -> None:
    """Flags of `start`'s multi-host join (train and eval define them)."""
    flags.DEFINE_bool("multihost", False, "Join a multi-host run (jax.distributed.initialize) before "
                      "anything else; on TPU VMs, Slurm and Open MPI the flags below are detected.")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator "
                        "(default: detected, or JAX_COORDINATOR_ADDRESS).")
    flags.DEFINE_integer("num_processes", None, "Number of processes (default: detected).", lower_bound=1)
    flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes) (default: detected).",
                         lower_bound=0)


def start(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    if "multihost" in flags.FLAGS and flags.FLAGS.multihost:
        from cope_jax import distributed

        F = flags.FLAGS
        distributed.initialize(F.coordinator_address, F.num_processes, F.process_id)
    elif "multihost" in flags.FLAGS and (flags.FLAGS.num_processes or flags.FLAGS.coordinator_address):
        raise app.UsageError("--coordinator_address / --num_processes / --process_id need --multihost")
