"""What every launch binary does: reject stray arguments, keep the console readable, for the
binaries that run on several hosts join the multi-host run, and report a refused input in one line.

A refusal (a bad flag value, a missing or mismatched file, a config the run cannot take, too many
environment faults) is an exception of `REFUSALS`: `run` prints `<binary>: error: <why>` and exits 1,
with the traceback only under --verbose. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from absl import app, flags, logging

from launch import huge_pages

flags.DEFINE_bool("verbose", False, "On a refused input, show the traceback behind the one-line error.")


def refusals() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this input cannot run" (all carry a one-line message)."""
    from cope_jax.run.faults import FaultError

    return (ValueError, OSError, FaultError)  # ConfigError, CheckpointError, TokenizerError are ValueErrors


def run(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)`, with refusals (flag errors included) as one line on stderr and exit status 1.
    First the process restarts itself once with huge pages for XLA's buffers (`launch.huge_pages`)."""
    huge_pages.reexec()
    name = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv and sys.argv[0] else "launch"
    verbose = "--verbose" in sys.argv[1:]

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            if verbose:
                raise
            # a config file's error carries its traceback: the flag and the exception's last line
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            _refuse(name, lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}")

    def guarded(argv):
        try:
            _check_config_file()
            main(argv)
        except refusals() as e:
            if flags.FLAGS.verbose:
                raise
            _refuse(name, " ".join(str(e).split("\n")[0].split()) or type(e).__name__)

    app.run(guarded, flags_parser=parse)


def _check_config_file() -> None:
    """A missing --config file fails here, by name (ml_collections defers it to the first access)."""
    if "config" not in flags.FLAGS or flags.FLAGS["config"].value is None:
        return
    path = flags.FLAGS["config"].config_filename
    if not os.path.isfile(path.split(":", 1)[0]):
        raise FileNotFoundError(f"--config={path}: no such config file")


def _refuse(name: str, message: str) -> None:
    print(f"{name}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)
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
        from cope_jax.run import distributed

        F = flags.FLAGS
        distributed.initialize(F.coordinator_address, F.num_processes, F.process_id)
    elif "multihost" in flags.FLAGS and (flags.FLAGS.num_processes or flags.FLAGS.coordinator_address):
        raise app.UsageError("--coordinator_address / --num_processes / --process_id need --multihost")
