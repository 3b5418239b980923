"""`launch.accept`'s train section: one micro-batch of the RL train step on this machine's devices,
measured beside the planner's prediction of the same program on the same devices, in the same run.

The program is the planner's own (`cope_jax/plan/programs.py: run_programs` on `jax.devices()`): its
compiled layout (new outputs + temporaries) is the predicted peak, its analytical FLOPs on this
device's public figures the predicted time; the measured peak is the device allocator's (TPU / GPU) or, on
CPU, the process's resident memory sampled every millisecond during the step, over its level before.
Model FLOPs utilization: the planner's analytical FLOPs over the measured time and the peak.
"""
from __future__ import annotations

import threading
import time

from launch.accept import device as accept_device
from launch.accept.report import Check

# size -> (config, overrides, model presets, largest first: the first whose step fits the device;
# None: the config's own random model)
SIZES = {"tiny": ("configs/demo.py", dict(rollout=dict(sampler_rows=8, max_len=256, max_turn_tokens=16),
                                          train=dict(row_len=256, rows_per_micro=2, logprob_chunk=256)), (None,)),
         "full": ("configs/sciworld.py", dict(train=dict(rows_per_micro=1)),
                  ("Qwen2.5-7B-Instruct", "Qwen2.5-3B-Instruct", "Qwen2.5-1.5B-Instruct", "Qwen2.5-0.5B-Instruct"))}
SIZES["quick"] = SIZES["full"]  # one step compile and a few timed calls: already inside the budget
MEMORY_WITHIN, TIME_WITHIN = 1.25, 2.0


def run(*, size: str, repeats: int) -> list[Check]:
    import jax

    c, cfg, program, compiled, fallback = _fitting(size)
    state, batch, coefs = _inputs(c, cfg, compiled)
    predicted_peak = accept_device.compiled_peak_bytes(compiled) - program.param_bytes - program.optimizer_bytes
    step = lambda s: compiled(s, batch, coefs, None)  # noqa: E731 (the step donates its state: thread it)
    state, _ = step(state)  # warm-up
    jax.block_until_ready(state)
    peak, state = _peak_during(step, state)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        state, metrics = step(state)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - t)
    predicted = accept_device.roofline_s(program.analytic_flops, program.must_bytes or 0.0)
    chip = accept_device.chip()
    shape = f"{program.shape}, {cfg.num_layers} layers of {cfg.hidden_size}"
    time_note = "" if predicted is not None else "no roofline: this device has no public figures"
    checks = [
        Check("train", f"train_step ({shape}) seconds", "s", best, predicted,
              within=None if predicted is None else TIME_WITHIN, note="; ".join(filter(None, (fallback, time_note)))),
        Check("train", f"train_step ({shape}) peak memory over its inputs", "B", peak, predicted_peak,
              within=MEMORY_WITHIN, note=_memory_note()),
    ]
    if chip is not None:
        mfu = program.analytic_flops / best / chip.peak_flops
        checks.append(Check("train", f"train_step ({shape}) model FLOPs utilization", "", mfu,
                            note="analytical FLOPs per chip / time / peak"))
    return checks


def planned(*, size: str, topology: str) -> list[Check]:
    """The same train step planned for `topology` (`launch.plan`'s numbers, rows split as the planner
    chooses): predictions only, never measured here unless this machine is that chip."""
    from cope_jax.plan import planner, targets

    c, cfg = _config(size, SIZES[size][2][0])  # the paper config's own model
    c.train.rows_per_micro = 0  # the planner's choice for the target's mesh
    target = targets.get_target(topology)
    plan = planner.plan(c, "accept", target, cfg, "accept", (1, target.chips, 1), only=("train_step",))
    (r,) = plan.results
    here = accept_device.chip()
    note = (f"planned only: this machine has no {target.chip.kind}" if here != target.chip
            else "planned for this machine's chip: the train section measures it")
    name = f"train_step ({r.shape}, {cfg.num_layers} layers) on {target.name}"
    return [Check("plan", f"{name} seconds", "s", None, r.est_s, note=note),
            Check("plan", f"{name} memory per chip", "B", None, r.total,
                  note=note + ("" if r.fits else "; does NOT fit"))]


