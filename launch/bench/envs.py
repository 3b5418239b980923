"""Environment benchmark: steps/s and reset time per family with 1, 2 and 4 pool workers.

  python -m launch.bench --suite=envs [--envs_workers=1,2,4] [--envs_families=builtin,sciworld]
                                      [--envs_steps=400] [--envs_repeats=2]

For each family and worker count, one EnvPool runs as many concurrent episodes as it has workers;
every episode replays a solution (the built-in expert, ScienceWorld's gold path generated once in
this process) and is reset onto the next task when it ends, as a rollout would, until `steps` steps
are done. After one warm-up pass (the JVM's JIT), reported as best of `repeats`: aggregate
`steps_per_s` (wall clock, resets included), mean step and reset latency seen by the caller,
`first_reset_s` (worker start + first reset, e.g. the JVM launch), and the resident memory of one
worker with everything it started. For ScienceWorld, a reference line measures the package's own
`ScienceWorldEnv.step` on the same actions. One JSON object per line; `run_envs_bench` returns the
same dicts.
"""
from __future__ import annotations

import json
import logging
import os
import time

from absl import flags

from envs.pool import EnvPool
from envs.registry import make_family

flags.DEFINE_list("envs_workers", ["1", "2", "4"], "Worker counts to measure.")
flags.DEFINE_list("envs_families", ["builtin", "sciworld"], "Families to measure.")
flags.DEFINE_integer("envs_steps", 400, "Steps per measurement.")
flags.DEFINE_integer("envs_repeats", 2, "Measurements per setting; the best is reported.")
FLAGS = flags.FLAGS

_SCIWORLD_TASKS = ("find-living-thing", "use-thermometer", "chemistry-mix",
                   "lifespan-longest-lived", "identify-life-stages-2", "find-plant")


def _solutions(family: str) -> list[tuple[int, list[str]]]:
    """(task id, action list) pairs that episodes cycle through."""
    fam = make_family(family)
    if family == "sciworld":
        from envs.sciworld import POOL
        ids = [next(i for i, (n, v) in enumerate(POOL) if n == name and v == 1)
               for name in _SCIWORLD_TASKS]
        try:
            return [(i, fam.gold_actions(i)) for i in ids]
        finally:
            fam.close()
    return [(i, fam.expert_actions(i)) for i in fam.task_ids("test")[:50]]


def _group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in a process group (a worker and its JVM)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{entry}/status") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return total / 1024


def _drive(pool, family: str, workers: int, steps: int, solutions) -> dict:
    """Run `workers` concurrent episodes until `steps` steps are done; timings."""
    script: dict = {}
    cursor = [0]
    done_steps = 0
    step_lat, reset_lat = [], []

    def start(ep):
        tid, actions = solutions[cursor[0] % len(solutions)]
        cursor[0] += 1
        script[ep] = list(actions)
        pool.submit_reset(ep, family, tid, max_rounds=len(actions))

    t = time.perf_counter()
    for ep in range(workers):
        start(ep)
    while done_steps < steps:
        for r in pool.poll(timeout=60):
            if not r.ok:
                raise RuntimeError(f"{family}: {r.error}: {r.reason}")
            (reset_lat if r.kind == "reset" else step_lat).append(r.elapsed)
            done_steps += r.kind == "step"
            if r.done or not script[r.env_key]:
                pool.release(r.env_key)
                start(r.env_key)
            else:
                pool.submit_step(r.env_key, script[r.env_key].pop(0))
    wall = time.perf_counter() - t
    for r in pool.wait_all(timeout=60):  # drain the episodes still running
        pool.release(r.env_key)
    return {"steps": done_steps, "steps_per_s": round(done_steps / wall, 1),
            "step_ms_mean": round(1e3 * sum(step_lat) / len(step_lat), 2),
            "reset_s_mean": round(sum(reset_lat) / max(1, len(reset_lat)), 4),
            "resets": len(reset_lat)}


def _measure(family: str, workers: int, steps: int, repeats: int, solutions) -> dict:
    """One pool: start-up time, a warm-up pass (JIT), then the best of `repeats` runs."""
    t0 = time.perf_counter()
    with EnvPool({family: workers}) as pool:
        for w in range(workers):
            pool.submit_reset(("warm", w), family, solutions[w % len(solutions)][0])
        warm = pool.wait_all(timeout=300)
        first_reset = time.perf_counter() - t0
        assert all(r.ok for r in warm), [r.reason for r in warm if not r.ok]
        for r in warm:
            pool.release(r.env_key)
        _drive(pool, family, workers, steps, solutions)  # warm-up
        runs = [_drive(pool, family, workers, steps, solutions) for _ in range(repeats)]
        rss = max(_group_rss_mib(pid) for pid in pool.worker_pids())
    best = max(runs, key=lambda r: r["steps_per_s"])
    return {"suite": "envs", "family": family, "workers": workers, **best,
            "reset_s_mean": min(r["reset_s_mean"] for r in runs),
            "first_reset_s": round(first_reset, 2), "worker_rss_mib": round(rss, 1),
            "repeats": repeats, "cpus": os.cpu_count()}


def _package_step_reference(solutions, repeats: int) -> dict:
    """ScienceWorld's own `ScienceWorldEnv.step` in this process (what the raw path replaces)."""
    from scienceworld import ScienceWorldEnv
    from envs.sciworld import POOL
    for name in ("py4j", "scienceworld"):  # chatty at INFO; its double close() logs tracebacks
        logging.getLogger(name).setLevel(logging.ERROR)
    env = ScienceWorldEnv()
    rates = []
    try:
        for _ in range(repeats + 1):  # first pass warms the JIT
            n, t = 0, time.perf_counter()
            for tid, actions in solutions:
                env.load(*POOL[tid])
                env.reset()
                for a in actions:
                    n += 1
                    if env.step(a)[2]:
                        break
            rates.append(n / (time.perf_counter() - t))
    finally:
        env.close()
    return {"suite": "envs", "family": "sciworld", "workers": 0,
            "reference": "package ScienceWorldEnv.step, in-process, one env",
            "steps": n, "steps_per_s": round(max(rates[1:]), 1), "repeats": repeats}


def run_envs_bench(workers=(1, 2, 4), families=("builtin", "sciworld"), steps: int = 400,
                   repeats: int = 2, echo: bool = True) -> list[dict]:
    """Measure every (family, worker count); best of `repeats`; prints JSON lines if `echo`."""
    rows = []
    for family in families:
        solutions = _solutions(family)
        for n in workers:
            rows.append(_measure(family, int(n), steps, repeats, solutions))
            if echo:
                print(json.dumps(rows[-1]), flush=True)
        if family == "sciworld":
            rows.append(_package_step_reference(solutions, repeats))
            if echo:
                print(json.dumps(rows[-1]), flush=True)
    return rows


def run(argv: list[str]) -> None:
    del argv
    run_envs_bench(workers=[int(w) for w in FLAGS.envs_workers], families=FLAGS.envs_families,
                   steps=FLAGS.envs_steps, repeats=FLAGS.envs_repeats)
