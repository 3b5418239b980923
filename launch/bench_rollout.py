"""Rollout overlap benchmark: does stepping environments overlap with decoding?

  python -m launch.bench --suite=rollout [--rollout_families=builtin,sciworld] [--rollout_workers=4]
      [--rollout_envs_per_worker=2] [--rollout_episodes=16] [--rollout_rounds=8]
      [--rollout_turn_tokens=24] [--rollout_repeats=2] [--rollout_model=DIR]

For each family, three measurements of the same episodes, in the same run (after a warm-up pass
that compiles the sampler's shapes and warms the environments, e.g. the JVM's JIT):

- `wall_s`: the real rollout, `RolloutRunner` with the asynchronous pool (`sync=False`);
- `sampling_s`: pure sampling, the same rollout against a pool that answers at once with the
  recorded results (no environment work). Episodes sample with per-episode keys, so the sampler
  generates the same turns (`gen_tokens` of both lines);
- `env_s`: pure environment time, the recorded actions replayed through the same pool (same
  workers, same slots) with no model, each episode's next action sent as soon as its result is in.

`overlap = wall_s / max(sampling_s, env_s)`: 1.0 means environment steps hide completely behind
decoding (or the reverse); `wall_s / (sampling_s + env_s)` near 1 means none do. A lockstep
rollout (`sync=True`, no overlap by design) is reported as `sync_wall_s` for reference. Each time is
the best of `repeats`. The asynchronous schedule depends on timing, so it can reach sampler shapes
the warm-up did not: warm-up passes repeat until one compiles nothing, and `compile_s` reports
XLA compilation inside the measured runs; a run that compiled is not used for its measurement
unless every run of it did (then the measurement is listed in `unclean`). The policy is a random
Qwen3-shaped model (or `--rollout_model`), so actions are mostly invalid: the environment still
parses and answers each one. One JSON object per line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
from absl import flags

flags.DEFINE_list("rollout_families", ["builtin", "sciworld"], "Environment families to measure.")
flags.DEFINE_integer("rollout_workers", 4, "Environment worker processes.")
flags.DEFINE_integer("rollout_envs_per_worker", 2, "Environment instances (live episodes) per worker.")
flags.DEFINE_integer("rollout_rows", 0, "Sampler rows (0: one per environment slot).")
flags.DEFINE_integer("rollout_episodes", 16, "Episodes per rollout batch.")
flags.DEFINE_integer("rollout_rounds", 8, "Environment steps per episode (max rounds).")
flags.DEFINE_integer("rollout_turn_tokens", 24, "Generation cap per assistant turn.")
flags.DEFINE_integer("rollout_repeats", 3, "Measurements; the best is reported.")
flags.DEFINE_string("rollout_model", "", "HF or Orbax model directory (default: a random tiny model).")
FLAGS = flags.FLAGS

MAX_LEN = 4096
WARMUP_PASSES = 4
_COMPILE = {"s": 0.0}


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILE["s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


class ReplayPool:
    """The pool interface, answering every call at once with the results recorded in `trajs`
    (the i-th reset submitted is episode i): a rollout against it costs no environment time."""

    def __init__(self, trajs):
        self._trajs = trajs
        self._ready: list = []
        self._where: dict = {}  # pool episode key -> (trajectory, next observation index)

    def submit_reset(self, episode, family, task_id, max_steps=None) -> None:
        self._where[episode] = (self._trajs[len(self._where)], 0)
        self._answer(episode, "reset")

    def submit_step(self, episode, action) -> None:
        self._answer(episode, "step")

    def _answer(self, episode, kind) -> None:
        from envs.pool import EnvResult

        traj, j = self._where[episode]
        last = j >= len(traj.observations) - 1
        obs = traj.observations[min(j, len(traj.observations) - 1)]
        done = last and traj.finish_reason != "context_full"
        info = dict(traj.metadata["env"]) if done else {}
        self._ready.append(EnvResult(episode, kind, obs, traj.score if done else 0.0, done,
                                     traj.success if done else False, info))
        self._where[episode] = (traj, j + 1)

    def poll(self, timeout=0.0) -> list:
        out, self._ready = self._ready, []
        return out

    wait_all = poll

    def pending(self) -> int:
        return len(self._ready)

    def has_slot(self, episode) -> bool:
        return episode in self._where

    def release(self, episode) -> None:
        pass


def replay_actions(pool, family: str, trajs, rounds: int) -> tuple[float, int]:
    """Plays each trajectory's recorded actions through `pool`, all episodes at once; returns
    (wall seconds, environment steps)."""
    plans = {i: list(t.actions[:len(t.observations) - 1]) for i, t in enumerate(trajs)}
    t0 = time.perf_counter()
    for i, t in enumerate(trajs):
        pool.submit_reset(("replay", i), family, int(t.task_id), max_steps=rounds)
    live, steps = len(trajs), 0
    while live:
        results = pool.poll(timeout=120)
        if not results:
            raise TimeoutError("environment replay: no result within 120 s")
        for r in results:
            steps += r.kind == "step"
            i = r.episode[1]
            if r.done or not r.ok or not plans[i]:
                live -= 1
                if not r.done and r.ok:
                    pool.release(r.episode)
                continue
            pool.submit_step(r.episode, plans[i].pop(0))
    return time.perf_counter() - t0, steps


def _policy():
    """(model, tokenizer, chat style) of the benchmark."""
    import models
    from cope_jax.tokenizer import load_tokenizer

    if FLAGS.rollout_model:
        model, _ = models.load_model(FLAGS.rollout_model)
        return model, load_tokenizer(FLAGS.rollout_model), "qwen2.5"
    tok = load_tokenizer("qwen2.5")
    cfg = models.QwenConfig(family="qwen3", vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                            rope_theta=1e4, tie_word_embeddings=True, qkv_bias=False, qk_norm=True,
                            dtype="float32", param_dtype="float32")
    return models.create_model(cfg, seed=0), tok, "qwen2.5"


def _tasks(family, n: int) -> list[tuple[int, int]]:
    ids = family.task_ids("test")
    step = max(1, len(ids) // n)
    return [(int(ids[(i * step) % len(ids)]), i) for i in range(n)]


def measure(family_name: str, model, tokenizer, style: str) -> dict:
    from cope_jax.chat import ChatFormat
    from cope_jax.rollout import RolloutConfig, RolloutRunner
    from cope_jax.sampler import Sampler
    from envs.pool import EnvPool
    from envs.registry import make_family

    workers, slots = FLAGS.rollout_workers, FLAGS.rollout_envs_per_worker
    family = make_family(family_name)
    chat = ChatFormat(tokenizer, style)
    plan = _tasks(family, FLAGS.rollout_episodes)
    rows = FLAGS.rollout_rows or workers * slots
    sampler = Sampler(model, batch_size=rows, max_len=MAX_LEN, eos_ids=tokenizer.eos_ids)
    cfg = RolloutConfig(max_rounds=FLAGS.rollout_rounds, max_turn_tokens=FLAGS.rollout_turn_tokens,
                        temperature=1.0)
    key = jax.random.key(0)
    best: dict[str, float] = {}
    compiled: dict[str, float] = {}  # best time of each measurement among runs that compiled

    def timed(name, fn, seconds):
        """result = fn(), timed as seconds(result); a run that compiled anything is kept apart, so
        a new sampler shape reached by the asynchronous schedule does not count as rollout time."""
        before = _COMPILE["s"]
        result = fn()
        into = best if _COMPILE["s"] == before else compiled
        into[name] = min(into.get(name, float("inf")), seconds(result))
        return result

    with EnvPool({family_name: workers}, envs_per_worker=slots) as pool:
        runner = RolloutRunner(sampler, pool, family_name, family, chat, cfg)
        lockstep = RolloutRunner(sampler, pool, family_name, family, chat, dataclasses.replace(cfg, sync=True))
        for _ in range(WARMUP_PASSES):  # compiles, starts and warms the environments
            before = _COMPILE["s"]
            trajs, _ = runner.run(plan, key)
            RolloutRunner(sampler, ReplayPool(trajs), family_name, family, chat, cfg).run(plan, key)
            lockstep.run(plan, key)
            if _COMPILE["s"] == before:
                break
        compile_before = _COMPILE["s"]
        wall = lambda out: out[1].wall_s  # noqa: E731
        for _ in range(FLAGS.rollout_repeats):
            trajs, stats = timed("wall_s", lambda: runner.run(plan, key), wall)
            replay = RolloutRunner(sampler, ReplayPool(trajs), family_name, family, chat, cfg)
            _, rstats = timed("sampling_s", lambda: replay.run(plan, key), wall)
            _, env_steps = timed("env_s", lambda: replay_actions(pool, family_name, trajs, FLAGS.rollout_rounds),
                                 lambda out: out[0])
            timed("sync_wall_s", lambda: lockstep.run(plan, key), wall)
    family.close()
    # a measurement whose every run compiled is reported from those runs and named in `unclean`
    unclean = sorted(set(compiled) - set(best))
    best.update({k: compiled[k] for k in unclean})
    out = {"suite": "rollout", "family": family_name, "workers": workers, "envs_per_worker": slots, "rows": rows,
           "episodes": len(plan), "env_steps": stats.env_steps, "env_steps_replayed": env_steps,
           "gen_tokens": stats.generated_tokens, "gen_tokens_replayed": rstats.generated_tokens,
           **{k: round(v, 3) for k, v in best.items()}, "compile_s": round(_COMPILE["s"] - compile_before, 3),
           "unclean": unclean}
    out["sum_s"] = round(best["sampling_s"] + best["env_s"], 3)
    out["overlap"] = round(best["wall_s"] / max(best["sampling_s"], best["env_s"]), 3)
    out["wall_over_sum"] = round(best["wall_s"] / out["sum_s"], 3)
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


def run(argv) -> None:
    del argv
    model, tokenizer, style = _policy()
    for family in FLAGS.rollout_families:
        print(json.dumps(measure(family, model, tokenizer, style)), flush=True)


if __name__ == "__main__":  # pragma: no cover
    from absl import app

    app.run(lambda argv: run(argv[1:]))
