"""What every launch binary does first: reject stray arguments and keep the console readable."""
from __future__ import annotations

from absl import app, flags, logging


def start(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
