"""The RL stage of the configured method.

One RL step (method §2-4):
  1. take the next `tasks_per_step` train tasks from a seeded, checkpointed grain iterator;
  2. roll out `group_size` episodes per task (`cope_jax/rollout/runner.py`; group = the rollouts of a task);
  3. build forecasting / imitation examples from the successful ones when the method has them
     (`cope_jax/batch/forecasting.py`);
  4. advantages and PPO mini-batches of packed rows (`cope_jax/batch/batching.py`), one AdamW step per
     mini-batch (`cope_jax/train/train_step.py: Learner`), `old_logp` from the rollout policy and
     `ref_logp` from the frozen reference (the policy the RL stage started from);
  5. log, checkpoint every `checkpoint.every` steps, evaluate every `eval.every` steps.

Everything a step depends on is either in the checkpoint (params, optimizer state, RNG key, data
iterator state) or a pure function of the step number (the rollout key), so a killed run resumed
from its workdir continues exactly; with `rollout.sync` the rollouts themselves are bit-reproducible.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import grain
import jax
import numpy as np
from flax import nnx

import models
from models.config import ConfigError
from models.safetensors_io import CheckpointError
from cope_jax.run import distributed
from cope_jax.run import faults as faults_lib
from cope_jax.run import metrics as metrics_lib
from cope_jax.run.build import CHECKPOINT_DIR, Components
from cope_jax.run.checkpoint import TrainCheckpointer
from cope_jax.objective.advantages import compute_advantages, flat_groups
from cope_jax.batch.forecasting import build_examples
from cope_jax.objective.methods import needing
from cope_jax.run.progress import Bar, say
from cope_jax.stages.evaluate import evaluate, evaluate_once
from cope_jax.rollout.runner import RolloutStats
from cope_jax.stages.loop import learn, rollout, rollout_runner, step_loop
from cope_jax.stages.partial import PartialRollouts, staleness
from cope_jax.train.train_step import Learner

RESUME_MODES = ("latest", "latest_valid")  # train(resume=...): see resume_from


def train(parts: Components, progress: bool = True, resume: str = "latest") -> dict[str, Any]:
    """Runs the RL steps left, from the newest checkpoint in the workdir (`resume`: `resume_from`).
    Returns the summary of the last evaluation it ran ({} if none)."""
    c = parts.config
    needs_ref = bool(needing(parts.loss_cfg.active_terms(parts.spec.terms), "ref_logp"))
    lora = parts.model.cfg.lora is not None
    # the policy RL starts from; its own buffers (the learner donates the policy's). Under LoRA the
    # base with the adapters off, on the same frozen arrays (never donated): no second model
    ref_model = models.qwen.frozen_copy(parts.model) if needs_ref and not lora else None
    learner = Learner(parts.model, parts.loss_cfg, parts.opt_cfg, mesh=parts.mesh)
    if needs_ref and lora:
        ref_model = models.qwen.base_view(parts.model)
    tasks = _TaskBatches(parts)
    ckpt = TrainCheckpointer(os.path.join(parts.workdir, CHECKPOINT_DIR), keep=c.checkpoint.keep)
    train_runner = rollout_runner(parts, "train")
    partial = PartialRollouts.of_run(parts, train_runner, tasks) if c.rollout.partial else None
    start, base_key = _restore(parts, ckpt, learner, tasks, resume, partial)
    refill_rounds = int(c.train.refill_rounds)  # the cap of zero_variance='filter'
    bar = Bar(start, c.train.steps, enabled=progress and parts.is_main)
    summary: dict[str, Any] = {}

    def evaluates(n: int) -> bool:  # after step n (1-based)
        return bool(c.eval.every) and (n % c.eval.every == 0 or n == c.train.steps)

    if start and evaluates(start):  # the last life may have stopped between checkpoint and evaluation
        summary = evaluate_once(parts, start) or summary

    def step(i: int) -> dict[str, float]:
        if partial is not None:
            return partial_step(i)
        t0 = time.time()
        schedule = _schedule(c, i, tasks.take())
        # the next batch's environments reset during this one, unless an evaluation (another
        # runner on the same pool) comes between them
        next_schedule = []
        if c.rollout.prefetch_resets and i + 1 < c.train.steps and not evaluates(i + 1):
            next_schedule = _schedule(c, i + 1, tasks.peek())
        played, rstats = rollout(parts, train_runner, schedule, jax.random.fold_in(base_key, i), next_schedule)
        played, faults = faults_lib.drop(played, parts.max_fault_fraction, what=f"step {i + 1}")
        trajs, refill = played, {}
        if c.train.zero_variance == "filter":
            trajs, rstats, refill = _refilled(parts, train_runner, tasks, i, base_key, played, rstats,
                                              refill_rounds)
        # success and score are the step's own tasks' (the refills drew ahead, and kept only some)
        return trained_on(played, trajs, rstats, t0) | faults.record() | refill

    def partial_step(i: int) -> dict[str, float]:
        t0 = time.time()
        played, rstats, counts = partial.step(i, jax.random.fold_in(base_key, i), last=i + 1 == c.train.steps)
        trajs, faults = faults_lib.drop(played, parts.max_fault_fraction, what=f"step {i + 1}")
        trained = float(len({t.group_id for t in trajs}))
        return (trained_on(played, trajs, rstats, t0) | faults.record() | counts | {"groups_trained": trained}
                | staleness(trajs, i))

    def trained_on(played, trajs, rstats, t0: float) -> dict[str, float]:
        """One optimizer step per mini-batch of `trajs` (and their forecasting examples) -> the step
        record of `played` (the step's episodes; its rollout began at t0)."""
        t1 = time.time()
        examples = build_examples(trajs, parts.chat, parts.forecast_cfg) if parts.forecast_cfg else []
        metrics, host, mbs = learn(parts, learner, parts.loss_cfg, parts.spec, trajs, examples,
                                   groups_per_minibatch=c.train.minibatch_tasks, ref_model=ref_model)
        return _step_record(played, metrics, host, examples, rstats, mbs, t1 - t0, time.time() - t1,
                            parts.family.overall)

    def after(n: int) -> None:
        nonlocal summary
        if n % c.checkpoint.every == 0 or n == c.train.steps:
            data_state = tasks.state if partial is None else {"tasks": tasks.state, "partial": partial.state()}
            ckpt.save(n, _state(parts, learner, base_key), data_state=data_state, config=json.loads(c.to_json()))
        if evaluates(n):
            if partial is not None:
                partial.release()  # the evaluation's runner uses the pool; the parked episodes catch up after
            summary = evaluate(parts, n)
            bar.note(f"eval step {n}: succ {summary['succ']:.3f} score {summary['score']:.3f}")

    step_loop(parts, "train", range(start, c.train.steps), step, bar, after=after)
    ckpt.wait()
    ckpt.close()
    return summary


def _refilled(parts: Components, train_runner, tasks: "_TaskBatches", i: int, base_key, played, rstats,
              refill_rounds: int):
    """`train.zero_variance='filter'`: step i's batch without its groups whose advantages are all
    zero, refilled by rounds of the next tasks (round r plays what step i + r would have, under its
    own key; the first is the batch whose resets were prefetched) until `rollout.tasks_per_step`
    groups carry signal or `refill_rounds` rounds were played; the first tasks_per_step such
    groups are kept. -> (trajectories, the rounds' rollout stats, the record's counts)."""
    c = parts.config
    kept, dropped = _with_signal(parts, played)
    rounds, extra = [rstats], 0
    while len({t.group_id for t in kept}) < c.rollout.tasks_per_step and len(rounds) <= refill_rounds:
        r = len(rounds)
        schedule = _schedule(c, i + r, tasks.take())
        more, stats = rollout(parts, train_runner, schedule, jax.random.fold_in(jax.random.fold_in(base_key, i), r))
        more, _ = faults_lib.drop(more, parts.max_fault_fraction, what=f"step {i + 1}, refill {r}")
        rounds.append(stats)
        extra += len(schedule)
        got, flat = _with_signal(parts, more)
        kept, dropped = kept + got, dropped + flat
    groups = set(list(dict.fromkeys(t.group_id for t in kept))[:c.rollout.tasks_per_step])
    total = RolloutStats(**{f.name: sum(getattr(s, f.name) for s in rounds) for f in dataclasses.fields(RolloutStats)})
    return ([t for t in kept if t.group_id in groups], total,
            {"zero_variance_groups": float(dropped), "refill_rollouts": float(extra)})


def _with_signal(parts: Components, trajs) -> tuple[list, int]:
    """(the trajectories of groups whose advantages are not all zero, how many groups were not)."""
    if not trajs:
        return [], 0
    advantages, _ = compute_advantages(parts.spec, trajs, parts.loss_cfg)
    flat = flat_groups(advantages, [t.group_id for t in trajs])
    return [t for t in trajs if t.group_id not in flat], len(flat)


def _schedule(c, step: int, task_ids: list[int]) -> list[tuple[int, int]]:
    """(task, group) of each episode of a step; groups are numbered across steps."""
    return [(t, step * len(task_ids) + i) for i, t in enumerate(task_ids) for _ in range(c.rollout.group_size)]


class _TaskBatches:
    """Each step's train task ids, from a seeded grain iterator whose state the checkpoints keep.
    `peek` draws the next step's ahead of it (to reset its environments early); `state` is the
    iterator's state after the batch `take` returned last. Under `rollout.partial` a step takes
    as many tasks as it starts groups: the iterator draws one task at a time."""

    def __init__(self, parts: Components):
        c = parts.config
        ids = parts.family.task_ids(c.env.train_split)
        # a finite repeat (the same order as an endless one): grain cannot take the length of an
        # endless dataset batched by 1
        ds = grain.MapDataset.source(list(ids)).shuffle(seed=c.seed).repeat(num_epochs=2**62 // len(ids))
        self.batch = 1 if c.rollout.partial else c.rollout.tasks_per_step
        self._it = iter(ds.batch(self.batch).to_iter_dataset())
        self._peeked = None  # the next step's task ids and the state after them, when drawn ahead
        self.state = None

    def take(self, batches: int = 1) -> list[int]:
        """The next `batches` batches' task ids, concatenated."""
        ids = []
        for _ in range(batches):
            if self._peeked is None:
                self._peeked = self._draw()
            (got, self.state), self._peeked = self._peeked, None
            ids += got
        return ids

    def peek(self) -> list[int]:
        self._peeked = self._draw()
        return self._peeked[0]

    def restore(self, state) -> None:
        self._it.set_state(state)

    def _draw(self) -> tuple[list[int], Any]:
        return [int(t) for t in next(self._it)], self._it.get_state()


def _state(parts: Components, learner: Learner, key) -> dict[str, Any]:
    """What a checkpoint holds besides the data state: the trained parameters (under LoRA the
    adapters; the frozen base is the run's starting model), the optimizer's state, the RNG key."""
    return {"params": trained_params(parts.model), "optimizer": nnx.state(learner.optimizer), "rng": key}


def trained_params(model):
    """The parameters a checkpoint's `params` item holds: all, or under LoRA the adapters."""
    return nnx.state(model, models.qwen.trainable(model.cfg))


def _restore(parts: Components, ckpt: TrainCheckpointer, learner: Learner, tasks: _TaskBatches,
             resume: str, partial: PartialRollouts | None) -> tuple[int, Any]:
    """-> (the first step to run, the run's base RNG key): restored from the newest readable checkpoint
    into the policy, optimizer, task iterator and parked episodes, or 0 and the seed's key in a run
    without checkpoints."""
    base_key = distributed.replicate(jax.random.key(parts.config.seed), parts.mesh)
    try:
        restored = resume_from(ckpt, _state(parts, learner, base_key), resume, parts.is_main)
    except (CheckpointError, ConfigError):
        ckpt.close()
        raise
    if restored is None:
        return 0, base_key
    start, state, data_state, _ = restored
    nnx.update(parts.model, state["params"])
    nnx.update(learner.optimizer, state["optimizer"])
    if partial is None:
        if "partial" in data_state:
            raise CheckpointError(f"checkpoint step {start} was written with rollout.partial: its parked episodes "
                                  "would be lost (resume it with rollout.partial=True)")
        tasks.restore(data_state)
        return start, state["rng"]
    if "partial" not in data_state:
        raise CheckpointError(f"checkpoint step {start} was written without rollout.partial: its data state has "
                              "no parked episodes (resume it with rollout.partial=False)")
    tasks.restore(data_state["tasks"])
    restarted = partial.restore(data_state["partial"])
    if restarted:
        say(f"{restarted} parked episodes start again from their reset: the rollout settings changed", parts.is_main)
    return start, state["rng"]


def resume_from(ckpt: TrainCheckpointer, abstract: dict, resume: str, is_main: bool):
    """-> `ckpt.restore`'s (step, state, data_state, config) of the newest readable step, or None in
    a run without checkpoints. An unreadable newest step stops the run, naming it, what is wrong
    and the newest intact step, unless resume='latest_valid': then the unreadable steps are set
    aside (renamed, never deleted) and the run continues from the intact one. Every process resumes
    from the same step: one that some process cannot read, or does not see, is unreadable for all."""
    if resume not in RESUME_MODES:
        raise ConfigError(f"--resume={resume}: expected one of {RESUME_MODES}")
    unreadable = []
    steps, unseen = _steps_of_all_hosts(ckpt)
    for step in steps:
        restored, error = None, unseen.get(step)
        if error is None:
            try:
                restored = ckpt.restore(step, abstract_state=abstract)
            except CheckpointError as e:
                error = e
            error = _first_error_of_any_host(error)
        if error is not None:  # unreadable on one host is unreadable on all: they resume together
            unreadable.append((step, error))
            continue
        if unreadable and resume != "latest_valid":
            raise CheckpointError(f"{unreadable[0][1]}; step {step} is intact: rerun with "
                                  "--resume=latest_valid to continue from it")
        for bad, _ in unreadable:
            moved = ckpt.set_aside(bad) if is_main and bad in ckpt.all_steps() else ""
            say(f"set aside unreadable checkpoint step {bad} as {os.path.basename(moved)}", is_main)
        say(f"resuming from step {step} ({ckpt.step_dir(step)})", is_main)
        return restored
    if unreadable:
        raise CheckpointError(f"{unreadable[0][1]}; no intact checkpoint to resume from (move "
                              f"{ckpt.workdir} aside to start over)")
    return None


def _steps_of_all_hosts(ckpt: TrainCheckpointer) -> tuple[list[int], dict[int, CheckpointError]]:
    """(the checkpoint steps any process lists, newest first; {step: error} of those some process
    does not list), the same on every host."""
    listed = [set(steps) for steps in distributed.allgather_objects(ckpt.all_steps())]
    steps = sorted(set().union(*listed), reverse=True)
    unseen = {}
    for step in steps:
        missing = [p for p, seen in enumerate(listed) if step not in seen]
        if missing:
            unseen[step] = CheckpointError(f"checkpoint step {step} ({ckpt.step_dir(step)}) is unreadable: "
                                           f"process {missing[0]} does not see it")
    return steps, unseen


def _first_error_of_any_host(error: CheckpointError | None) -> CheckpointError | None:
    """The first process's restore error of this step, on every process (None: all read it), so
    a step one host cannot read is set aside by all and no two hosts resume from different steps."""
    errors = distributed.allgather_objects(None if error is None else str(error))
    failed = [(p, e) for p, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    if error is not None:
        return error
    process, message = failed[0]
    return CheckpointError(f"process {process}: {message}")


def _step_record(trajs, step_metrics, host, examples, rstats, mbs, rollout_s, train_s, overall) -> dict[str, float]:
    """The train step's record: episodes (Succ / Score combined as the family's `overall`), batch
    statistics, throughput and the optimizer steps' metrics (`_combine`)."""
    n = max(1, len(trajs))
    summary = metrics_lib.summarize(trajs, overall=overall)
    rec = {"succ": summary["succ"] if trajs else 0.0, "score": summary["score"] if trajs else 0.0,
           "mean_steps": sum(t.num_steps for t in trajs) / n,
           "context_full": sum(t.finish_reason == "context_full" for t in trajs) / n,
           "af_examples": float(len(examples)), "minibatches": float(len(mbs)),
           "rollout_s": rollout_s, "train_s": train_s,
           "gen_tokens_per_s": rstats.generated_tokens / max(rstats.wall_s, 1e-9),
           "env_steps_per_s": rstats.env_steps / max(rstats.wall_s, 1e-9),
           "env_replays": float(rstats.replays),
           "rollout_occupancy": rstats.occupancy, "rollout_low_occupancy_share": rstats.low_occupancy_share,
           "rollout_prefill_tokens": float(rstats.prefill_tokens),
           **{k: float(v) for k, v in host.items()}}
    tokens = sum(float(m.batch.segment_ids.astype(bool).sum()) for m in mbs)
    rec["train_tokens_per_s"] = tokens / max(train_s, 1e-9)
    return rec | _combine(step_metrics)


def _combine(step_metrics: list[dict]) -> dict[str, float]:
    """One value per key over a step's optimizer steps: a `*_max` key's max, any other key's mean;
    each gradient norm also as `<key>_max`, its largest optimizer step (what a spike looks like)."""
    out = {}
    for k in (step_metrics[0] if step_metrics else {}):
        values = [float(m[k]) for m in step_metrics if k in m]
        out[k] = max(values) if k.endswith("_max") else float(np.mean(values))
        if k.startswith("grad_norm"):
            out[f"{k}_max"] = max(values)
    return out
