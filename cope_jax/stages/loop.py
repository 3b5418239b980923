"""What the stages share: playing episodes on every host, training on a batch, and the step loop
(each step: its data, mini-batches, `Learner.train`, a record for the log and the bar)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from cope_jax.run import distributed, run_config
from cope_jax.batch.batching import build_minibatches
from cope_jax.run.build import Components
from cope_jax.objective.methods import LossConfig, MethodSpec
from cope_jax.batch.packing import pad_micro
from cope_jax.run.progress import Bar
from cope_jax.rollout.runner import RolloutRunner, RolloutStats
from cope_jax.train.train_step import Learner


def rollout_runner(parts: Components, kind: str) -> RolloutRunner:
    """A rollout runner on the run's sampler and pool, with the settings of `kind` ('train' | 'eval')."""
    c = parts.config
    return RolloutRunner(parts.sampler, parts.pool, c.env.family, parts.family, parts.chat,
                         run_config.rollout_config(c, kind))


def rollout(parts: Components, runner: RolloutRunner, schedule: list[tuple[int, int]], key,
            next_schedule: Sequence[tuple[int, int]] = (), on_progress=None) -> tuple[list, RolloutStats]:
    """Plays `schedule` (episode i samples with key folded with i): each host its share, with its
    own pool and sampler; returns every episode's trajectory (schedule order, on every host) and the
    rollout stats of all hosts together. `next_schedule`: the batch `runner` plays next, whose
    environments then reset during this batch and the train step after it."""
    share = distributed.process_share(len(schedule))
    ahead = distributed.process_share(len(next_schedule))
    parts.replica.refresh()
    key = jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key))
    trajs, stats = runner.run(schedule[share], key, episode_ids=range(share.start, share.stop),
                              prefetch=next_schedule[ahead], prefetch_ids=range(ahead.start, ahead.stop),
                              on_progress=on_progress)
    return distributed.gather_shares(trajs), RolloutStats.combined(distributed.allgather_objects(stats))


def learn(parts: Components, learner: Learner, loss_cfg: LossConfig, spec: MethodSpec, trajs, examples, *,
          groups_per_minibatch: int, ref_model=None) -> tuple[list[dict], dict, list]:
    """One train batch: mini-batches of `trajs` and `examples`, one optimizer step each. -> the steps'
    metrics, the host-side batch statistics and the mini-batches."""
    mbs, host = build_minibatches(trajs, examples, spec, loss_cfg, groups_per_minibatch=groups_per_minibatch,
                                  row_len=parts.config.train.row_len,
                                  rows_per_micro=run_config.rows_per_micro(parts.config, parts.mesh))
    return (learner.train(bucketed(mbs), ref_model) if mbs else []), host, mbs


def bucketed(minibatches):
    """Pads each mini-batch to a power-of-two number of micro-batches, so a run compiles the step
    for a handful of shapes instead of one per distinct batch size (the step skips the padding
    micro-batches: `train_step.loss_and_grads`)."""
    for mb in minibatches:
        n = mb.batch.num_micro
        mb.batch = pad_micro(mb.batch, 1 << (n - 1).bit_length())
    return minibatches


def step_loop(parts: Components, kind: str, steps: range, step: Callable[[int], dict[str, Any]], bar: Bar, *,
              logged: Callable[[int], bool] = lambda n: True, after: Callable[[int], None] = lambda n: None) -> None:
    """Runs `step(i)` for each i of `steps` (0-based). Step i's record is logged as `kind` at i + 1
    where `logged(i + 1)` and shown on the bar; `after(i + 1)` then runs (checkpoints, evaluations)."""
    for i in steps:
        record = step(i)
        if logged(i + 1):
            parts.log.write(kind, i + 1, record)
        bar.update(record)
        after(i + 1)
    bar.close()
