"""`launch.accept`'s rl section: one RL step of the built-in demo (rollout with its environment workers,
then the update) on this machine, through the trainer's own entry point (`cope_jax.stages.entry.train_run`)
in a throw-away run directory, read back from the step's logged record.

No prediction: the step includes environment processes and host work no compiler sees; the train
section predicts the update's device program.
"""
from __future__ import annotations

import json
import os
import tempfile

from launch.accept.report import Check


def run(*, size: str, repeats: int) -> list[Check]:
    """The demo's own shapes; on an accelerator the second of two steps (the first compiles), on CPU
    the first (a second would double the section's minutes)."""
    del repeats
    from cope_jax.stages.entry import train_run
    from launch.accept.train import load_config

    steps = 1 if size == "tiny" else 2
    c = load_config("configs/demo.py")
    c.warmstart.steps, c.train.steps, c.eval.every = 0, steps, 0
    with tempfile.TemporaryDirectory() as workdir:
        train_run(c, workdir, progress=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            step = [r for r in map(json.loads, f) if r.get("kind") == "train"][-1]
    note = ("compiles included; " if steps == 1 else "") + "no prediction: environments and host work included"
    return [
        Check("rl", "demo RL step: rollout", "s", step["rollout_s"],
              note=f"{step['gen_tokens_per_s']:,.0f} generated tokens/s, {step['env_steps_per_s']:,.0f} env steps/s; "
              + note),
        Check("rl", "demo RL step: update", "s", step["train_s"],
              note=f"{step['train_tokens_per_s']:,.0f} trained tokens/s; " + note),
    ]
