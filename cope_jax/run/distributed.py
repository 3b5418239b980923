"""Multi-host runs on JAX's multi-controller runtime: every host runs the same program.

A run on several hosts (a TPU VM slice, several GPU machines, or several local CPU processes in
the tests) works like this:

- `initialize` joins the processes (`jax.distributed.initialize`); on TPU VMs, Slurm and Open MPI
  every argument is detected, elsewhere the coordinator address, process count and id are given.
- `run_mesh` builds the global (data, fsdp, tp) mesh over every device of every host; the train
  step is one SPMD program over it (`cope_jax/train/train_step.py`).
- Each host rolls out its own contiguous share of a step's episodes (`process_share`) with its
  own environment pool and its own sampler. The sampler cannot run on the global mesh: hosts
  decode different episodes, for different numbers of turns. It runs on `replica.SamplingReplica`,
  the policy's parameters laid out for decoding on this host's devices (one reshard per rollout
  batch).
- `allgather_objects` brings every host's trajectories to every host, in global episode order, so
  each host builds the same packed mini-batches and `jax.device_put` takes each host's rows of the
  globally sharded batch. Only token ids, masks and logprobs travel; the packing is host work.

Only process 0 writes logs, plots and reports; Orbax checkpoints are written by every process.
"""
from __future__ import annotations

import functools
import pickle
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import models
from models.config import ConfigError

HOSTS_AXIS = "hosts"  # the axis of a group of devices with one device per process


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> None:
    """Joins this process to a multi-controller run (call before any other JAX work).

    Arguments left None are detected (TPU VM slices, Slurm, Open MPI) or read from
    JAX_COORDINATOR_ADDRESS; CPU processes exchange collectives over gloo (JAX's default).
    """
    if (num_processes is None) != (process_id is None):
        raise ConfigError("give both num_processes and process_id, or neither (auto-detection)")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)


def run_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The (data, fsdp, tp) mesh of `config.mesh` over `devices` (default: every device of every
    host; the planner passes a topology's); -1 takes the remaining devices. A mesh of one device
    means no mesh (plain single-device arrays). On several hosts the mesh must span every device."""
    devices = list(jax.devices() if devices is None else devices)
    n, hosts = len(devices), len({d.process_index for d in devices})
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ConfigError(f"config.mesh {tuple(shape)}: at most one -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if n % rest:
            raise ConfigError(f"config.mesh {tuple(shape)} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    size = int(np.prod(shape))
    if size > n:
        raise ConfigError(f"config.mesh {tuple(shape)} needs {size} devices, have {n}")
    if hosts > 1 and size != n:
        raise ConfigError(f"config.mesh {tuple(shape)} uses {size} of the {n} devices of "
                         f"{hosts} hosts: a multi-host mesh must use them all")
    if size == 1:
        return None
    return models.make_mesh(tuple(shape), devices=devices[:size])


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
    `connect_groups` for why that matters on CPU). `mesh`: the group, one device per process along
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


def connect_groups(groups: np.ndarray) -> None:
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
