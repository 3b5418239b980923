"""Rollout overlap benchmark: does stepping environments overlap with decoding?

  python -m launch.bench --suite=rollout [--rollout_families=builtin,sciworld] [--rollout_workers=4]
      [--rollout_envs_per_worker=2] [--rollout_episodes=16] [--rollout_rounds=8]
      [--rollout_turn_tokens=24] [--rollout_turn_end=0.08] [--rollout_update_s=1] [--rollout_repeats=3]
      [--rollout_model=DIR] [--rollout_partial_steps=0] [--rollout_group_size=4]

For each family, three measurements of the same episodes, in the same run (after a warm-up pass
that compiles the sampler's shapes and warms the environments, e.g. the JVM's JIT):

- `wall_s`: the real rollout, `RolloutRunner` with the asynchronous pool (`sync=False`; turns
  streamed, each action sent to its environment as soon as its turn ends), in the steady state of
  training: its environments were reset during the batch before it and the train step after that
  (`prefetch`; the train step is a pause of `--rollout_update_s`), and it resets the next batch's.
  `cold_wall_s`: the same batch from cold (its resets inside it);
- `sampling_s`: pure sampling, the same rollout against a pool that answers at once with the
  recorded results (no environment work). Episodes sample with per-episode keys, so the sampler
  generates the same turns (`gen_tokens` of both lines);
- `env_s`: pure environment time, the recorded actions replayed through the same pool (same
  workers, same environment instances) with no model, each episode's next action sent as soon as its result is in.

`occupancy` (the rows a sampler call decodes over the sampler's rows, averaged over the calls of the
last `wall_s` run) and `low_occupancy_share` (the share of that run's wall time after calls under half
occupancy: the rollout's tail, `RolloutStats`) say how much of the batch the sampler still had when
the last episodes ran.

`overlap = wall_s / max(sampling_s, env_s)` (`cold_overlap` from `cold_wall_s`): 1.0 means
environment time hides completely behind decoding (or the reverse); `wall_s / (sampling_s + env_s)`
near 1 means none does. A lockstep
rollout (`sync=True`, no overlap by design) is reported as `sync_wall_s` for reference. Each time is
the best of `repeats`, with the CPU time it took (`*_cpu_s`: this process and the environment
workers with what they started, e.g. ScienceWorld's JVMs). Where decoding and the environments
run on the same cores (a CPU-only machine), no order of events finishes before their CPU time over the
cores: `overlap_floor` is the overlap that bound allows (1.0 on an accelerator host, where the
device decodes). The asynchronous order depends on timing, so it can reach sampler shapes
the warm-up did not: warm-up passes repeat until one compiles nothing, and `compile_s` reports
XLA compilation inside the measured runs; a run that compiled is not used for its measurement
unless every run of it did (then the measurement is listed in `unclean`).

The policy is a random Qwen3-shaped model (or `--rollout_model`), so actions are mostly invalid:
the environment still parses and answers each one. A random fraction p (`--rollout_turn_end`) of
the vocabulary ends a turn, so turns end at uneven lengths (~1/p tokens, at most
`--rollout_turn_tokens`) as a trained policy's do, and streaming lets the environments step while
the longer turns of the call decode; with p = 0 every turn runs to the cap and all end together
(nothing to overlap within a round). One JSON object per line.

With `--rollout_partial_steps=N`, a second line per family (`"measure": "partial"`) compares the
rollout wall time per trained episode of N training steps with partial rollouts off and on (same
sampler, same pool, tasks_per_step = `--rollout_episodes` / `--rollout_group_size` groups trained a
step, group g on the g-th task of a fixed shuffle of the test tasks; `--norollout_overlap`: this line
only). Off: each step plays tasks_per_step new groups to the end. On:
as `PartialRollouts.step` (`cope_jax/stages/partial.py`) with groups_in_flight = 2 x tasks_per_step:
each step tops the parked groups up with new ones and ends once tasks_per_step groups are complete;
the last step plays every group to its end. Each mode uses a fresh runner; one untimed pass of each
warms up. Per mode (its best repeat: least wall per episode): `*_wall_s` (the runs' walls summed),
`*_episodes` (trained), `*_groups` (started: all train, as both modes end drained),
`*_per_episode_s`, `*_capped_share` and `*_success_share` (of the trained episodes: ended by the
round cap, successes), `*_occupancy`, `*_low_occupancy_share`, `*_decode_calls`, `*_env_steps`,
`*_gen_tokens`, `*_prefill_tokens` (put into the cache; on, that counts the parked episodes'
contexts again), `*_compile_s`. `speedup` = off over on per episode; `calls_ratio` the same for
sampler calls per episode: the speed-up where a call costs the same whatever its rows (an
accelerator's decode). On a CPU a call's cost grows with the rows it decodes, so fuller calls gain
less wall time there (docs/benchmarks.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time

import jax
from absl import app, flags

flags.DEFINE_list("rollout_families", ["builtin", "sciworld"], "Environment families to measure.")
flags.DEFINE_integer("rollout_workers", 4, "Environment worker processes.")
flags.DEFINE_integer("rollout_envs_per_worker", 2, "Environment instances (live episodes) per worker.")
flags.DEFINE_integer("rollout_rows", 0, "Sampler rows (0: one per environment instance).")
flags.DEFINE_integer("rollout_row_devices", 0, "Shard the sampler's rows over this many devices (a `data` mesh axis; "
                     "on a CPU host, host devices the bench makes), so every sampler call decodes all its rows, "
                     "as a memory-bound accelerator's costs (0: one device; its calls decode only the rows that "
                     "have a turn to sample).")
flags.DEFINE_integer("rollout_episodes", 16, "Episodes per rollout batch.")
flags.DEFINE_integer("rollout_rounds", 8, "Environment steps per episode (max rounds).")
flags.DEFINE_integer("rollout_turn_tokens", 24, "Generation cap per assistant turn.")
flags.DEFINE_integer("rollout_repeats", 3, "Measurements; the best is reported.")
flags.DEFINE_string("rollout_model", "", "HF or Orbax model directory (default: a random tiny model).")
flags.DEFINE_integer("rollout_stream_every", 0, "Decode steps between hand-offs of finished turns "
                     "(0: RolloutConfig's default).")
flags.DEFINE_float("rollout_update_s", 1.0,
                   "Seconds between the batch before and the measured steady-state batch: the train step "
                   "during which the measured batch's prefetched environments reset.")
flags.DEFINE_float("rollout_turn_end", 0.08,
                   "Random policy only: the fraction of the vocabulary that ends a turn, so turns end at "
                   "uneven lengths as a trained policy's do (0: every turn runs to --rollout_turn_tokens).")
flags.DEFINE_bool("rollout_overlap", True, "Measure the overlap line (false: only the `measure: partial` line "
                  "of --rollout_partial_steps).")
flags.DEFINE_integer("rollout_partial_steps", 0, "Training steps of the partial-rollouts comparison "
                     "(the `measure: partial` line; 0: not measured).")
flags.DEFINE_integer("rollout_group_size", 4, "Episodes per group (one task) in the partial-rollouts comparison.")
flags.DEFINE_float("rollout_tail_call_s", 0.0, "The partial-rollouts comparison on the tail family: seconds each "
                   "environment call takes (a simulator's or simulated customer's own time; 0: instant calls).")
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

    def submit_reset(self, episode, family, task_id, max_rounds=None) -> None:
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

    def outstanding(self) -> int:
        return len(self._ready)

    def can_progress(self) -> bool:
        return bool(self._ready)

    def quiet_limit(self) -> float:
        return 0.0  # every call is answered at once

    def describe(self) -> str:
        return f"recorded results of {len(self._trajs)} episodes, {len(self._ready)} not yet polled"

    def has_instance(self, episode) -> bool:
        return episode in self._where

    def release(self, episode) -> None:
        pass


def replay_actions(pool, family: str, trajs, max_rounds: int) -> tuple[float, int]:
    """Plays each trajectory's recorded actions through `pool`, all episodes at once; returns
    (wall seconds, environment steps)."""
    from cope_jax.run.demos import play_actions

    scripts = [(t.task_id, t.actions[:len(t.observations) - 1]) for t in trajs]
    t0 = time.perf_counter()
    played = play_actions(pool, family, scripts, max_rounds=max_rounds)
    return time.perf_counter() - t0, sum(p["played"] for p in played)


def _row_mesh():
    """The mesh `--rollout_row_devices` shards the sampler's rows over (None: one device)."""
    import models

    n = FLAGS.rollout_row_devices
    if not n:
        return None
    if jax.device_count() < n:
        raise app.UsageError(f"--rollout_row_devices={n}: {jax.device_count()} devices (JAX started before the "
                             "bench could make host devices)")
    return models.make_mesh((n, 1, 1), devices=jax.devices()[:n])


