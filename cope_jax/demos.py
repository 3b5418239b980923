"""Expert demonstrations for the supervised warm start (the demo's first stage).

A family that can solve its own tasks exposes `expert_actions(task_id) -> list[str]` on its static
side (the built-in environment does). The expert's actions are played through the environment pool,
so observations are the real ones, and each episode is laid out by the same code as a sampled
rollout (`scripted_trajectory`); the replies are written in the family's `reply_format`.
"""
from __future__ import annotations

from typing import Sequence

from cope_jax.rollout import RolloutRunner, scripted_trajectory
from cope_jax.trajectory import Trajectory

def expert_trajectories(runner: RolloutRunner, task_ids: Sequence[int], *, max_rounds: int,
                        reply_format: str | None = None, timeout: float = 120.0) -> list[Trajectory]:
    """Plays the expert on each task (all episodes in flight at once); keeps the successful ones.
    Replies follow `reply_format` (default: the family's)."""
    family, pool = runner.family, runner.pool
    reply_format = reply_format or family.reply_format
    if not hasattr(family, "expert_actions"):
        raise ValueError(f"environment family {runner.family_name!r} has no expert_actions(); "
                         "the warm start needs demonstrations")
    plans = {i: list(family.expert_actions(t))[:max_rounds] for i, t in enumerate(task_ids)}
    record = {i: {"obs": [], "infos": [], "score": 0.0, "success": False, "next": 0} for i in plans}
    for i, t in enumerate(task_ids):
        pool.submit_reset(("demo", i), runner.family_name, int(t), max_steps=max_rounds)
    live = len(plans)
    while live:
        results = pool.poll(timeout)
        if not results:
            raise TimeoutError(f"expert demonstrations: no environment result within {timeout} s")
        for r in results:
            i = r.episode[1]
            rec = record[i]
            rec["obs"].append(r.observation)
            rec["infos"].append(dict(r.info))
            rec["score"], rec["success"] = float(r.score), bool(r.success)
            if r.done or not r.ok or rec["next"] >= len(plans[i]):
                live -= 1
                if not r.done and r.ok:
                    pool.release(r.episode)
                continue
            pool.submit_step(r.episode, plans[i][rec["next"]])
            rec["next"] += 1
    out = []
    for i, t in enumerate(task_ids):
        rec = record[i]
        if rec["success"]:
            replies = [reply_format.format(action=a) for a in plans[i][:rec["next"]]]
            out.append(scripted_trajectory(runner, t, i, rec["obs"], rec["infos"], replies,
                                           score=rec["score"], success=True))
    return out
