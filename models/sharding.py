"""Logical axis names -> mesh axes, and the mesh helper.

Every parameter and every large activation names its dimensions with logical axes
('vocab', 'embed', 'mlp', ...). One table, `LOGICAL_RULES`, maps them to the mesh axes
`data`, `fsdp` and `tp`. A mesh axis is dropped for a dimension it does not divide (e.g. 2 KV heads
on a tp=4 mesh are replicated rather than failing), which is the only place sharding falls back;
`describe_sharding` reports what actually happened.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tp")

# logical axis -> mesh axes (tuple: sharded over their product, in order)
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "vocab": ("tp",),
    "embed": ("fsdp",),
    "mlp": ("tp",),
    "q_heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": (),
    "layers": (),
    "norm": (),
    "seq": (),
    "cache_seq": (),
    "act_embed": (),
    # the residual stream between layers: tokens over tp (sequence parallelism), so what a layer
    # saves for the backward pass is 1/tp of the row; XLA gathers them where a layer needs all
    "act_seq": ("tp",),
    "act_vocab": ("tp",),
    "lora_rank": (),  # models/lora.py: a few dozen wide, contracted or produced by both products
}


def make_mesh(
    shape: Sequence[int] | None = None,
    axis_names: Sequence[str] = MESH_AXES,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over `devices` (default: all) with axis types stated explicitly.

    The axes are `Auto` (GSPMD propagation): the model annotates parameters and a few activations,
    XLA chooses the collectives. `shape=None` puts every device on `fsdp`. Devices are ordered by
    their links (`create_device_mesh`), splitting a physical axis where a mesh axis needs part of it
    (`jax.make_mesh` allows that on v5e only, and fails for e.g. tp=2 on a 4x8 v6e slice).
    """
    devices = list(devices if devices is not None else jax.devices())
    if shape is None:
        shape = tuple(len(devices) if a == "fsdp" else 1 for a in axis_names)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} does not match axis names {tuple(axis_names)}")
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {len(devices)}")
    from jax.experimental import mesh_utils

    arranged = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(arranged, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int] | None, mesh: Mesh, rules=None
) -> P:
    """PartitionSpec for an array whose dims carry `logical_axes`, valid for `mesh`.

    Mesh axes that are absent from the mesh, of size 1, already used by an earlier dim, or that
    do not divide the dim are dropped.
    """
    rules = LOGICAL_RULES if rules is None else rules
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        dim = None if shape is None else shape[i]
        axes = []
        for ax in rules[name]:
            size = mesh.shape.get(ax, 1)
            if size == 1 or ax in used:
                continue
            if dim is not None and dim % (size * math.prod(mesh.shape[a] for a in axes)):
                continue
            axes.append(ax)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*spec)


def named_sharding(logical_axes, shape, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
    """`with_sharding_constraint` by logical axes; identity when there is no mesh."""
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(logical_axes, x.shape, mesh))


def describe_sharding(tree) -> dict[str, str]:
    """{path: partition spec} for every array leaf, for logs and tests."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        out[jax.tree_util.keystr(path)] = str(spec) if spec is not None else str(sharding)
    return out


def shard_batch(x: np.ndarray | jax.Array, mesh: Mesh | None, logical_axes=("batch",)) -> jax.Array:
    """Places a host batch on the mesh, leading dim over ('data', 'fsdp')."""
    if mesh is None:
        return jax.numpy.asarray(x)
    axes = tuple(logical_axes) + (None,) * (np.ndim(x) - len(logical_axes))
    return jax.device_put(x, named_sharding(axes, np.shape(x), mesh))
