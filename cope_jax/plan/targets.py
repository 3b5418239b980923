"""The machines a run can be planned for, and their devices without the machine.

One table, `TARGETS`: TPU slices by their Cloud names (`v5p-32` = 16 chips of 2 TensorCores) and
NVIDIA GPU hosts. XLA compiles for any of them on this host: the TPU compiler through the TPU
runtime library (`requirements-tpu.txt`), the GPU compiler through the CUDA PJRT plugin with a
`GpuTargetConfigProto` from `gpu_specs/` (no GPU, driver or CUDA libraries needed). Outside a CUDA
environment the plugin lives in `<venv>/gpu-compiler` (`requirements-gpu-compiler.txt`), where JAX's
plugin discovery does not load it into every program; `devices` loads it when a GPU target asks.

Peak FLOP/s (dense bf16), HBM bytes and bandwidth are per device (a chip; on TPU7x a TensorCore), from
the vendors' public figures (sources beside the table).
`usable_bytes` is what a program may use: on TPUs the compiler's own limit (what it reports when it
refuses a program: `tests/plan/test_plan.py` checks the table against it); on GPUs JAX's allocator takes `XLA_PYTHON_CLIENT_MEM_FRACTION` of the
memory (0.75 by default), and the GPU compiler checks nothing, so the planner compares.
"""
from __future__ import annotations

import dataclasses
import os
import sys

from models import native_stderr
from models.config import ConfigError

GIB = 1 << 30
_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class Chip:
    kind: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    compiler_limit: int = 0  # TPU: the memory the TPU compiler lets a program use
    tpu_name: str = ""   # the TPU runtime's name in topology strings
    tpu_config: str = ""  # the TPU runtime's chip config ('megacore': one device per chip)
    gpu_spec: str = ""    # gpu_specs/<file>
    # TPU: the compiler takes only programs over every chip of a multi-host slice (v5e: "limited ICI
    # routing"; v6e aborts on a host's device ids), so a host's own programs (the sampler's) compile
    # for a one-host slice instead
    whole_slice_programs: bool = False
    cores: int = 1  # devices the runtime makes per chip (TPU7x: one per TensorCore, 2 a chip)


CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1228e9, int(30.75 * GIB), tpu_name="v4", tpu_config="megacore"),
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9, int(15.75 * GIB), tpu_name="v5e", tpu_config="default",
                whole_slice_programs=True),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, int(95.74 * GIB), tpu_name="v5p", tpu_config="megacore"),
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, 1640e9, int(31.25 * GIB), tpu_name="v6e", tpu_config="default",
                whole_slice_programs=True),
    # TPU7x (Ironwood), per device = one of a chip's two TensorCores: a chip has 192 GB HBM at
    # 7.37 TB/s and 4,614 TFLOP/s FP8, half that in bf16 (Google Cloud, "TPU7x (Ironwood)",
    # cloud.google.com/tpu/docs/tpu7x, and the Ironwood announcement, April 2025); the compiler's
    # limit is its refusal's "available HBM" (94.75 GiB per device)
    "tpu7x": Chip("TPU7x core", 96 * GIB, 2307e12 / 2, 7370e9 / 2, int(94.75 * GIB), tpu_name="tpu7x",
                  tpu_config="default", cores=2),
    # NVIDIA data sheets (A100 80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s; H100 SXM: 989 dense (1,979
    # with sparsity), 3.35 TB/s; H200 SXM: 989 dense, 4.8 TB/s); memory as the CUDA driver reports it
    "A100": Chip("A100-SXM4-80GB", 85100068864, 312e12, 2039e9, gpu_spec="a100_sxm_80gb.txtpb"),
    "H100": Chip("H100-SXM5-80GB", 84978434048, 989e12, 3352e9, gpu_spec="h100_sxm_80gb.txtpb"),
    "H200": Chip("H200-SXM-141GB", 150754820096, 989e12, 4800e9, gpu_spec="h200_sxm_141gb.txtpb"),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice or GPU host. `chips` and `chips_per_host` count devices (what a mesh is made of and the
    report calls a chip): on TPU7x two per physical chip."""

    name: str
    chip: Chip
    shape: tuple[int, ...]  # TPU: physical chips along the torus axes; GPU: (hosts, GPUs per host)
    chips_per_host: int

    @property
    def platform(self) -> str:
        return "tpu" if self.chip.tpu_name else "cuda"

    @property
    def chips(self) -> int:
        n = self.chip.cores
        for s in self.shape:
            n *= s
        return n

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def topology(self) -> str:
        """The topology string XLA takes ('v5p:2x2x4'; GPUs: slices x hosts x GPUs)."""
        if self.platform == "tpu":
            return f"{self.chip.tpu_name}:" + "x".join(map(str, self.shape))
        return "1x" + "x".join(map(str, self.shape))

    @property
    def usable_bytes(self) -> int:
        if self.platform == "tpu":
            return self.chip.compiler_limit
        return int(self.chip.hbm_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def _tpu(chip: str, chips: int, shape: tuple[int, ...], per_host: int = 4) -> Target:
    """A slice of `chips` physical chips, `per_host` of them a host."""
    cores = CHIPS[chip].cores
    name = f"{chip}-{chips * 2 if chip in ('v4', 'v5p', 'tpu7x') else chips}"  # v4 / v5p / tpu7x names count cores
    return Target(name, CHIPS[chip], shape, per_host * cores)


TARGETS: dict[str, Target] = {t.name: t for t in [
    *[_tpu("v4", n, s) for n, s in [(4, (2, 2, 1)), (8, (2, 2, 2)), (16, (2, 2, 4)), (32, (2, 4, 4)),
                                    (64, (4, 4, 4))]],
    *[_tpu("v5p", n, s) for n, s in [(4, (2, 2, 1)), (8, (2, 2, 2)), (16, (2, 2, 4)), (32, (2, 4, 4)),
                                     (64, (4, 4, 4)), (128, (4, 4, 8))]],
    *[_tpu(c, n, s, per_host=8 if n == 8 else 4) for c in ("v5e", "v6e")
      for n, s in [(8, (2, 4)), (16, (4, 4)), (32, (4, 8)), (64, (8, 8)), (128, (8, 16)), (256, (16, 16))]],
    *[_tpu("tpu7x", n, s) for n, s in [(4, (2, 2, 1)), (8, (2, 2, 2)), (16, (2, 2, 4)), (32, (2, 4, 4)),
                                       (64, (4, 4, 4)), (128, (4, 4, 8))]],
    *[Target(f"{n}x{gpu}", CHIPS[gpu], (1, n), n) for gpu in ("A100", "H100", "H200") for n in (1, 8)],
    Target("2x8xH100", CHIPS["H100"], (2, 8), 8),
]}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ConfigError(f"unknown topology {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


def devices(target: Target) -> list:
    """The target's devices (abstract: they compile, never run), in the runtime's order; a
    device's `process_index` is its host."""
    import jax
    from jax.experimental import topologies

    # compiling only: other processes (a second planner, test workers) may load the TPU runtime too
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # the runtimes log that this host has no TPU / GPU: shown only if the call fails
    with native_stderr.held(lambda text, failed: text if failed else ""):
        jax.devices()  # loads every installed runtime (logging) now rather than at the first compile
        if target.platform == "tpu":
            topo = topologies.get_topology_desc(
                platform="tpu", topology_name=target.topology, chip_config_name=target.chip.tpu_config,
                chips_per_host_bounds=_host_bounds(target), num_slices=1)
        else:
            _load_gpu_compiler()
            with open(os.path.join(_SPECS, target.chip.gpu_spec)) as f:
                spec = f.read()
            topo = topologies.get_topology_desc(platform="cuda", topology_name=target.name,
                                                topology=target.topology, target_config=spec)
    found = list(topo.devices)
    if len(found) != target.chips:
        raise RuntimeError(f"{target.name}: the runtime made {len(found)} devices, expected {target.chips}")
    return found


GPU_COMPILER = os.path.join(sys.prefix, "gpu-compiler", "jax_plugins", "xla_cuda12", "xla_cuda_plugin.so")


def _load_gpu_compiler() -> None:
    """Registers the CUDA plugin from `GPU_COMPILER` unless a CUDA backend is already known."""
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    if "cuda" in xla_bridge._backend_factories:  # a CUDA environment: JAX found the plugin itself
        return
    if not os.path.isfile(GPU_COMPILER):
        raise ConfigError(f"GPU targets need the CUDA compiler plugin at {GPU_COMPILER}: pip install --no-deps "
                         f"--target {os.path.join(sys.prefix, 'gpu-compiler')} -r requirements-gpu-compiler.txt")
    xla_bridge.register_plugin("cuda", priority=500, library_path=GPU_COMPILER,
                               options=xla_client.generate_pjrt_gpu_plugin_options())


def host_devices(target: Target) -> list | None:
    """Devices to compile one host's own programs on: None (host 0's devices of the slice), or, on
    a multi-host slice of a chip whose compiler takes only whole-slice programs, the devices of a
    one-host slice of the same chip and host shape."""
    if target.hosts == 1 or not target.chip.whole_slice_programs:
        return None
    shape = _host_bounds(target)[:len(target.shape)]
    return devices(Target(f"{target.name} host", target.chip, shape, target.chips_per_host))


def _host_bounds(target: Target) -> tuple[int, int, int]:
    """The physical chips of one host along the torus axes: 2x2 (4 chips) or 2x4 (a single 8-chip host)."""
    return (2, 4, 1) if target.chips_per_host // target.chip.cores == 8 else (2, 2, 1)


