"""Model directories on disk: what kind a directory is, atomic creation, carried-over side files.

Writers never leave a half-written destination: everything goes to a hidden temporary directory
beside the destination, which is renamed into place only after the last byte is written. A failure
(bad input found late, disk full, Ctrl-C) removes the temporary directory and leaves the
destination exactly as it was.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
import zlib

from models.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# copied unchanged from a source directory into every converted one (tokenizer + chat template)
CARRIED_FILES = (
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
)
# Orbax parameter checkpoint inside a model directory (or inside a training checkpoint step)
ORBAX_PARAMS_DIR = "params"
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")


def kind(path: str) -> str:
    """'hf' (safetensors) or 'orbax' (`params/` Orbax checkpoint); CheckpointError otherwise."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if any(os.path.isfile(os.path.join(path, f)) for f in (SINGLE_FILE, INDEX_FILE)):
        return "hf"
    params = os.path.join(path, ORBAX_PARAMS_DIR)
    if any(os.path.exists(os.path.join(params, m)) for m in _ORBAX_MARKERS):
        return "orbax"
    raise CheckpointError(f"{path}: neither an HF model directory ({SINGLE_FILE} or {INDEX_FILE}) nor an "
                          f"Orbax one ({ORBAX_PARAMS_DIR}/ holding an Orbax checkpoint)")


class DestinationError(FileExistsError):
    """A conversion's destination holds something it would overwrite."""


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuses a destination that is a file, or a non-empty directory unless `overwrite`."""
    if os.path.isdir(dst):
        if os.listdir(dst) and not overwrite:
            raise DestinationError(f"{dst}: destination exists and is not empty (pass --overwrite to replace it)")
    elif os.path.lexists(dst):
        raise DestinationError(f"{dst}: destination exists and is not a directory")


@contextlib.contextmanager
def atomic_output_dir(dst: str, *, overwrite: bool = False):
    """Yields a temporary directory beside `dst` that replaces `dst` when the block succeeds.

    In a multi-host JAX run every process calls this together: they all write into one temporary
    directory (named by process 0), and process 0 renames it once every process is done."""
    import jax

    hosts = jax.process_count()
    main = jax.process_index() == 0
    dst = os.path.abspath(dst)
    check_destination(dst, overwrite)
    parent = os.path.dirname(dst)
    tmp = None
    if main:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    if hosts > 1:
        tmp = os.path.join(parent, _broadcast_name(None if tmp is None else os.path.basename(tmp)))
    try:
        yield tmp
        _barrier(f"written {dst}", hosts)
        if main:
            _set_default_mode(tmp)
            check_destination(dst, overwrite)  # something may have appeared meanwhile
            if os.path.isdir(dst) and os.listdir(dst):
                old = os.path.join(parent, f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
                os.rename(dst, old)
                try:
                    os.rename(tmp, dst)
                except OSError:
                    os.rename(old, dst)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, dst)  # also replaces an empty directory
        _barrier(f"renamed {dst}", hosts)
    finally:
        if main and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# how long a host waits for the others at a directory's barriers (large checkpoints write slowly)
SYNC_TIMEOUT_S = 3600
_syncs = itertools.count()


def _coordination_client():
    """The multi-controller runtime's coordination service (barriers and a key-value store): host
    file work needs no device collective. Orbax reaches the same client the same way."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("several JAX processes but jax.distributed is not initialized")
    return distributed.global_state.client


def _broadcast_name(name: str | None) -> str:
    """Process 0's directory name on every process."""
    import jax

    client, key = _coordination_client(), f"cope_jax/model_dir/{next(_syncs)}/name"
    if jax.process_index() == 0:
        client.key_value_set(key, name)
        return name
    return client.blocking_key_value_get(key, SYNC_TIMEOUT_S * 1000)


def _barrier(what: str, hosts: int) -> None:
    if hosts > 1:
        import jax

        try:
            # the name is part of the id: hosts at different barriers wait for each other, then fail
            barrier = f"cope_jax/model_dir/{next(_syncs)}/{zlib.crc32(what.encode()):08x}"
            _coordination_client().wait_at_barrier(barrier, SYNC_TIMEOUT_S * 1000)
        except Exception as e:  # the runtime's error says little about which wait it was
            raise RuntimeError(f"process {jax.process_index()}: not every process reached '{what}' within "
                               f"{SYNC_TIMEOUT_S} s (one is hung, died or runs another program): {e}") from e


def _set_default_mode(path: str) -> None:
    """mkdtemp makes the directory private (0700); give it the mode a plain mkdir would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def carry_files(src: str, dst: str) -> list[str]:
    """Copies the `CARRIED_FILES` present in `src` into `dst`; returns their names."""
    copied = []
    for name in CARRIED_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied
