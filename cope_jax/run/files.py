"""The small files a run writes, whole or not at all: a kill or a full disk mid-write leaves the old
file or the new one, never half of one (the next start parses `config.json` first thing).

Each is written to a temporary file beside it and renamed over it (`os.replace` is atomic on one
filesystem). Append-only logs (`metrics.jsonl`) instead write one whole record per call, and their
reader (`run/metrics.py`) drops a torn last record with one warning.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile


@contextlib.contextmanager
def replacing(path: str):
    """Yields a temporary path beside `path`; on success it replaces `path`, on failure it is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a report from the run's other readers
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj, **dump_kw) -> None:
    write_text(path, json.dumps(obj, **dump_kw))