def _fitting(size: str):
    """(run config, model config, Program, compiled step, a note naming the presets that did not fit):
    the size's largest preset whose step fits this device (its last one regardless)."""
    budget = accept_device.memory_budget()
    *larger, smallest = SIZES[size][2]
    skipped = []
    for preset in larger:
        c, cfg = _config(size, preset)
        program = _program(c, cfg)
        state = 2 * program.param_bytes + program.optimizer_bytes  # parameters, gradients, optimizer
        if budget is not None and state > budget:
            skipped.append(f"{preset}: its state alone is {state / 2**30:.1f} GiB")
            continue
        compiled = program.lower().compile()
        peak = accept_device.compiled_peak_bytes(compiled)
        if budget is None or peak <= budget:
            return c, cfg, program, compiled, _fallback_note(skipped, budget)
        skipped.append(f"{preset}: its step lays out {peak / 2**30:.1f} GiB")
    c, cfg = _config(size, smallest)
    program = _program(c, cfg)
    return c, cfg, program, program.lower().compile(), _fallback_note(skipped, budget)


def _fallback_note(skipped: list[str], budget) -> str:
    if not skipped:
        return ""
    return f"{'; '.join(skipped)}, over the {budget / 2**30:.1f} GiB this device gives a program"


def _config(size: str, preset: str | None):
    """(run config, model config) of the measured train step: `preset`'s model (None: the config's
    own random model)."""
    from cope_jax.run import run_config
    from models import presets

    path, overrides, _ = SIZES[size]
    c = load_config(path)
    for group, values in overrides.items():
        c[group].update(values)
    c.warmstart.steps = 0
    execution = run_config.execution(c)
    cfg = presets.preset_config(preset, **execution) if preset else run_config.random_model_config(c, 1024)
    return c, cfg


def load_config(path: str):
    """A config file's `cope` config (the method the accepted programs train)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accept_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("cope")


def _program(c, cfg):
    """The planner's train_step Program on this machine's devices (a (1, devices, 1) mesh); on CPU one
    device: the process's memory is every CPU device's, the compiler's layout one device's."""
    import jax

    from cope_jax.plan import programs

    devices = jax.devices()[:1] if jax.default_backend() == "cpu" else jax.devices()
    _, progs = programs.run_programs(c, cfg, devices, (1, len(devices), 1))
    return next(p for p in progs if p.name == "train_step")


def _inputs(c, cfg, compiled):
    """Real (state, batch, coefficients) laid out as the compiled step takes them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cope_jax.run import distributed, run_config
    from cope_jax.train import train_step as ts
    from models import qwen

    # the fourth argument is LoRA's frozen base: None here (acceptance trains every weight)
    (state_info, batch_info, coef_info, _), _ = compiled.args_info
    (state_sharding, batch_sharding, coef_sharding, _), _ = compiled.input_shardings
    devices = list({d for s in jax.tree.leaves(state_sharding) for d in s.device_set})
    mesh = distributed.run_mesh((1, len(devices), 1), sorted(devices, key=lambda d: d.id))
    model = qwen.create_model(cfg, mesh=mesh)
    optimizer = nnx.Optimizer(model, ts.make_optimizer(run_config.optimizer_config(c)), wrt=nnx.Param)
    state = jax.device_put(nnx.split((model, optimizer))[1], state_sharding)
    batch = jax.tree.map(_batch_leaf, batch_info, batch_sharding)
    coefs = jax.tree.map(lambda i, s: jax.device_put(jnp.ones(i.shape, i.dtype), s), coef_info, coef_sharding)
    return state, batch, coefs


def _batch_leaf(info, sharding):
    """A real array for one batch field: one segment per row, positions 0.., masks on, ids small."""
    import jax
    import numpy as np

    shape, dtype = info.shape, np.dtype(info.dtype)
    if dtype == np.bool_:
        value = np.ones(shape, bool)
    elif np.issubdtype(dtype, np.integer):
        value = np.broadcast_to(np.arange(shape[-1]) % 97, shape).astype(dtype)  # tokens / positions / indices
    else:
        value = np.full(shape, -1.0, dtype)  # log-probs, advantages, weights
    return jax.device_put(value, sharding)


def _peak_during(step, state):
    """(peak bytes of one call over the level before it, the new state): the device allocator's peak,
    or the process's resident memory sampled every millisecond (CPU)."""
    import jax

    before = accept_device.peak_bytes_in_use()
    if before is not None:
        base = jax.devices()[0].memory_stats()["bytes_in_use"]
        state, metrics = step(state)
        jax.block_until_ready(metrics)
        return max(0, accept_device.peak_bytes_in_use() - base), state
    _return_freed_memory()  # else the step reuses pages an earlier compile freed, and RSS does not show it
    base, high, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            high[0] = max(high[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    state, metrics = step(state)
    jax.block_until_ready(metrics)
    done.set()
    sampler.join()
    return max(0, high[0] - base), state


def _return_freed_memory() -> None:
    """glibc's malloc_trim: freed heap pages back to the system (no-op where there is no glibc)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_note() -> str:
    return ("the allocator's peak over its level before the call" if accept_device.peak_bytes_in_use() is not None
            else "the process's resident memory over its level before the call (CPU: no allocator statistics)")
