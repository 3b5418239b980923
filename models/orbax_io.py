"""Orbax model directories: parameters as an Orbax checkpoint beside an HF config.json.

Layout of a converted model:
```
DIR/config.json             HF config of the architecture (what QwenConfig.from_hf_dir reads)
DIR/params/                 Orbax StandardCheckpointer: {"embed": [V,E], "layers": {"q_proj": [L,E,H,D], ...}}
DIR/generation_config.json  and the tokenizer files, carried over from the source
```
A training checkpoint step (`cope_jax/run/checkpoint.py`) has the same `params/` item, saved from an
`nnx.State` (whose leaves nest one level deeper under `value`); `load_params` reads both, given a
config.json from elsewhere. Restoring builds the target tree from the checkpoint's metadata with a
`jax.ShapeDtypeStruct` per leaf that carries its sharding on `mesh`, so Orbax reads each device's
slices straight into place and casts to the requested dtype on the way.
"""
from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from models import hf_io, model_dir, native_stderr, qwen
from models.config import QwenConfig
from models.safetensors_io import CheckpointError

# an nnx.State saved by Orbax stores each Variable's array under this key
_VARIABLE_VALUE_KEY = "value"


def params_dir(directory: str) -> str:
    return os.path.join(os.path.abspath(directory), model_dir.ORBAX_PARAMS_DIR)


def _flat_metadata(directory: str) -> tuple[dict, dict[str, tuple]]:
    """(metadata tree, {param path: (keypath, array metadata)}) of the Orbax params in `directory`."""
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(params_dir(directory)).item_metadata.tree
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{directory}: cannot read the Orbax checkpoint in "
                              f"{model_dir.ORBAX_PARAMS_DIR}/: {e}") from e
    flat = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(k, "key", k)) for k in keypath]
        if names and names[-1] == _VARIABLE_VALUE_KEY:
            names = names[:-1]
        flat["/".join(names)] = (keypath, leaf)
    return tree, flat


def stored_dtype(directory: str) -> str:
    """Dtype name of the stored embedding ('bfloat16', 'float32', ...)."""
    _, flat = _flat_metadata(directory)
    if "embed" not in flat:
        raise CheckpointError(f"{directory}: the Orbax params hold no 'embed'")
    return jnp.dtype(flat["embed"][1].dtype).name


def check_params(directory: str, flat: dict[str, tuple], cfg: QwenConfig) -> None:
    """Every parameter of `cfg` present with its shape, nothing else (one error listing all)."""
    expected = qwen.param_shapes(cfg)
    missing = sorted(p for p in expected if p not in flat)
    extra = sorted(p for p in flat if p not in expected)
    wrong = [f"{p!r} has shape {tuple(flat[p][1].shape)}, config expects {expected[p]}"
             for p in sorted(expected) if p in flat and tuple(flat[p][1].shape) != expected[p]]
    problems = [f"{what}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                for what, items in (("missing", missing), ("wrong shape", wrong), ("not used by the config", extra))
                if items]
    if problems:
        raise CheckpointError(f"{directory}: Orbax params do not match the {cfg.architecture} config: "
                              f"{'; '.join(problems)}")


def load_params(directory: str, cfg: QwenConfig, mesh=None) -> qwen.Qwen:
    """A `Qwen` whose parameters are restored from `directory/params`, placed sharded on `mesh`."""
    tree, flat = _flat_metadata(directory)
    check_params(directory, flat, cfg)
    dtype = jnp.dtype(cfg.param_dtype)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    by_keypath = {keypath: path for path, (keypath, _) in flat.items()}

    def target(keypath, leaf):
        path = by_keypath[keypath]
        sharding = single if mesh is None else qwen.param_sharding(path, leaf.shape, mesh)
        return jax.ShapeDtypeStruct(tuple(leaf.shape), dtype, sharding=sharding)

    abstract = jax.tree_util.tree_map_with_path(target, tree)
    try:
        with without_closed_loop_noise(), ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(params_dir(directory), abstract)
    except Exception as e:  # TensorStore's errors are plain Exceptions
        raise CheckpointError(f"{directory}: the Orbax params are unreadable: {error_line(e)}") from e
    values = {path: _at(restored, keypath) for path, (keypath, _) in flat.items()}
    graphdef, state = nnx.split(qwen.abstract_model(cfg, mesh))
    state = jax.tree_util.tree_map_with_path(lambda kp, _: values[qwen.param_path(kp)], state)
    return nnx.merge(graphdef, state)


