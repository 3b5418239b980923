"""Will it fit? A run's programs compiled for a target, with memory, cost and layout warnings.

`plan(config, target, model_cfg, mesh)` lays the run out on the target's devices, compiles every
program the run executes (`programs.py`) and measures it (`measure.py`). `mesh='auto'` tries the
tensor-parallel widths a host allows, smallest first, and keeps the first whose programs all fit, or
else the one closest to fitting (the memory compiles only; the cost compiles run once, for the
chosen mesh). `sampler_rows='auto'` then finds the most sampler rows per host, up to the config's,
whose programs fit beside the trainer's resident state (the mesh search then weighs the trainer's
programs only: the sampler decodes on a mesh of its own, `run/replica.py`).
"""
from __future__ import annotations

import copy
import dataclasses
import time

import ml_collections

from cope_jax.plan import checks, measure, programs, targets
from cope_jax.run import run_config
from models.config import ConfigError, QwenConfig


@dataclasses.dataclass
class Plan:
    config: str
    model: str
    target: targets.Target
    mesh: tuple[int, int, int]
    model_cfg: QwenConfig
    results: list[measure.Result]
    warnings: list[str]
    seconds: float
    sampler_rows: int = 0      # per host, as planned
    rows_searched: bool = False  # sampler_rows found by the search (the most that fit)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.results)


def parse_mesh(text: str) -> tuple[int, ...] | str:
    """'auto' or 'd,f,t' (parentheses allowed; one entry may be -1: the remaining chips)."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        shape = tuple(int(v) for v in text.strip("()").split(","))
    except ValueError:
        raise ConfigError(f"--mesh={text!r}: expected 'auto' or three integers data,fsdp,tp") from None
    if len(shape) != 3 or any(v == 0 or v < -1 for v in shape):
        raise ConfigError(f"--mesh={text!r}: expected three positive sizes data,fsdp,tp (one may be -1)")
    return shape


def resolve_mesh(shape: tuple[int, ...], target: targets.Target) -> tuple[int, int, int]:
    """The mesh with -1 filled in; it must use every chip of the target."""
    shape = list(shape)
    known = _size(v for v in shape if v != -1)
    if shape.count(-1) > 1:
        raise ConfigError(f"mesh {tuple(shape)}: at most one -1")
    if -1 in shape:
        if target.chips % known:
            raise ConfigError(f"mesh {tuple(shape)} does not divide the {target.chips} chips of {target.name}")
        shape[shape.index(-1)] = target.chips // known
    if _size(shape) != target.chips:
        raise ConfigError(f"mesh {tuple(shape)} has {_size(shape)} devices but {target.name} has {target.chips} chips")
    return tuple(shape)


def _size(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def plan(c: ml_collections.ConfigDict, config_name: str, target: targets.Target, model_cfg: QwenConfig,
         model_name: str, mesh, *, cost: bool = True, only: tuple[str, ...] = (), sampler_rows: str | None = None,
         log=lambda msg: None) -> Plan:
    """only: plan these programs (by name) and no others; () plans every one. sampler_rows 'auto':
    search `rollout.sampler_rows` (module docstring); None: the config's."""
    t0 = time.perf_counter()
    devices = targets.devices(target)
    hosts = targets.host_devices(target)
    search_rows = sampler_rows == "auto"
    measured = {}
    if mesh == "auto":
        weighed = (lambda name: name not in programs.SAMPLER_PROGRAMS) if search_rows else (lambda name: True)
        mesh, measured = _auto_mesh(c, target, model_cfg, devices, hosts, log, weighed)
    mesh = resolve_mesh(mesh, target)
    if search_rows:
        c, sampled = _auto_rows(c, target, model_cfg, devices, hosts, mesh, log)
        measured.update(sampled)
    layout, progs = programs.run_programs(c, model_cfg, devices, mesh, hosts)
    unknown = sorted(set(only) - {p.name for p in progs})
    if unknown:
        raise ConfigError(f"--programs: no program {', '.join(unknown)}; this run has {', '.join(p.name for p in progs)}")
    progs = [p for p in progs if not only or p.name in only]
    results = []
    for p in progs:
        log(f"compiling {p.name} ({p.shape}) for {target.name}, mesh {mesh}")
        if p.name in measured:  # memory known from the search; only the cost compiles are left
            results.append(measured[p.name])
            if cost:
                measure.add_cost(results[-1], p, target)
        else:
            results.append(measure.measure(p, target, cost=cost))
    warnings = checks.layout_warnings(c, model_cfg, layout)
    if hosts is not None:
        warnings.append(f"{target.chip.kind}: the TPU compiler takes only programs over the whole slice; the "
                        f"sampler's per-host programs were compiled for a one-host slice of {len(hosts)} chips")
    return Plan(config_name, model_name, target, mesh, model_cfg, results, warnings, time.perf_counter() - t0,
                sampler_rows=run_config.sampler_rows(c, layout.hosts), rows_searched=search_rows)


def _auto_mesh(c, target, model_cfg, devices, hosts, log, weighed):
    """The smallest tensor-parallel width (within a host) at which every program `weighed` (by name)
    fits, and the memory results of those programs. When none fits, the width whose tightest
    program comes closest."""
    widths = [t for t in (1, 2, 4, 8) if t <= target.chips_per_host and target.chips % t == 0]
    tried = []
    for tp in widths:
        mesh = (1, target.chips // tp, tp)
        log(f"mesh auto: trying {mesh}")
        measured = {}
        for p in programs.run_programs(c, model_cfg, devices, mesh, hosts)[1]:
            if weighed(p.name):
                measured[p.name] = measure.measure(p, target, cost=False)
                if not measured[p.name].compiled:
                    break  # its state alone does not fit: the mesh is out, its other compiles moot
        if all(r.fits for r in measured.values()):
            return mesh, measured
        tried.append((max(r.total / r.usable_bytes for r in measured.values()), mesh, measured))
    _, mesh, measured = min(tried, key=lambda t: t[0])
    return mesh, measured


def _auto_rows(c, target, model_cfg, devices, hosts, mesh, log):
    """(the config with the most sampler rows per host that fit, their sampler programs' memory
    results): the config's own rows when they fit, else the largest power of two below them that
    does (bisected: a program's memory grows with its rows), else one row (which does not fit)."""
    host_count = len({d.process_index for d in devices})
    probed = {}

    def probe(rows: int) -> bool:
        trial = copy.deepcopy(c)
        trial.rollout.sampler_rows = rows
        log(f"sampler rows auto: trying {rows} per host")
        progs = programs.run_programs(trial, model_cfg, devices, mesh, hosts)[1]
        probed[rows] = trial, {p.name: measure.measure(p, target, cost=False)
                               for p in progs if p.name in programs.SAMPLER_PROGRAMS}
        return all(r.fits for r in probed[rows][1].values())

    most = run_config.sampler_rows(c, host_count)
    if probe(most):
        return probed[most]
    best, lo, hi = 1, 0, (most - 1).bit_length() - 1  # exponents of the powers of two below `most`
    while lo <= hi:
        mid = (lo + hi) // 2
        if probe(1 << mid):
            best, lo = 1 << mid, mid + 1
        else:
            hi = mid - 1
    if best not in probed:
        probe(best)
    return probed[best]
