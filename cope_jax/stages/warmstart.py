"""The supervised warm start: the policy imitates expert demonstrations (`cope_jax/run/demos.py`) before
RL. Done once per workdir: its policy is saved in `warmstart/` and reloaded by every later start."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np
from flax import nnx

import models
from models import orbax_io
from cope_jax.run import distributed, run_config
from cope_jax.run.build import WARMSTART_DIR, Components
from cope_jax.run.demos import expert_trajectories
from cope_jax.batch.forecasting import build_examples
from cope_jax.objective.methods import get_method
from cope_jax.run.progress import Bar
from cope_jax.stages.loop import learn, rollout_runner, step_loop
from cope_jax.train.train_step import Learner



def warmstart(parts: Components, progress: bool = False) -> dict[str, Any] | None:
    """Trains the policy on the demonstrations, or loads the workdir's finished warm start."""
    c, ws = parts.config, parts.config.warmstart
    if ws.steps <= 0:
        return None
    directory = os.path.join(parts.workdir, WARMSTART_DIR)
    if os.path.isdir(directory):
        loaded, _ = models.load_model(directory, mesh=parts.mesh, **run_config.execution(c))
        nnx.update(parts.model, nnx.state(loaded, nnx.Param))  # the base weights; adapters stay fresh
        return None
    demos = _demonstrations(parts)
    # optional: forecasting examples (method §3.1's planning format, from the demonstrations, which
    # all succeed) teach the format before RL; without them a small policy's first CoPE steps
    # learn it from scratch, which can fight its acting format when the two differ
    n_af = ws.af_examples
    spec = get_method("warmstart", horizon=parts.spec.horizon)
    forecast = run_config.forecast_config(c, parts.family, spec.forecast_kind, spec.horizon) if n_af else None
    loss_cfg, opt_cfg = run_config.warmstart_configs(c)
    # every weight is trained, LoRA or not (adapters could not teach a random model its embeddings):
    # under LoRA through the base view, whose trained weights then become the adapters' base
    policy = parts.model if parts.model.cfg.lora is None else models.qwen.base_view(parts.model)
    learner = Learner(policy, loss_cfg, opt_cfg, mesh=parts.mesh)
    rng = np.random.RandomState(c.seed)
    t0 = time.time()

    def step(_: int) -> dict[str, float]:
        pick = rng.choice(len(demos), min(ws.batch_episodes, len(demos)), replace=False)
        batch = [dataclasses.replace(demos[i], group_id=j) for j, i in enumerate(pick)]
        examples = build_examples(batch, parts.chat, forecast) if n_af else []
        if len(examples) > n_af:
            examples = [examples[i] for i in np.sort(rng.choice(len(examples), n_af, replace=False))]
        metrics, _, _ = learn(parts, learner, loss_cfg, spec, batch, examples, groups_per_minibatch=len(batch))
        return {"rft_loss": float(np.mean([m["loss"] for m in metrics])), "demos": len(demos),
                "af_examples": len(examples), "seconds": time.time() - t0}

    bar = Bar(0, ws.steps, enabled=progress and parts.is_main, desc="warm start")
    step_loop(parts, "warmstart", range(ws.steps), step, bar,
              logged=lambda n: n % max(1, ws.steps // 20) == 0 or n == ws.steps)
    if policy is not parts.model:  # RL's base (and KL reference) is the warm-started policy
        nnx.update(parts.model, nnx.state(policy, nnx.Param))
    orbax_io.save_orbax(parts.model, directory)  # every process writes its shards
    return {"demos": len(demos), "seconds": time.time() - t0}


def _demonstrations(parts: Components) -> list:
    """The expert's successful episodes on the warm start's train tasks (each host plays its share)."""
    c, ws = parts.config, parts.config.warmstart
    ids = parts.family.task_ids(c.env.train_split)
    ids = ids[:ws.tasks] if ws.tasks else ids
    share = distributed.process_share(len(ids))
    demos = distributed.gather_shares(expert_trajectories(rollout_runner(parts, "train"), ids[share],
                                                          max_rounds=c.env.max_rounds_train,
                                                          mistakes=ws.mistakes, dawdle=ws.dawdle,
                                                          seed=c.seed + share.start))
    if not demos:
        raise RuntimeError("the expert solved no warm-start task")
    return demos

