"""What every launch binary does: reject stray arguments, keep the console readable, for the
binaries that run on several hosts join the multi-host run, and report a refused input in one line.

A refusal (a bad flag value, a missing or mismatched file, a config the run cannot take, too many
environment faults) is an exception of `refusals()`, or absl's `UsageError` where a binary checks
its own flags: `run` prints `<binary>: error: <why>` and exits 1,
with the traceback only under --verbose. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from typing import Callable

from absl import app, flags, logging

from launch import huge_pages

flags.DEFINE_bool("verbose", False, "On a refused input, show the traceback behind the one-line error.")


def refusals() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this input cannot run", each raised with a one-line message where
    an input is checked. Any other exception, a ValueError from numpy or JAX included, is a bug."""
    from cope_jax.plan.measure import CompileError
    from cope_jax.rollout.runner import RolloutStalled
    from cope_jax.rollout.tokenizer import TokenizerError
    from cope_jax.run.faults import FaultError
    from cope_jax.stages.entry import RunDirectoryError
    from envs.base import EnvDataError
    from models.config import ConfigError
    from models.lora import LoraConfigError
    from models.model_dir import DestinationError
    from models.safetensors_io import CheckpointError

    return (ConfigError, CheckpointError, TokenizerError, LoraConfigError, DestinationError, RunDirectoryError,
            EnvDataError, FaultError, CompileError, RolloutStalled)


def run(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)`, with refusals (flag errors included) as one line on stderr and exit status 1.
    First the process restarts itself once with huge pages for XLA's buffers (`launch.huge_pages`)."""
    huge_pages.reexec()
    path = sys.argv[0] if sys.argv and sys.argv[0] else "launch"
    name = os.path.basename(path).removesuffix(".py")
    if name == "__main__":  # a package's binary (python -m launch.accept): the package names it
        name = os.path.basename(os.path.dirname(path))
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
        except (KeyError, AttributeError) as e:  # ml_collections: a --config.<field> the config lacks
            if verbose:
                raise
            _refuse(name, _unknown_field(argv, e))

    def guarded(argv):
        try:
            _check_config_file()
            main(argv)
        except (app.UsageError, *refusals()) as e:  # a flag's value checked by the binary is a refusal too
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
        from models.config import ConfigError

        raise ConfigError(f"--config={path}: no such config file")


def _unknown_field(argv: list[str], error: Exception) -> str:
    """`--config.trian.steps=3: no field 'trian' (did you mean 'train'?)` from ml_collections' error."""
    text = str(error.args[0] if error.args else error)
    for _ in range(3):  # the message may arrive quoted inside another KeyError's
        try:
            inner = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            break
        if not isinstance(inner, str):
            break
        text = inner
    lines = text.splitlines()
    missing = lines[0].strip("'\"")
    flag = next((a for a in argv[1:] if a.startswith("--config.") and missing in a.split("=")[0].split(".")), None)
    hint = re.search(r'Did you mean "([^"]+)"', " ".join(lines))
    return (f"{flag or '--config'}: no field '{missing}'" + (f" (did you mean '{hint.group(1)}'?)" if hint else ""))


def _refuse(name: str, message: str) -> None:
    print(f"{name}: error: {message}", file=sys.stderr, flush=True)
    # background threads (Orbax's asyncio loop after a failed restore) may print teardown errors
    # while the interpreter exits: the refusal stays one line
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
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