def _policy():
    """(model, tokenizer, chat style, end-of-turn ids) of the benchmark."""
    import numpy as np

    import models
    from cope_jax.rollout.tokenizer import load_tokenizer

    mesh = _row_mesh()
    if FLAGS.rollout_model:
        if FLAGS.rollout_turn_end:
            raise app.UsageError("--rollout_turn_end shapes the random policy; a --rollout_model ends its own turns")
        model, _ = models.load_model(FLAGS.rollout_model, mesh=mesh)
        tok = load_tokenizer(FLAGS.rollout_model)
        return model, tok, "qwen2.5", tuple(tok.eos_ids)
    if not 0 <= FLAGS.rollout_turn_end < 1:
        raise app.UsageError(f"--rollout_turn_end must be in [0, 1), got {FLAGS.rollout_turn_end}")
    tok = load_tokenizer("qwen2.5")
    cfg = models.QwenConfig(family="qwen3", vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                            rope_theta=1e4, tie_word_embeddings=True, qkv_bias=False, qk_norm=True,
                            dtype="float32", param_dtype="float32")
    # a random model's next token is spread over the vocabulary: treating a random fraction p of it
    # as end-of-turn ids ends each turn after ~1/p tokens, at a different length per turn
    ends = np.random.default_rng(0).permutation(tok.vocab_size)[:round(FLAGS.rollout_turn_end * tok.vocab_size)]
    return models.create_model(cfg, seed=0, mesh=mesh), tok, "qwen2.5", tuple(tok.eos_ids) + tuple(int(i) for i in ends)