def error_line(e: BaseException) -> str:
    """The first line of an Orbax / TensorStore error (they run to dozens of lines), without
    TensorStore's dump of its spec, and with the first line of its cause (where TensorStore says
    which file is short)."""
    text = str(e).strip()
    line = " ".join(text.splitlines()[0].split()).split(" See full TensorStore details")[0] if text else ""
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        line = f"{line} ({error_line(cause)})" if line else error_line(cause)
    return (line or type(e).__name__)[:400]


def _at(tree, keypath):
    for k in keypath:
        tree = tree[getattr(k, "key", k)]
    return tree


def save_orbax(model: qwen.Qwen, directory: str, *, dtype=None, carry_from: str | None = None,
               overwrite: bool = False) -> list[str]:
    """Writes `model` as an Orbax model directory (atomically); returns the top-level names written.

    `dtype` (default: the parameter dtype) is the stored dtype; the arrays keep their sharding,
    each process writing its own shards. Tokenizer and generation files of `carry_from` are copied.
    """
    cfg = model.cfg
    dtype = jnp.dtype(dtype or qwen.stored_dtype(cfg))
    arrays = qwen.merged_params(model)  # LoRA adapters merged
    tree: dict = {}
    for path, arr in arrays.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = arr if arr.dtype == dtype else arr.astype(dtype)
    with model_dir.atomic_output_dir(directory, overwrite=overwrite) as tmp:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(tmp, model_dir.ORBAX_PARAMS_DIR), tree)
            checkpointer.wait_until_finished()
        if jax.process_index() == 0:  # the side files: once
            hf_io.write_json(os.path.join(tmp, model_dir.CONFIG_FILE), hf_io.hf_config_dict(cfg, dtype))
            carried = model_dir.carry_files(carry_from, tmp) if carry_from else []
            if model_dir.GENERATION_CONFIG_FILE not in carried:
                hf_io.write_json(os.path.join(tmp, model_dir.GENERATION_CONFIG_FILE),
                                 hf_io.minimal_generation_config(cfg))
        return sorted(os.listdir(tmp))


# A failed restore's other reads finish within about a second on an idle host; under load they take
# longer, so the drain waits until standard error has been quiet for a while (bounded).
_DRAIN_QUIET_SECONDS = 1.0
_DRAIN_MAX_SECONDS = 15.0
# The pieces one such traceback is written in. Threads interleave them mid-line ("RuntimeError: "
# from one thread, a frame from another, then "Event loop is closed"), so a line is noise when
# nothing but these pieces and blanks is left on it.
_NOISE_PIECE = re.compile(r"Traceback \(most recent call last\):"
                          r"|File \"[^\"\n]*asyncio[/\\]base_events\.py\", line \d+, in \w+"
                          r"|self\._check_closed\(\)"
                          r"|self\._write_to_self\(\)"
                          r"|raise RuntimeError\('Event loop is closed'\)"
                          r"|RuntimeError:"
                          r"|Event loop is closed")


def drop_closed_loop_noise(text: str) -> str:
    """`text` less the lines of 'Event loop is closed' tracebacks, however their threads interleaved."""
    if "Event loop is closed" not in text:
        return text
    return "".join(line for line in text.splitlines(keepends=True)
                   if _NOISE_PIECE.sub("", line).strip())


def _drain(held) -> None:
    """Waits until nothing has been written to `held` for `_DRAIN_QUIET_SECONDS` (at most
    `_DRAIN_MAX_SECONDS`): the failed restore's other reads have all reported."""
    start = last_change = time.monotonic()
    size = os.fstat(held.fileno()).st_size
    while time.monotonic() - last_change < _DRAIN_QUIET_SECONDS and time.monotonic() - start < _DRAIN_MAX_SECONDS:
        time.sleep(0.1)
        now = os.fstat(held.fileno()).st_size
        if now != size:
            size, last_change = now, time.monotonic()


def without_closed_loop_noise():
    """Standard error of a restore, less TensorStore's 'Event loop is closed' tracebacks: when a
    read fails, Orbax closes its asyncio loop while other reads are in flight, and each of those
    prints one from TensorStore's own threads (not through Python's hooks, so fd 2 is held)."""
    return native_stderr.held(lambda text, failed: drop_closed_loop_noise(text), drain=_drain)
