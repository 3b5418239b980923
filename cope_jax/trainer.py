"""The CoPE training run: setup, optional supervised warm start, the RL loop, evaluation, resume.

One RL step (SPEC 2-4):
  1. take the next `tasks_per_step` train tasks from a seeded, checkpointed grain iterator;
  2. roll out `group_size` episodes per task (`cope_jax/rollout.py`; group = the rollouts of a task);
  3. build forecasting / imitation examples from the successful ones when the method has them
     (`cope_jax/forecasting.py`);
  4. advantages and PPO mini-batches of packed rows (`cope_jax/batching.py`), one AdamW step per
     mini-batch (`cope_jax/train_step.py: Learner`), `old_logp` from the rollout policy and
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
import sys
import time
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from flax import nnx

import models
from models import model_dir, orbax_io
from models.config import ConfigError
from models.safetensors_io import CheckpointError
from cope_jax import distributed, run_config
from cope_jax import faults as faults_lib
from cope_jax import metrics as metrics_lib
from cope_jax.batching import build_minibatches
from cope_jax.chat import ChatFormat
from cope_jax.checkpoint import TrainCheckpointer
from cope_jax.demos import expert_trajectories
from cope_jax.forecasting import ForecastConfig, build_examples
from cope_jax.methods import METHODS, get_method
from cope_jax.packing import pad_micro
from cope_jax.rollout import RolloutConfig, RolloutRunner, RolloutStats
from cope_jax.sampler import Sampler
from cope_jax.tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from cope_jax.train_step import Learner
from envs.pool import EnvPool
from envs.registry import make_family

WARMSTART_DIR = "warmstart"
CHECKPOINT_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.model"
WARMSTART_SCHEDULES = ("constant", "cosine")  # warmstart.lr_schedule
RESUME_MODES = ("latest", "latest_valid")  # Trainer.train(resume=...): see Trainer._resume


class Trainer:
    """Owns the policy, sampler, environment pool, learner and logs of one run in `workdir`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        # everything that can refuse the run is checked before anything is written to the workdir, so
        # a failed start leaves it as it was (reusable with the corrected flags)
        self.config, self.workdir = config, run_config.check_workdir(workdir)
        self.is_main = jax.process_index() == 0
        saved_config = self._saved_config()
        c = config
        if c.warmstart.lr_schedule not in WARMSTART_SCHEDULES:
            raise ConfigError(f"warmstart.lr_schedule={c.warmstart.lr_schedule!r}: expected one of "
                              f"{WARMSTART_SCHEDULES}")
        horizon = None if c.train.horizon < 0 else int(c.train.horizon)
        self.spec = get_method(c.method, horizon=horizon)
        self.loss_cfg = run_config.loss_config(c)
        self.opt_cfg = run_config.optimizer_config(c)
        self.max_fault_fraction = run_config.max_fault_fraction(c)
        run_config.check_lengths(c)
        self.family = make_family(c.env.family)
        self._check_model_path()
        self.tokenizer = self._tokenizer()
        self.chat = ChatFormat(self.tokenizer, c.chat_style)
        self.mesh = distributed.run_mesh(tuple(c.mesh))
        self.model = self._model()
        # each host samples with its own copy of the policy on its own devices (one host: the policy)
        self.replica = distributed.LocalReplica(self.model, self.mesh)
        rows = run_config.sampler_rows(c, jax.process_count())
        self.sampler = Sampler(self.replica.model, batch_size=rows, max_len=c.rollout.max_len,
                               eos_ids=self.tokenizer.eos_ids)
        timeout = c.env.call_timeout or None
        # fewer environment slots than sampler rows would leave rows idle: only that many live episodes
        envs = c.env.envs_per_worker or -(-rows // c.env.workers)
        self.pool = EnvPool({c.env.family: c.env.workers}, envs_per_worker=envs, call_timeout=timeout)
        if saved_config is None and self.is_main:
            os.makedirs(self.workdir, exist_ok=True)
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                json.dump(json.loads(c.to_json()), f, indent=2, sort_keys=True)
        self.log = metrics_lib.MetricsLog(self.workdir, enabled=self.is_main)
        self.forecast_cfg = None
        if self.spec.forecast is not None:
            self.forecast_cfg = self._forecast_config(self.spec.forecast, self.spec.horizon)

    def _forecast_config(self, kind: str, horizon: int) -> ForecastConfig:
        c = self.config
        return ForecastConfig(
            kind=kind, horizon=horizon,
            layout="tau2" if getattr(self.family, "chat_layout", "react") == "tool_calling" else "react",
            skip_invalid=c.train.skip_invalid, skip_no_call=c.train.skip_no_call,
            invalid_message=self.family.invalid_action_message)

    # -- setup ------------------------------------------------------------------------------------
    def _saved_config(self) -> dict | None:
        """The workdir's config.json, if any. A workdir belongs to one config: resuming with a different
        one is refused. (It is written once the run has started: `__init__`.)"""
        path = os.path.join(self.workdir, "config.json")
        if not os.path.isfile(path):
            return None
        current = _flat(json.loads(self.config.to_json()))
        with open(path) as f:
            saved = _flat(json.load(f))
        # fields added to the project's configs since the run started are not a different config
        diff = sorted(k for k in saved if saved[k] != current.get(k, _MISSING))
        if diff:
            raise ConfigError(f"{self.workdir} holds a run with a different config ({', '.join(diff[:6])}"
                              f"{', ...' if len(diff) > 6 else ''}); use a new --workdir or the same config")
        return saved

    def _check_model_path(self) -> None:
        """A model path that cannot load fails now, not after the tokenizer is trained into the workdir."""
        m = self.config.model
        if m.init == "random":
            return
        if not m.path:
            raise ConfigError("config.model.path is empty: give an HF or Orbax directory (or model.init='random')")
        model_dir.kind(m.path)

    def _tokenizer(self):
        spec = self.config.tokenizer
        if spec == "model":
            return load_tokenizer(self.config.model.path)
        if not spec.startswith("sentencepiece:"):
            return load_tokenizer(spec)
        # a small tokenizer trained on the environment's own text (the demo's tiny model), once, by
        # process 0; every host gets its bytes
        if not hasattr(self.family, "expert_actions"):
            raise ConfigError(f"tokenizer={spec}: a SentencePiece tokenizer is trained on the family's expert "
                              f"episodes, and {self.config.env.family} has no expert (the built-in house has); "
                              "use tokenizer='qwen2.5' or 'qwen3'")
        path = os.path.join(self.workdir, TOKENIZER_FILE)
        proto = None
        if self.is_main:
            if not os.path.isfile(path):
                vocab = int(spec.split(":")[1])
                trained = train_sentencepiece(_corpus(self.family, self.config), vocab_size=vocab)
                os.makedirs(self.workdir, exist_ok=True)
                trained.save(path)
            with open(path, "rb") as f:
                proto = f.read()
        return SentencePieceTokenizer(distributed.broadcast_object(proto), name=TOKENIZER_FILE)

    def _model(self):
        m = self.config.model
        if m.init == "random":
            cfg = run_config.random_model_config(self.config, self.tokenizer.vocab_size)
            return models.create_model(cfg, seed=self.config.seed, mesh=self.mesh)
        model, _ = models.load_model(m.path, mesh=self.mesh, **run_config.execution(self.config))
        return model

    def runner(self, split: str) -> RolloutRunner:
        c = self.config
        rounds = c.env.max_rounds_train if split == "train" else c.env.max_rounds_eval
        train = split == "train"
        cfg = RolloutConfig(max_rounds=rounds, max_turn_tokens=c.rollout.max_turn_tokens,
                            temperature=c.rollout.temperature if train else c.eval.temperature,
                            top_p=c.rollout.top_p, top_k=c.rollout.top_k,
                            greedy=False if train else c.eval.greedy, sync=c.rollout.sync,
                            stream_every=c.rollout.stream_every)
        return RolloutRunner(self.sampler, self.pool, c.env.family, self.family, self.chat, cfg)

    def rollout(self, runner: RolloutRunner, plan: list[tuple[int, int]], key,
                next_plan: list[tuple[int, int]] = (), on_progress=None) -> tuple[list, Any]:
        """Plays `plan` (episode i samples with key folded with i): each host its share, with its
        own pool and sampler; returns every episode's trajectory (plan order, on every host) and the
        rollout stats of all hosts together. `next_plan`: the batch `runner` plays next, whose
        environments then reset during this batch and the train step after it."""
        share = distributed.process_share(len(plan))
        ahead = distributed.process_share(len(next_plan))
        self.replica.refresh()
        key = jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key))
        trajs, stats = runner.run(plan[share], key, episode_ids=range(share.start, share.stop),
                                  prefetch=next_plan[ahead], prefetch_ids=range(ahead.start, ahead.stop),
                                  on_progress=on_progress)
        return distributed.gather_shares(trajs), RolloutStats.combined(distributed.allgather_objects(stats))

    def task_iterator(self):
        ids = self.family.task_ids(self.config.env.train_split)
        ds = (grain.MapDataset.source(list(ids)).shuffle(seed=self.config.seed).repeat()
              .batch(self.config.rollout.tasks_per_step).to_iter_dataset())
        return iter(ds)

    # -- stages -----------------------------------------------------------------------------------
    def warmstart(self, progress: bool = False) -> dict[str, Any] | None:
        """Supervised warm start on expert demonstrations; done once per workdir (then reloaded)."""
        ws = self.config.warmstart
        if ws.steps <= 0:
            return None
        directory = os.path.join(self.workdir, WARMSTART_DIR)
        if os.path.isdir(directory):
            loaded, _ = models.load_model(directory, mesh=self.mesh, **run_config.execution(self.config))
            nnx.update(self.model, nnx.state(loaded, nnx.Param))
            return None
        ids = self.family.task_ids(self.config.env.train_split)
        ids = ids[:ws.tasks] if ws.tasks else ids
        share = distributed.process_share(len(ids))  # each host plays its share of the experts
        demos = distributed.gather_shares(expert_trajectories(self.runner("train"), ids[share],
                                                              max_rounds=self.config.env.max_rounds_train,
                                                              mistakes=ws.mistakes, dawdle=ws.dawdle,
                                                              seed=self.config.seed + share.start))
        if not demos:
            raise RuntimeError("the expert solved no warm-start task")
        # optional: forecasting examples (SPEC 3's planning format, from the demonstrations, which
        # all succeed) teach the format before RL; without them a small policy's first CoPE steps
        # learn it from scratch, which can fight its acting format when the two differ
        n_af = ws.af_examples
        cope = METHODS["cope"]
        forecast = self._forecast_config(cope.forecast, self.spec.horizon or cope.horizon) if n_af else None
        spec = (METHODS["rft"] if not n_af else
                dataclasses.replace(METHODS["rft"], name="warmstart", terms=("rft", "af"),
                                    forecast=forecast.kind, horizon=forecast.horizon))
        learner = Learner(self.model, *run_config.warmstart_configs(self.config), mesh=self.mesh)
        rng = np.random.RandomState(self.config.seed)
        t0 = time.time()
        bar = _progress(0, ws.steps, enabled=progress and self.is_main, desc="warm start")
        for step in range(ws.steps):
            pick = rng.choice(len(demos), min(ws.batch_episodes, len(demos)), replace=False)
            batch = [dataclasses.replace(demos[i], group_id=j) for j, i in enumerate(pick)]
            examples = build_examples(batch, self.chat, forecast) if n_af else []
            if len(examples) > n_af:
                examples = [examples[i] for i in np.sort(rng.choice(len(examples), n_af, replace=False))]
            mbs, _ = build_minibatches(batch, examples, spec, learner.cfg, groups_per_minibatch=len(batch),
                                       row_len=self.config.train.row_len,
                                       rows_per_micro=run_config.rows_per_micro(self.config, self.mesh))
            out = learner.train(_bucketed(mbs))
            loss = float(np.mean([m["loss"] for m in out]))
            bar.update({"rft_loss": loss})
            if (step + 1) % max(1, ws.steps // 20) == 0 or step + 1 == ws.steps:
                self.log.write("warmstart", step + 1, {"rft_loss": loss,
                                                        "demos": len(demos), "af_examples": len(examples),
                                                        "seconds": time.time() - t0})
        bar.close()
        orbax_io.save_orbax(self.model, directory)  # every process writes its shards
        return {"demos": len(demos), "seconds": time.time() - t0}

    def evaluate(self, step: int, *, split: str | None = None, samples: int | None = None,
                 tasks: int | None = None, name: str = "eval", progress: bool = False) -> dict[str, Any]:
        c = self.config
        split = split or c.env.eval_split
        samples = samples or c.eval.samples
        ids = self.family.task_ids(split)
        n = tasks if tasks is not None else c.eval.tasks
        ids = stratified(ids, n, self.family.task_family) if n else ids
        plan = [(t, g) for g, t in enumerate(ids) for _ in range(samples)]
        key = jax.random.fold_in(jax.random.key(c.seed + 1), step)
        share = distributed.process_share(len(plan))
        bar = _progress(0, share.stop - share.start, enabled=progress and self.is_main,
                        desc=f"eval step {step} (episodes)")
        trajs, stats = self.rollout(self.runner("eval"), plan, key, on_progress=bar.to)
        bar.close()
        trajs, faults = faults_lib.drop(trajs, self.max_fault_fraction, what=f"evaluation at step {step}")
        summary = metrics_lib.summarize(trajs, overall=getattr(self.family, "overall", "count-weighted"))
        summary.update(split=split, samples=samples, tasks=len(ids), seconds=stats.wall_s, **faults.record())
        self.log.write(name, step, {k: v for k, v in summary.items() if not isinstance(v, dict)}
                       | {f"succ/{f}": v["succ"] for f, v in summary["families"].items()})
        return summary

    def train(self, progress: bool = True, resume: str = "latest") -> dict[str, Any]:
        """The RL stage; resumes from the newest checkpoint in the workdir (`resume`: see `_resume`)."""
        c = self.config
        needs_ref = "kl" in self.loss_cfg.active_terms(self.spec.terms)
        # the policy RL starts from; its own buffers (the learner donates the policy's)
        ref_model = models.qwen.frozen_copy(self.model) if needs_ref else None
        learner = Learner(self.model, self.loss_cfg, self.opt_cfg, mesh=self.mesh)
        tasks_it = self.task_iterator()
        base_key = distributed.replicate(jax.random.key(c.seed), self.mesh)
        ckpt = TrainCheckpointer(os.path.join(self.workdir, CHECKPOINT_DIR), keep=c.checkpoint.keep)
        start = 0
        try:
            restored = self._resume(ckpt, {"params": nnx.state(self.model, nnx.Param),
                                           "optimizer": nnx.state(learner.optimizer), "rng": base_key}, resume)
        except (CheckpointError, ConfigError):
            ckpt.close()
            raise
        if restored is not None:
            start, state, data_state, _ = restored
            nnx.update(self.model, state["params"])
            nnx.update(learner.optimizer, state["optimizer"])
            base_key = state["rng"]
            tasks_it.set_state(data_state)
        train_runner = self.runner("train")
        bar = _progress(start, c.train.steps, enabled=progress and self.is_main)
        summary: dict[str, Any] = {}

        def plan_of(step: int, ids: list[int]) -> list[tuple[int, int]]:
            return [(t, step * len(ids) + i) for i, t in enumerate(ids) for _ in range(c.rollout.group_size)]

        def evaluates(step: int) -> bool:  # after step `step` (1-based)
            return bool(c.eval.every) and (step % c.eval.every == 0 or step == c.train.steps)

        peeked = None  # the next step's task ids and the data state after them, when prefetched
        for step in range(start, c.train.steps):
            t0 = time.time()
            if peeked is None:
                task_ids = [int(t) for t in next(tasks_it)]
                data_state = tasks_it.get_state()
            else:
                (task_ids, data_state), peeked = peeked, None
            plan = plan_of(step, task_ids)
            # the next batch's environments reset during this one, unless an evaluation (another
            # runner on the same pool) comes between them
            next_plan = []
            if c.rollout.prefetch_resets and step + 1 < c.train.steps and not evaluates(step + 1):
                peeked = [int(t) for t in next(tasks_it)], tasks_it.get_state()
                next_plan = plan_of(step + 1, peeked[0])
            trajs, rstats = self.rollout(train_runner, plan, jax.random.fold_in(base_key, step), next_plan)
            trajs, faults = faults_lib.drop(trajs, self.max_fault_fraction, what=f"step {step + 1}")
            t1 = time.time()
            examples = build_examples(trajs, self.chat, self.forecast_cfg) if self.forecast_cfg else []
            mbs, host = build_minibatches(trajs, examples, self.spec, self.loss_cfg,
                                          groups_per_minibatch=c.train.minibatch_tasks,
                                          row_len=c.train.row_len,
                                          rows_per_micro=run_config.rows_per_micro(c, self.mesh))
            step_metrics = learner.train(_bucketed(mbs), ref_model) if mbs else []
            t2 = time.time()
            record = _step_record(trajs, step_metrics, host, examples, rstats, mbs, t1 - t0, t2 - t1)
            record.update(faults.record())
            self.log.write("train", step + 1, record)
            bar.update(record)
            if (step + 1) % c.checkpoint.every == 0 or step + 1 == c.train.steps:
                state = {"params": nnx.state(self.model, nnx.Param), "optimizer": nnx.state(learner.optimizer),
                         "rng": base_key}
                ckpt.save(step + 1, state, data_state=data_state, config=json.loads(c.to_json()))
            if evaluates(step + 1):
                summary = self.evaluate(step + 1)
                bar.note(f"eval step {step + 1}: succ {summary['succ']:.3f} score {summary['score']:.3f}")
        ckpt.wait()
        ckpt.close()
        bar.close()
        return summary

    def _resume(self, ckpt: TrainCheckpointer, abstract: dict, resume: str):
        """-> `ckpt.restore`'s (step, state, data_state, config) of the newest readable step, or None in
        a run without checkpoints. An unreadable newest step stops the run, naming it, what is wrong
        and the newest intact step, unless resume='latest_valid': then the unreadable steps are set
        aside (renamed, never deleted) and the run continues from the intact one."""
        if resume not in RESUME_MODES:
            raise ConfigError(f"--resume={resume}: expected one of {RESUME_MODES}")
        unreadable = []
        for step in reversed(ckpt.all_steps()):
            try:
                restored = ckpt.restore(step, abstract_state=abstract)
            except CheckpointError as e:
                unreadable.append((step, e))
                continue
            if unreadable and resume != "latest_valid":
                raise CheckpointError(f"{unreadable[0][1]}; step {step} is intact: rerun with "
                                      "--resume=latest_valid to continue from it")
            for bad, _ in unreadable:
                moved = ckpt.set_aside(bad) if self.is_main else ""
                self._say(f"set aside unreadable checkpoint step {bad} as {os.path.basename(moved)}")
            self._say(f"resuming from step {step} ({ckpt.step_dir(step)})")
            return restored
        if unreadable:
            raise CheckpointError(f"{unreadable[0][1]}; no intact checkpoint to resume from (move "
                                  f"{ckpt.workdir} aside to start over)")
        return None

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.pool.close()
        self.log.close()


_MISSING = object()


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"train.row_len": 768, ...} of a nested config dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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


