"""Multi-host runs on JAX's multi-controller runtime: every host runs the same program.

A run on several hosts (a TPU VM slice, several GPU machines, or several local CPU processes in
the tests) works like this:

- `initialize` joins the processes (`jax.distributed.initialize`); on TPU VMs, Slurm and Open MPI
  every argument is detected, elsewhere the coordinator address, process count and id are given.
- `run_mesh` builds the global (data, fsdp, tp) mesh over every device of every host; the train
  step is one SPMD program over it (`cope_jax/train_step.py`).
- Each host rolls out its own contiguous share of a step's episodes (`process_share`) with its
  own environment pool and its own sampler. The sampler cannot run on the global mesh: hosts
  decode different episodes, for different numbers of turns. It runs on `LocalReplica`, the
  policy's parameters laid out on this host's devices (one reshard per rollout batch).
- `allgather_objects` brings every host's trajectories to every host, in global episode order, so
  each host builds the same packed mini-batches and `jax.device_put` takes each host's rows of the
  globally sharded batch. Only token ids, masks and logprobs travel; the packing is host work.

Only process 0 writes logs, plots and reports; Orbax checkpoints are written by every process.
"""
from __future__ import annotations

import functools
import math
import pickle
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import models
from models import qwen

HOSTS_AXIS = "hosts"  # the axis of a group of devices with one device per process


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> None:
    """Joins this process to a multi-controller run (call before any other JAX work).

    Arguments left None are detected (TPU VM slices, Slurm, Open MPI) or read from
    JAX_COORDINATOR_ADDRESS; CPU processes exchange collectives over gloo (JAX's default).
    """
    if (num_processes is None) != (process_id is None):
        raise ValueError("give both num_processes and process_id, or neither (auto-detection)")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)


def run_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The (data, fsdp, tp) mesh of `config.mesh` over `devices` (default: every device of every
    host; the planner passes a topology's); -1 takes the remaining devices. A mesh of one device
    means no mesh (plain single-device arrays). On several hosts the mesh must span every device,
    and each host's devices must be able to take the mesh's axes (`local_shape`)."""
    devices = list(jax.devices() if devices is None else devices)
    n, hosts = len(devices), len({d.process_index for d in devices})
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ValueError(f"config.mesh {tuple(shape)}: at most one -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if n % rest:
            raise ValueError(f"config.mesh {tuple(shape)} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    size = int(np.prod(shape))
    if size > n:
        raise ValueError(f"config.mesh {tuple(shape)} needs {size} devices, have {n}")
    if hosts > 1 and size != n:
        raise ValueError(f"config.mesh {tuple(shape)} uses {size} of the {n} devices of "
                         f"{hosts} hosts: a multi-host mesh must use them all")
    if size == 1:
        return None
    mesh = models.make_mesh(tuple(shape), devices=devices[:size])
    for process in sorted({d.process_index for d in devices}):
        local_mesh(mesh, process)  # fail at setup, not at the first rollout
    return mesh


def local_shape(shape: Sequence[int], devices: int) -> tuple[int, ...]:
    """The (data, fsdp, tp) shape of one host's `devices`: each axis takes what the host can hold of
    the global `shape`, innermost first (all of tp, then fsdp, then data)."""
    left, local = devices, []
    for size in reversed(shape):
        take = math.gcd(int(size), left)
        local.insert(0, take)
        left //= take
    if left != 1:
        raise ValueError(f"config.mesh {tuple(shape)} cannot lay out a host's {devices} devices "
                         "(each axis a divisor of the mesh's)")
    return tuple(local)


def local_mesh(mesh: Mesh, process: int | None = None) -> Mesh:
    """One process's devices (default: this one's) as a mesh with `mesh`'s axis names and types, of
    `local_shape`, in the chips' own order. It need not be a block of `mesh`: on a TPU slice the
    global mesh follows the chips' links (collectives need that), and a long fsdp axis snakes
    across hosts."""
    from jax.experimental import mesh_utils

    process = jax.process_index() if process is None else process
    devices = [d for d in mesh.devices.flat if d.process_index == process]
    shape = local_shape(mesh.devices.shape, len(devices))
    try:
        arranged = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):  # devices without a known physical layout
        arranged = np.array(devices).reshape(shape)
    return Mesh(arranged, mesh.axis_names, axis_types=mesh.axis_types)


class LocalReplica:
    """The policy's parameters on this host's devices, for this host's sampler.

    `model` is the policy itself on one host (the sampler reads the live parameters). On several
    hosts it is a copy in the compute dtype (`qwen.frozen_config`) laid out on `local_mesh(mesh)`
    (this host's devices) with the same logical sharding, refreshed by
    `refresh()` before each rollout batch: one jitted reshard to a mesh with a leading `host` axis
    (replicated over hosts, sharded within each as on the local mesh), whose shards on this host
    are then wrapped as local arrays without another copy.
    """

    HOST_AXIS = "host"

    def __init__(self, model, mesh: Mesh | None):
        self.policy = model
        self.multi_host = jax.process_count() > 1
        if not self.multi_host:
            self.model = model
            return
        local = local_mesh(mesh)
        blocks = [local_mesh(mesh, p).devices for p in range(jax.process_count())]
        if len({b.shape for b in blocks}) != 1:
            raise ValueError(f"hosts hold different numbers of the mesh {dict(mesh.shape)}'s devices")
        hosts = np.stack(blocks)
        _connect_groups(hosts.reshape(len(blocks), -1).T)  # this reshard's groups: a device's peers on other hosts
        self._host_mesh = Mesh(hosts, (self.HOST_AXIS,) + tuple(mesh.axis_names),
                               axis_types=(mesh.axis_types[0],) + tuple(mesh.axis_types))
        params = nnx.state(model, nnx.Param)
        shardings = qwen.state_shardings(params, local)
        self._host_shardings = jax.tree.map(lambda s: NamedSharding(self._host_mesh, s.spec), shardings)
        self._local_shardings = shardings
        cfg = qwen.frozen_config(model.cfg)  # the sampler only runs forward passes
        cast = lambda p: jax.tree.map(lambda a: a.astype(cfg.param_dtype), p)
        self._gather = jax.jit(cast, out_shardings=self._host_shardings)
        graphdef, _ = nnx.split(qwen.abstract_model(cfg, local))
        self.model = nnx.merge(graphdef, self._local_view(params))

    def refresh(self) -> None:
        """Copies the policy's current parameters into the replica (a no-op on one host)."""
        if self.multi_host:
            nnx.update(self.model, self._local_view(nnx.state(self.policy, nnx.Param)))

    def _local_view(self, params):
        # Waited for: its collectives run on the cross-host groups that `allgather_objects` uses
        # too, and a program in flight there while the next one starts may pair their messages
        # (seen on CPU: one host's gather received the other's parameter shard). The sampler
        # needs the parameters before it can start anyway.
        gathered = jax.block_until_ready(self._gather(params))
        return jax.tree.map(
            lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [x.data for x in a.addressable_shards]),
            gathered, self._local_shardings)


