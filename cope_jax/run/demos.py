"""Expert demonstrations for the supervised warm start (the demo's first stage).

A family that can solve its own tasks exposes `expert_actions(task_id) -> list[str]` on its static
side (the built-in environment does). The expert's actions are played through the environment pool,
so observations are the real ones, and each episode is laid out by the same code as a sampled
rollout (`scripted_trajectory`); the replies are written in the family's `reply_format`. The same
play (`play_actions`) gives the text the demo's tokenizer is trained on (`cope_jax/run/build.py`).

Recovery (`mistakes` > 0, DART-style): before each expert action, with that probability, a broken
copy of it is played first (its last word dropped: `go`, `take`, `put cup in`), which the
environment answers with its invalid-action message, and the expert then carries on (slips only
where the round limit leaves room for them). The broken reply is context only (no loss), so the
policy is taught what to do after a mistake, never the mistake; without it, a policy imitating a
flawless expert has never seen the invalid-action message and tends to repeat the failed action
until the round limit.

Dawdling (`dawdle` > 0): before each expert action, with that probability, the family's
`idle_action` (the built-in house's `look`) is played first and trained like the expert's own
actions: a demonstrator that wastes rounds. The imitating policy copies the habit, and the round
limit makes it cost episodes, so a warm-started policy has something RL can learn from its own
reward (the demo: sharpening away a habit the demonstrations taught), besides what imitation leaves.
"""
from __future__ import annotations

import random
from typing import Sequence

from cope_jax.rollout.episode import scripted_trajectory
from cope_jax.rollout.runner import RolloutRunner
from cope_jax.rollout.trajectory import Trajectory
from models.config import ConfigError


def _broken(action: str) -> str:
    head, _, _ = action.rpartition(" ")
    return head or f"{action} it"


def expert_trajectories(runner: RolloutRunner, task_ids: Sequence[int], *, max_rounds: int,
                        reply_format: str | None = None, timeout: float = 120.0, mistakes: float = 0.0,
                        dawdle: float = 0.0, seed: int = 0) -> list[Trajectory]:
    """Plays the expert on each task (all episodes in flight at once); keeps the successful ones.
    Replies follow `reply_format` (default: the family's). `mistakes`: the probability of a broken
    action (context only) before each expert action, `dawdle`: of the family's idle action (trained)
    (module docstring); `seed` draws both."""
    family, pool = runner.family, runner.pool
    reply_format = reply_format or family.reply_format
    if not hasattr(family, "expert_actions"):
        raise ConfigError(f"environment family {runner.family_name!r} has no expert_actions(); "
                         "the warm start needs demonstrations")
    idle = family.idle_action
    if dawdle and not idle:
        raise ConfigError(f"warmstart.dawdle={dawdle}: environment family {runner.family_name!r} has no "
                         "idle_action to dawdle with")
    rng = random.Random(seed)
    scripts, broken = {}, {}
    for i, t in enumerate(task_ids):
        expert = list(family.expert_actions(t))
        spare = max_rounds - len(expert)  # slips and idling never cost a demonstration its success
        script, slips, extra = [], set(), 0
        for a in expert:
            if extra < spare and rng.random() < mistakes:
                slips.add(len(script))
                script.append(_broken(a))
                extra += 1
            if dawdle and extra < spare and rng.random() < dawdle:
                script.append(idle)
                extra += 1
            script.append(a)
        scripts[i], broken[i] = script[:max_rounds], slips
    played = play_actions(pool, runner.family_name, [(t, scripts[i]) for i, t in enumerate(task_ids)],
                          max_rounds=max_rounds, timeout=timeout)
    out = []
    invalid = family.invalid_action_message
    for i, t in enumerate(task_ids):
        rec = played[i]
        # a broken action the environment accepted changed the state the expert planned from
        clean = all(j + 1 >= len(rec["obs"]) or rec["obs"][j + 1] == invalid for j in broken[i])
        if rec["success"] and clean:
            replies = [reply_format.format(action=a) for a in scripts[i][:rec["played"]]]
            out.append(scripted_trajectory(runner.layout, t, i, rec["obs"], rec["infos"], replies,
                                           score=rec["score"], success=True, context_only=sorted(broken[i])))
    return out


def play_actions(pool, family_name: str, scripts: Sequence[tuple[int, Sequence[str]]], *,
                 max_rounds: int | None, timeout: float = 120.0) -> list[dict]:
    """Plays each (task id, actions) through the pool, all episodes in flight at once, until the
    environment ends it or its actions run out. Per episode, in the order of `scripts`: `obs` (the reset's
    observation, then one per action played), `infos`, the last `score` and `success`, `played`
    (how many actions) and `error` (the pool's, None when every call succeeded)."""
    record = [{"obs": [], "infos": [], "score": 0.0, "success": False, "played": 0, "error": None}
              for _ in scripts]
    for i, (t, _) in enumerate(scripts):
        pool.submit_reset(("demo", i), family_name, int(t), max_rounds=max_rounds)
    live = len(scripts)
    while live:
        results = pool.poll(timeout)
        if not results:
            raise TimeoutError(f"scripted episodes: no environment result within {timeout} s")
        for r in results:
            i = r.env_key[1]
            rec, actions = record[i], scripts[i][1]
            rec["obs"].append(r.observation)
            rec["infos"].append(dict(r.info))
            rec["score"], rec["success"], rec["error"] = float(r.score), bool(r.success), r.error
            if r.done or not r.ok or rec["played"] >= len(actions):
                live -= 1
                if not r.done and r.ok:
                    pool.release(r.env_key)
                continue
            pool.submit_step(r.env_key, actions[rec["played"]])
            rec["played"] += 1
    return record