def _bucketed(minibatches):
    """Pads each mini-batch to a power-of-two number of micro-batches, so a run compiles the step
    for a handful of shapes instead of one per distinct batch size (the step skips the padding
    micro-batches: `train_step.loss_and_grads`)."""
    for mb in minibatches:
        n = mb.batch.num_micro
        mb.batch = pad_micro(mb.batch, 1 << (n - 1).bit_length())
    return minibatches


def _corpus(family, config) -> list[str]:
    """Text the demo tokenizer is trained on: the prompts and expert episodes of train tasks."""
    texts = [family.instruction(), family.acknowledgement(), family.invalid_action_message]
    live = make_family(config.env.family)
    for t in family.task_ids(config.env.train_split)[:200]:
        obs, _ = live.reset(t)
        texts.append(obs)
        for a in family.expert_actions(t):
            texts.append(f"Action: {a}")
            obs, _, done, _ = live.step(a)
            texts.append(obs)
            if done:
                break
    live.close()
    return texts


def _step_record(trajs, step_metrics, host, examples, rstats, mbs, rollout_s, train_s) -> dict[str, float]:
    n = max(1, len(trajs))
    rec = {"succ": float(np.mean([t.success for t in trajs])) if trajs else 0.0,
           "score": float(np.mean([t.score for t in trajs])) if trajs else 0.0,
           "mean_steps": sum(t.num_steps for t in trajs) / n,
           "context_full": sum(t.finish_reason == "context_full" for t in trajs) / n,
           "af_examples": float(len(examples)), "minibatches": float(len(mbs)),
           "rollout_s": rollout_s, "train_s": train_s,
           "gen_tokens_per_s": rstats.generated_tokens / max(rstats.wall_s, 1e-9),
           "env_steps_per_s": rstats.env_steps / max(rstats.wall_s, 1e-9),
           **{k: float(v) for k, v in host.items()}}
    tokens = sum(float(m.batch.segment_ids.astype(bool).sum()) for m in mbs)
    rec["train_tokens_per_s"] = tokens / max(train_s, 1e-9)
    if step_metrics:
        for k in step_metrics[0]:
            rec[k] = float(np.mean([m[k] for m in step_metrics if k in m]))
    return rec


class _progress:
    """tqdm bar with the live metrics (success, reward, AF loss, KL, entropy, throughput)."""

    KEYS = (("succ", "succ"), ("score", "rew"), ("af_loss", "af"), ("kl", "kl"), ("entropy", "ent"),
            ("rft_loss", "loss"), ("train_tokens_per_s", "tok/s"), ("env_steps_per_s", "env/s"),
            ("env_faults", "faults"))

    def __init__(self, start: int, total: int, enabled: bool, desc: str = "RL"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({short: f"{record[k]:.3g}" for k, short in self.KEYS if k in record})
            self.bar.update(1)

    def to(self, n: int) -> None:
        """Moves the bar to n done (a hook for loops that report a count)."""
        if self.bar is not None and n != self.bar.n:
            self.bar.update(n - self.bar.n)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