def _cpu_s(pool) -> float:
    """CPU seconds used so far by this process and by the pool's worker processes and their
    descendants (ScienceWorld's JVMs), read from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    todo, total = list(pool.worker_pids()), 0.0
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / ticks  # utime + stime
    return total + time.process_time()


def _seconds(v: float) -> float:
    """4 significant digits: a fixed number of decimals turns the small runs' millisecond times into 0."""
    return float(f"{v:.4g}")


def _tasks(family, n: int) -> list[tuple[int, int]]:
    ids = family.task_ids("test")
    step = max(1, len(ids) // n)
    return [(int(ids[(i * step) % len(ids)]), i) for i in range(n)]


def _parts(family_name: str, model, tokenizer, style: str, eos_ids):
    """(family, chat format, sampler, rollout config) of a family's measurements."""
    from cope_jax.rollout.chat import ChatFormat
    from cope_jax.rollout.runner import RolloutConfig
    from cope_jax.rollout.sampler import Sampler
    from envs.registry import make_family

    rows = FLAGS.rollout_rows or FLAGS.rollout_workers * FLAGS.rollout_envs_per_worker
    sampler = Sampler(model, batch_size=rows, max_len=MAX_LEN, eos_ids=eos_ids)
    if FLAGS.rollout_row_devices and sampler.gather:
        raise RuntimeError(f"the sampler gathers its rows on mesh {dict(model.mesh.shape)}: --rollout_row_devices "
                           "would measure nothing")
    cfg = RolloutConfig(max_rounds=FLAGS.rollout_rounds, max_turn_tokens=FLAGS.rollout_turn_tokens,
                        temperature=1.0)
    if FLAGS.rollout_stream_every:
        cfg = dataclasses.replace(cfg, stream_every=FLAGS.rollout_stream_every)
    return make_family(family_name), ChatFormat(tokenizer, style), sampler, cfg


def measure(family_name: str, model, tokenizer, style: str, eos_ids) -> dict:
    from cope_jax.rollout.runner import RolloutRunner
    from envs.pool import EnvPool

    workers, instances = FLAGS.rollout_workers, FLAGS.rollout_envs_per_worker
    family, chat, sampler, cfg = _parts(family_name, model, tokenizer, style, eos_ids)
    schedule = _tasks(family, FLAGS.rollout_episodes)
    rows = sampler.batch_size
    key = jax.random.key(0)
    best: dict[str, tuple[float, float]] = {}  # measurement -> (seconds, CPU seconds) of its best run
    compiled: dict[str, tuple[float, float]] = {}  # the same among runs that compiled

    def timed(name, fn, seconds):
        """result = fn(), timed as seconds(result), with the CPU time of this process and of the
        environment workers (and what they started) meanwhile; a run that compiled anything is kept
        apart, so a new sampler shape reached by the asynchronous schedule does not count."""
        before, cpu = _COMPILE["s"], _cpu_s(pool)
        result = fn()
        cpu = _cpu_s(pool) - cpu
        into = best if _COMPILE["s"] == before else compiled
        into[name] = min(into.get(name, (float("inf"), 0.0)), (seconds(result), cpu))
        return result

    with EnvPool({family_name: workers}, envs_per_worker=instances) as pool:
        runner = RolloutRunner(sampler, pool, family_name, family, chat, cfg)
        lockstep = RolloutRunner(sampler, pool, family_name, family, chat, dataclasses.replace(cfg, sync=True))
        ids = range(len(schedule))
        for _ in range(WARMUP_PASSES):  # compiles, starts and warms the environments
            before = _COMPILE["s"]
            runner.run(schedule, key, prefetch=schedule, prefetch_ids=ids)
            trajs, _ = runner.run(schedule, key)
            RolloutRunner(sampler, ReplayPool(trajs), family_name, family, chat, cfg).run(schedule, key)
            lockstep.run(schedule, key)
            if _COMPILE["s"] == before:
                break
        compile_before = _COMPILE["s"]
        wall = lambda out: out[1].wall_s  # noqa: E731
        for _ in range(FLAGS.rollout_repeats):
            timed("cold_wall_s", lambda: runner.run(schedule, key), wall)
            # the steady state of training: this batch's environments were reset during the batch
            # before it, and it resets the next one's
            runner.run(schedule, key, prefetch=schedule, prefetch_ids=ids)
            time.sleep(FLAGS.rollout_update_s)  # the train step
            trajs, stats = timed("wall_s", lambda: runner.run(schedule, key, prefetch=schedule, prefetch_ids=ids), wall)
            runner.cancel_prefetch()
            pool.wait_all()  # and lets its resets finish before the next measurement
            replay = RolloutRunner(sampler, ReplayPool(trajs), family_name, family, chat, cfg)
            _, rstats = timed("sampling_s", lambda: replay.run(schedule, key), wall)
            _, env_steps = timed("env_s", lambda: replay_actions(pool, family_name, trajs, FLAGS.rollout_rounds),
                                 lambda out: out[0])
            timed("sync_wall_s", lambda: lockstep.run(schedule, key), wall)
    family.close()
    fields = {"suite": "rollout", "family": family_name, "workers": workers, "envs_per_worker": instances, "rows": rows,
              "row_devices": FLAGS.rollout_row_devices,
              "episodes": len(schedule), "env_steps": stats.env_steps, "env_steps_replayed": env_steps,
              "gen_tokens": stats.generated_tokens, "gen_tokens_replayed": rstats.generated_tokens,
              "occupancy": round(stats.occupancy, 3), "low_occupancy_share": round(stats.low_occupancy_share, 3),
              "turn_end": FLAGS.rollout_turn_end, "stream_every": cfg.stream_every, "update_s": FLAGS.rollout_update_s}
    return _line(fields, best, compiled, round(_COMPILE["s"] - compile_before, 3))


def _line(fields: dict, best: dict, compiled: dict, compile_s: float) -> dict:
    """The benchmark's line: `fields`, each measurement's best (seconds, CPU seconds), and the ratios."""
    # a measurement whose every run compiled is reported from those runs and named in `unclean`
    unclean = sorted(set(compiled) - set(best))
    best.update({k: compiled[k] for k in unclean})
    secs = {k: v[0] for k, v in best.items()}
    cpus = len(os.sched_getaffinity(0))
    out = {**fields, **{k: _seconds(v) for k, v in secs.items()}, "compile_s": compile_s, "unclean": unclean}
    total = secs["sampling_s"] + secs["env_s"]
    out["sum_s"] = _seconds(total)
    longer = max(secs["sampling_s"], secs["env_s"])
    out["overlap"] = round(secs["wall_s"] / longer, 3)
    out["cold_overlap"] = round(secs["cold_wall_s"] / longer, 3)
    out["wall_over_sum"] = round(secs["wall_s"] / total, 3)
    # decoding and environments share this machine's cores: the rollout needs at least their CPU
    # time over the cores, whatever the schedule (on an accelerator host they do not compete)
    out.update({f"{k[:-2]}_cpu_s": _seconds(v[1]) for k, v in best.items()}, cpus=cpus)
    out["overlap_floor"] = round(max(longer, (best["sampling_s"][1] + best["env_s"][1]) / cpus) / longer, 3)
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


class _Tasks:
    """The partial-rollouts comparison's tasks: the family's test tasks in a fixed shuffled order,
    round and round (a family's ids run in task-type order, and a training run draws them shuffled)."""

    def __init__(self, task_ids: list[int]):
        self.task_ids, self.next = random.Random(0).sample(task_ids, len(task_ids)), 0

    def take(self, n: int) -> list[int]:
        self.next += n
        return [self.task_ids[g % len(self.task_ids)] for g in range(self.next - n, self.next)]


def play_steps(runner, task_ids: list[int], key, partial: bool):
    """`--rollout_partial_steps` training steps' rollouts on a fresh `runner` -> ((finish reason,
    success) of each trained episode, groups started, the runs' stats summed). A step trains
    tasks_per_step groups. Off: that many new groups (group g: the g-th task, episode ids
    g * group_size + member), played to the end. On: `PartialRollouts` (the RL stage's own) with groups_in_flight = 2 x tasks_per_step."""
    from cope_jax.rollout.runner import RolloutStats
    from cope_jax.stages.partial import PartialRollouts

    size, steps = FLAGS.rollout_group_size, FLAGS.rollout_partial_steps
    per_step = FLAGS.rollout_episodes // size
    tasks = _Tasks(task_ids)
    stage = PartialRollouts(runner, tasks, group_size=size, tasks_per_step=per_step,
                            max_staleness=steps, played_under={})
    trained, parts = [], []
    for step in range(steps):
        if partial:
            trajs, stats, _ = stage.step(step, key, last=step == steps - 1)
        else:
            first = tasks.next
            schedule = [(t, first + k) for k, t in enumerate(tasks.take(per_step)) for _ in range(size)]
            trajs, stats = runner.run(schedule, key, episode_ids=[g * size + m for _, g in schedule[::size]
                                                                  for m in range(size)])
        trained += [(t.finish_reason, t.success) for t in trajs]
        parts.append(stats)
    return trained, stage.next_group if partial else tasks.next, RolloutStats.combined(parts)


def measure_partial(family_name: str, model, tokenizer, style: str, eos_ids) -> dict:
    """The `measure: partial` line (module docstring): partial rollouts off and on, same sampler
    and pool, each mode's best repeat."""
    from cope_jax.rollout.runner import RolloutRunner
    from envs.pool import EnvPool

    family, chat, sampler, cfg = _parts(family_name, model, tokenizer, style, eos_ids)
    task_ids = [int(t) for t in family.task_ids("test")]
    key = jax.random.key(0)
    runs: dict[str, list] = {"off": [], "on": []}
    kwargs = {"tail": {"call_s": FLAGS.rollout_tail_call_s}} if family_name == "tail" else {}
    with EnvPool({family_name: FLAGS.rollout_workers}, envs_per_worker=FLAGS.rollout_envs_per_worker,
                 family_kwargs=kwargs) as pool:
        def play(partial: bool) -> tuple:
            runner = RolloutRunner(sampler, pool, family_name, family, chat, cfg)
            before = _COMPILE["s"]
            out = play_steps(runner, task_ids, key, partial)
            return (*out, _COMPILE["s"] - before)

        # one untimed pass of each mode compiles most shapes (a pass is N rollouts: repeating it until
        # nothing compiles costs minutes); a measured repeat that compiled counts only if all did
        for partial in (False, True):
            play(partial)
        for _ in range(FLAGS.rollout_repeats):
            for mode in runs:
                runs[mode].append(play(mode == "on"))
    family.close()
    per_step = FLAGS.rollout_episodes // FLAGS.rollout_group_size
    fields = {"suite": "rollout", "family": family_name, "measure": "partial", "steps": FLAGS.rollout_partial_steps,
              "group_size": FLAGS.rollout_group_size, "tasks_per_step": per_step, "groups_in_flight": 2 * per_step,
              "rows": sampler.batch_size, "workers": FLAGS.rollout_workers,
              "envs_per_worker": FLAGS.rollout_envs_per_worker, "row_devices": FLAGS.rollout_row_devices,
              "rounds": FLAGS.rollout_rounds, "turn_end": FLAGS.rollout_turn_end,
              "tail_call_s": FLAGS.rollout_tail_call_s}
    return _partial_line(fields, runs)


def _partial_line(fields: dict, runs: dict[str, list]) -> dict:
    """`fields` and each mode's best repeat (least wall time per trained episode, among the repeats
    that compiled nothing if any did), and the speed-up."""
    out, unclean = dict(fields), []
    for mode, repeats in runs.items():
        clean = [r for r in repeats if not r[3]]
        unclean += [] if clean else [mode]
        ends, started, stats, compile_s = min(clean or repeats, key=lambda r: r[2].host_wall_s / len(r[0]))
        wall, trained = stats.host_wall_s, len(ends)  # the runs' walls summed (`RolloutStats.combined`)
        out.update({f"{mode}_wall_s": _seconds(wall), f"{mode}_episodes": trained, f"{mode}_groups": started,
                    f"{mode}_per_episode_s": _seconds(wall / trained),
                    f"{mode}_capped_share": round(sum(r == "max_rounds" for r, _ in ends) / trained, 3),
                    f"{mode}_success_share": round(sum(y for _, y in ends) / trained, 3),
                    f"{mode}_occupancy": round(stats.occupancy, 3),
                    f"{mode}_low_occupancy_share": round(stats.low_occupancy_share, 3),
                    f"{mode}_decode_calls": stats.decode_calls, f"{mode}_env_steps": stats.env_steps,
                    f"{mode}_gen_tokens": stats.generated_tokens, f"{mode}_prefill_tokens": stats.prefill_tokens,
                    f"{mode}_compile_s": round(compile_s, 3)})
    out["speedup"] = round(out["off_per_episode_s"] / out["on_per_episode_s"], 3)
    # the speed-up where a sampler call costs the same whatever its rows (an accelerator's decode)
    calls = {m: out[f"{m}_decode_calls"] / out[f"{m}_episodes"] for m in runs}
    out["calls_ratio"] = round(calls["off"] / calls["on"], 3)
    out["compile_s"] = round(sum(r[3] for repeats in runs.values() for r in repeats), 3)
    out.update(unclean=unclean, cpus=len(os.sched_getaffinity(0)), load_avg_1m=round(os.getloadavg()[0], 2))
    return out


def _check_partial_flags() -> None:
    steps, size, episodes = FLAGS.rollout_partial_steps, FLAGS.rollout_group_size, FLAGS.rollout_episodes
    if steps < 0:
        raise app.UsageError(f"--rollout_partial_steps must be >= 0, got {steps}")
    if steps and (size < 1 or episodes < size or episodes % size):
        raise app.UsageError(f"--rollout_partial_steps: --rollout_episodes={episodes} must be a positive multiple "
                             f"of --rollout_group_size={size} (the groups a step trains)")


def run(argv) -> None:
    del argv
    if FLAGS.rollout_update_s < 0:
        raise app.UsageError(f"--rollout_update_s must be >= 0, got {FLAGS.rollout_update_s}")
    _check_partial_flags()
    rows = FLAGS.rollout_rows or FLAGS.rollout_workers * FLAGS.rollout_envs_per_worker
    if FLAGS.rollout_row_devices < 0 or (FLAGS.rollout_row_devices and rows % FLAGS.rollout_row_devices):
        raise app.UsageError(f"--rollout_row_devices={FLAGS.rollout_row_devices} must be >= 0 and divide the "
                             f"sampler's {rows} rows")
    if FLAGS.rollout_row_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # before JAX starts its backends (the suite's first device use is below)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                                   f"{FLAGS.rollout_row_devices}").strip()
    if not FLAGS.rollout_overlap and not FLAGS.rollout_partial_steps:
        raise app.UsageError("--norollout_overlap measures only the partial line: give --rollout_partial_steps")
    from envs.registry import FAMILIES

    unknown = [f for f in FLAGS.rollout_families if f not in FAMILIES]
    if unknown:
        raise app.UsageError(f"--rollout_families: no family {', '.join(unknown)}; known: {', '.join(sorted(FAMILIES))}")
    model, tokenizer, style, eos_ids = _policy()
    for family in FLAGS.rollout_families:
        if FLAGS.rollout_overlap:
            print(json.dumps(measure(family, model, tokenizer, style, eos_ids)), flush=True)
        if FLAGS.rollout_partial_steps:
            print(json.dumps(measure_partial(family, model, tokenizer, style, eos_ids)), flush=True)


if __name__ == "__main__":  # pragma: no cover
    app.run(lambda argv: run(argv[1:]))
