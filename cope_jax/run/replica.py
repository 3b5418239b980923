"""The sampler's copy of the policy, laid out for decoding on this host's devices.

A decode step reads every weight and the filled KV cache once per token. On a mesh inherited from
training (the paper configs' fsdp: weights split over `embed`) each step would all-gather the host's
whole model for one token per row. So the sampler runs on a mesh of its own (`decode_mesh`): the
weights split by tensor parallelism (heads, mlp and vocab over `tp`), so each chip reads only its
share and no weight moves between chips; KV heads over `tp` where they divide, otherwise
replicated; rows over `data`. Of the tp widths the heads allow, the one whose chips read the fewest
bytes per step (weights + cache) wins, which is also the one that holds the least.

`SamplingReplica` holds the policy's parameters on that mesh in the compute dtype
(`qwen.frozen_config`; LoRA adapters merged into them) and `refresh()` copies the trained parameters in with one jitted reshard
(the old copy's buffers donated, so no second replica exists meanwhile). On one device, or where
the training mesh already is the decode layout in the compute dtype, the replica is the policy.
On several hosts every host lays out its own devices the same way (one reshard to a mesh with a
leading `host` axis, whose shards on this host are then wrapped as local arrays).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from cope_jax.run import distributed
from models import lora as lora_lib
from models import qwen
from models import sharding as shd
from models.config import QwenConfig


def decode_mesh(cfg: QwenConfig, devices, rows: int, max_len: int, cache_dtype=None) -> Mesh:
    """(data, 1, tp) over `devices` (one host's): of the widths tp that divide both the device count
    and the query heads, the one whose chips read the fewest bytes per decode step
    (`decode_bytes_per_chip`); a tie goes to the wider tp."""
    devices = list(devices)
    n = len(devices)
    widths = [t for t in range(1, n + 1) if n % t == 0 and cfg.num_heads % t == 0]
    meshes = [shd.make_mesh((n // t, 1, t), devices=devices) for t in widths]
    return min(reversed(meshes), key=lambda m: decode_bytes_per_chip(cfg, m, rows, max_len, cache_dtype))


def decode_bytes_per_chip(cfg: QwenConfig, mesh: Mesh, rows: int, max_len: int, cache_dtype=None) -> int:
    """What one chip of `mesh` holds, and a decode step of full rows reads: its share of the weights in
    the compute dtype and of the KV cache of `rows` rows of `max_len` slots."""
    dtype = np.dtype(jnp.dtype(cfg.dtype))
    weights = sum(math.prod(qwen.param_sharding(name, shape, mesh).shard_shape(shape))
                  for name, shape in qwen.param_shapes(cfg).items()) * dtype.itemsize
    kv = math.prod(qwen.cache_shardings(cfg, rows, max_len, mesh)[0].k.shard_shape(qwen.cache_shape(cfg, rows, max_len)))
    return weights + 2 * kv * np.dtype(jnp.dtype(cache_dtype or cfg.dtype)).itemsize


def host_decode_mesh(cfg: QwenConfig, mesh: Mesh, process: int, rows: int, max_len: int) -> Mesh:
    """`decode_mesh` over one process's devices of `mesh`, in the chips' own order."""
    return decode_mesh(cfg, [d for d in mesh.devices.flat if d.process_index == process], rows, max_len)


class SamplingReplica:
    """The policy's parameters on this host's decode mesh (module docstring). `model` is what the
    sampler runs; `refresh()` before each rollout batch brings it up to date."""

    HOST_AXIS = "host"

    def __init__(self, model, mesh: Mesh | None, *, rows: int, max_len: int):
        self.policy = model
        self.mesh = None if mesh is None else host_decode_mesh(model.cfg, mesh, jax.process_index(), rows, max_len)
        if self.mesh is None or reads_policy(model.cfg, mesh, self.mesh, jax.process_count()):
            self.model, self._copy = model, None
            return
        cfg = qwen.frozen_config(model.cfg)  # the sampler only runs forward passes
        graphdef, abstract = nnx.split(qwen.abstract_model(cfg, self.mesh))
        self._local_shardings = qwen.state_shardings(abstract, self.mesh)
        lora = model.cfg.lora

        def cast(p):  # LoRA adapters merged into the copy: it decodes at the base model's cost
            flat = qwen.flat_params(p)
            flat = flat if lora is None else lora_lib.merged(flat, lora.scale)
            return qwen.with_arrays(abstract, lambda name: flat[name].astype(cfg.param_dtype))
        if jax.process_count() == 1:
            out = self._local_shardings
        else:
            out = self._host_shardings(model.cfg, mesh, rows, max_len)
        self._copy = jax.jit(cast, out_shardings=out)
        self._update = jax.jit(lambda new, old: cast(new), out_shardings=out, donate_argnums=1)
        self.model = nnx.merge(graphdef, self._local_view(self._copy(nnx.state(model, nnx.Param))))

    def refresh(self) -> None:
        """Copies the policy's current parameters into the replica (a no-op where it is the policy)."""
        if self._copy is None:
            return
        params = nnx.state(self.policy, nnx.Param)
        if jax.process_count() == 1:  # the old copy's buffers donated to the new one
            new = self._update(params, nnx.state(self.model, nnx.Param))
        else:  # the donatable buffers would be the host-mesh arrays, not the local views
            new = self._copy(params)
        nnx.update(self.model, self._local_view(new))

    def _host_shardings(self, cfg, mesh: Mesh, rows: int, max_len: int):
        """Shardings on a (host, data, fsdp, tp) mesh: replicated over hosts, within each host as on
        its decode mesh."""
        blocks = [host_decode_mesh(cfg, mesh, p, rows, max_len).devices for p in range(jax.process_count())]
        if len({b.shape for b in blocks}) != 1:
            raise ValueError(f"hosts hold different numbers of the mesh {dict(mesh.shape)}'s devices")
        hosts = np.stack(blocks)
        distributed.connect_groups(hosts.reshape(len(blocks), -1).T)  # this reshard's cross-host groups
        host_mesh = Mesh(hosts, (self.HOST_AXIS,) + tuple(self.mesh.axis_names),
                         axis_types=(self.mesh.axis_types[0],) + tuple(self.mesh.axis_types))
        return jax.tree.map(lambda s: NamedSharding(host_mesh, s.spec), self._local_shardings)

    def _local_view(self, params):
        if jax.process_count() == 1:
            return params
        # Waited for: its collectives run on the cross-host groups that `allgather_objects` uses
        # too, and a program in flight there while the next one starts may pair their messages
        # (seen on CPU: one host's gather received the other's parameter shard). The sampler
        # needs the parameters before it can start anyway.
        gathered = jax.block_until_ready(params)
        return jax.tree.map(
            lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [x.data for x in a.addressable_shards]),
            gathered, self._local_shardings)


def reads_policy(cfg: QwenConfig, mesh: Mesh, decode: Mesh, hosts: int) -> bool:
    """Whether the sampler can read the policy itself: one host, the policy already on the decode
    mesh's devices and axes, its weights in the compute dtype (always under LoRA: the sampler then
    applies the adapters unmerged: at rank 64 on Qwen2.5-7B 4% more bytes per step than a merged
    copy, which would hold a second model)."""
    return (hosts == 1 and (cfg.lora is not None or jnp.dtype(cfg.param_dtype) == jnp.dtype(cfg.dtype))
            and mesh.devices.shape == decode.devices.shape and (mesh.devices == decode.devices).all())
