"""Resumable training checkpoints on Orbax `CheckpointManager`.

A step directory `<workdir>/<step>/` holds one Orbax item per top-level key of the train state
(`params`, `opt_state`, `rng`, ...: pytrees of arrays, saved sharded by every process) and two JSON
items: `data_state` (the data iterator's `get_state()`) and `config`. `params` being an item of its
own makes `<workdir>/<step>/params` a plain `StandardCheckpointer` directory, which
`models.load_model(..., config_dir=...)` and `launch.convert` read directly.

Typed PRNG keys (`jax.random.key`) are stored as their uint32 key data and re-wrapped on restore.
Saves are asynchronous: `save` returns once the arrays are copied off the devices and the write
continues in the background. Orbax commits a step by renaming its temporary directory, so a process
killed mid-save leaves the previous step as the latest. Restoring places every array directly on
the sharding its abstract leaf names, so a checkpoint written on one mesh restores onto another.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import orbax_io
from models.orbax_io import error_line
from models.safetensors_io import CheckpointError

DATA_ITEM = "data_state"
CONFIG_ITEM = "config"
_RESERVED = (DATA_ITEM, CONFIG_ITEM)


class TrainCheckpointer:
    """Saves and restores `(step, state, data_state, config)` under `workdir`, keeping the last `keep`.

    `state` is a dict of pytrees of arrays, e.g. `{"params": nnx.State, "opt_state": optax state,
    "rng": typed key}`. `data_state` and `config` are JSON-serialisable dicts.
    """

    def __init__(self, workdir: str, *, keep: int | None = 3, async_save: bool = True,
                 save_interval_steps: int = 1):
        self.workdir = os.path.abspath(workdir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # left by a process killed mid-save
        )
        self._manager = ocp.CheckpointManager(self.workdir, options=options)

    # -- queries ---------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest fully committed step (None when there is none)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    @staticmethod
    def steps_in(workdir: str) -> list[int]:
        """The committed steps under `workdir`, read without opening a manager (which creates the
        directory): a step is committed once Orbax renamed its temporary directory to the number."""
        if not os.path.isdir(workdir):
            return []
        return sorted(int(d) for d in os.listdir(workdir) if d.isdigit() and os.path.isdir(os.path.join(workdir, d)))

    def step_dir(self, step: int) -> str:
        return os.path.join(self.workdir, str(step))

    # -- save / restore ----------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, data_state: Mapping[str, Any],
             config: Mapping[str, Any], force: bool = False) -> bool:
        """Starts saving `step`; returns False when skipped (off-interval without `force`, or saved).

        Raises ValueError for a state key that clashes with the JSON items, or a `data_state` /
        `config` that JSON cannot represent (before anything is written).
        """
        clash = [k for k in state if k in _RESERVED]
        if clash:
            raise ValueError(f"state keys {clash} clash with the checkpoint's JSON items {_RESERVED}")
        data_state, config = _json_dict(data_state, DATA_ITEM), _json_dict(config, CONFIG_ITEM)
        if step in self._manager.all_steps():
            return False
        items = {name: ocp.args.StandardSave(_as_container(_keys_to_data(tree)))
                 for name, tree in state.items()}
        items[DATA_ITEM] = ocp.args.JsonSave(data_state)
        items[CONFIG_ITEM] = ocp.args.JsonSave(config)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, step: int | None = None, *, abstract_state: Mapping[str, Any]
                ) -> tuple[int, dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Restores `(step, state, data_state, config)`; `step=None` means the latest.

        `abstract_state` names the items to restore (a subset of the saved keys is fine) and their
        structure, dtypes and shardings: pytrees of `jax.ShapeDtypeStruct` with `.sharding` (or
        concrete arrays, whose sharding is used). Leaves land directly on those shardings.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.workdir}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.workdir} "
                                    f"(have {self.all_steps()})")
        missing = [name for name in (*abstract_state, *_RESERVED)
                   if not os.path.isdir(os.path.join(self.step_dir(step), name))]
        if missing:
            raise CheckpointError(f"checkpoint step {step} ({self.step_dir(step)}) is unreadable: "
                                  f"missing {', '.join(f'{m}/' for m in missing)}")
        items = {name: ocp.args.StandardRestore(_as_container(_abstract_key_data(tree)))
                 for name, tree in abstract_state.items()}
        items.update({k: ocp.args.JsonRestore() for k in _RESERVED})
        restored = {}
        for name, args in items.items():  # one item at a time: the error names the damaged one
            try:
                with orbax_io.without_closed_loop_noise():
                    restored[name] = self._manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
            except Exception as e:  # Orbax, TensorStore and JSON each raise their own types
                raise CheckpointError(f"checkpoint step {step} ({self.step_dir(step)}) is unreadable: "
                                      f"{name}/: {error_line(e)}") from e
        state = {name: _data_to_keys(_from_container(restored[name], tree), tree)
                 for name, tree in abstract_state.items()}
        return step, state, dict(restored[DATA_ITEM]), dict(restored[CONFIG_ITEM])

    def set_aside(self, step: int) -> str:
        """Renames an unreadable step out of the manager's sight (to `<step>.unreadable`, kept for
        inspection), so training past it writes that step afresh. Returns the new path."""
        target = self.step_dir(step) + ".unreadable"
        n = 1
        while os.path.exists(target):
            n += 1
            target = f"{self.step_dir(step)}.unreadable{n}"
        os.rename(self.step_dir(step), target)
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until the in-flight save (if any) is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()




# -- leaves and typed PRNG keys ---------------------------------------------------------------------
_LEAF = "array"


def _as_container(tree):
    """Orbax's pytree handler needs a container: a bare array item is stored as {"array": x}."""
    return {_LEAF: tree} if jax.tree_util.treedef_is_leaf(jax.tree.structure(tree)) else tree


def _from_container(restored, abstract):
    return restored[_LEAF] if jax.tree_util.treedef_is_leaf(jax.tree.structure(abstract)) else restored


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract_key_data(tree):
    """Abstract tree with typed-key leaves replaced by their key data's shape/dtype/sharding."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def _data_to_keys(restored, abstract):
    """Re-wraps key data where the abstract tree has typed keys (the key dtype names the impl)."""
    def one(value, target):
        if _is_key(target):
            return jax.random.wrap_key_data(value, dtype=target.dtype)
        return value
    return jax.tree.map(one, restored, abstract)


def _json_dict(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
        value = value.to_dict()
    try:
        return json.loads(json.dumps(dict(value), default=_json_default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from e


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"object of type {type(x).__name__} is not JSON serializable")
