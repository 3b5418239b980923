"""Evaluation: the policy plays a split's tasks `samples` times each; the summary is logged."""
from __future__ import annotations

from typing import Any

import jax

from cope_jax.run import distributed
from cope_jax.run import faults as faults_lib
from cope_jax.run import metrics as metrics_lib
from cope_jax.run.build import Components
from cope_jax.run.progress import Bar
from cope_jax.stages.loop import rollout, rollout_runner


def evaluate(parts: Components, step: int, *, split: str | None = None, samples: int | None = None,
             tasks: int | None = None, name: str = "eval", progress: bool = False) -> dict[str, Any]:
    """Evaluates the policy after RL step `step` (config defaults: `eval.*`, `env.eval_split`; `tasks`
    0: all of the split's) and logs the summary as `name`; returns the summary."""
    c = parts.config
    split = split or c.env.eval_split
    samples = samples or c.eval.samples
    ids = parts.family.task_ids(split)
    n = tasks if tasks is not None else c.eval.tasks
    ids = stratified(ids, n, parts.family.task_family) if n else ids
    schedule = [(t, g) for g, t in enumerate(ids) for _ in range(samples)]
    key = jax.random.fold_in(jax.random.key(c.seed + 1), step)
    share = distributed.process_share(len(schedule))
    bar = Bar(0, share.stop - share.start, enabled=progress and parts.is_main, desc=f"eval step {step} (episodes)")
    trajs, stats = rollout(parts, rollout_runner(parts, "eval"), schedule, key, on_progress=bar.to)
    bar.close()
    trajs, faults = faults_lib.drop(trajs, parts.max_fault_fraction, what=f"evaluation at step {step}")
    summary = metrics_lib.summarize(trajs, overall=parts.family.overall)
    summary.update(split=split, samples=samples, tasks=len(ids), seconds=stats.wall_s, **faults.record(),
                   env_replays=float(stats.replays))
    parts.log.write(name, step, {k: v for k, v in summary.items() if not isinstance(v, dict)}
                    | {f"succ/{f}": v["succ"] for f, v in summary["families"].items()}
                    | {f"episodes/{f}": v["episodes"] for f, v in summary["families"].items()})
    return summary


def evaluate_once(parts: Components, step: int, *, progress: bool = False) -> dict[str, Any] | None:
    """`evaluate` after step `step` unless the run's log already has it (process 0's log decides):
    a resumed run evaluates what its last life checkpointed but did not evaluate, and nothing twice."""
    logged = metrics_lib.latest_records(metrics_lib.read_log(parts.workdir), "eval")
    if not distributed.broadcast_object(step not in logged):
        return None
    return evaluate(parts, step, progress=progress)


def stratified(ids: list, n: int, family_of) -> list:
    """n of `ids`, taken in turn from each sub-task family (in order of first appearance, each in
    its own order), so a small evaluation covers the families instead of the first one."""
    by_family: dict[str, list] = {}
    for t in ids:
        by_family.setdefault(family_of(t), []).append(t)
    queues = list(by_family.values())
    out = []
    while len(out) < min(n, len(ids)):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out