def process_share(n: int) -> slice:
    """This process's contiguous share of n items (the first n % P processes take one more)."""
    p, i = jax.process_count(), jax.process_index()
    sizes = [n // p + (k < n % p) for k in range(p)]
    start = sum(sizes[:i])
    return slice(start, start + sizes[i])


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in process order, on every process."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = _host_allgather(np.array([data.size], np.int64))[:, 0]
    # a power-of-two width: a handful of compiled gathers over a run, not one per batch size
    padded = np.zeros(max(1024, 1 << int(sizes.max() - 1).bit_length()), np.uint8)
    padded[:data.size] = data
    stacked = _host_allgather(padded)
    return [pickle.loads(stacked[p, :int(sizes[p])].tobytes()) for p in range(len(sizes))]


def _host_allgather(row: np.ndarray, mesh: Mesh | None = None) -> np.ndarray:
    """[processes, n]: every process's 1-D `row` (same length and dtype on all), on every process.

    One device per host takes part (`multihost_utils.process_allgather` gathers on every local
    device): the hosts' bytes cross once, and the gather is one group of devices (see
    `_connect_groups` for why that matters on CPU). `mesh`: the group, one device per process along
    `HOSTS_AXIS` (default: each process's first device).
    """
    mesh = _hosts_mesh() if mesh is None else mesh
    local = jax.device_put(row[None], mesh.devices[jax.process_index()])
    stacked = jax.make_array_from_single_device_arrays(
        (mesh.size,) + row.shape, NamedSharding(mesh, PartitionSpec(HOSTS_AXIS)), [local])
    return np.asarray(_replicate_on(mesh)(stacked).addressable_data(0))


@functools.cache
def _hosts_mesh() -> Mesh:
    """The first device of each process, in process order."""
    return _group_mesh([jax.local_devices(process_index=p)[0] for p in range(jax.process_count())])


def _group_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """One device per process (in process order) along `HOSTS_AXIS`."""
    return Mesh(np.array(devices), (HOSTS_AXIS,), axis_types=(AxisType.Explicit,))


def _connect_groups(groups: np.ndarray) -> None:
    """Opens the cross-host device groups `groups` [group, process] one at a time, in one order.

    On CPU, processes exchange collectives over gloo, which connects a group of devices on its
    first use. A program whose collective spans several new groups at once (a reshard replicated
    over hosts: one group per local device) has each process connect them from its own threads,
    and two processes can then each wait on a group the other has not reached until gloo's 30 s
    deadline (a CI run timed out so, in a gather over two groups). One small gather per group
    first, in the same order on every host, leaves nothing for the bigger program to connect.
    Accelerators need none of it.
    """
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return
    for group in groups:
        _host_allgather(np.zeros(1, np.uint8), _group_mesh(list(group)))


@functools.cache
def _replicate_on(mesh: Mesh):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def broadcast_object(obj: Any) -> Any:
    """Process 0's `obj` on every process (the others pass anything, e.g. None)."""
    return allgather_objects(obj if jax.process_index() == 0 else None)[0]


def gather_shares(items: Sequence[Any]) -> list[Any]:
    """Concatenates every process's share (`process_share` order) back into the global list."""
    return [x for share in allgather_objects(list(items)) for x in share]


def replicate(tree, mesh: Mesh | None):
    """Commits host-made arrays (e.g. the run's PRNG key) replicated on the mesh, so every process
    holds the same global array and Orbax saves it once."""
    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):  # from host values: device_put does not take one process's device array to a global mesh
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(x)), replicated)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), replicated)
    return jax.tree.map(one, tree)
