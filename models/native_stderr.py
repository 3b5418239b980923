"""Holding what native code writes to standard error (fd 2: not through Python's `sys.stderr`)
while a block runs, and writing back only what the caller keeps of it."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import IO, Callable


@contextlib.contextmanager
def held(kept: Callable[[str, bool], str], drain: Callable[[IO[bytes]], None] | None = None):
    """Points fd 2 at a file for the block; afterwards writes `kept(text, failed)` to the real
    standard error. `drain(file)`, when the block raises, waits for stragglers (threads still
    writing) before fd 2 is given back."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            if drain is not None:
                drain(file)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            text = kept(file.read().decode("utf-8", "replace"), failed)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()
