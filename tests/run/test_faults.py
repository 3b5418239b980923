"""Environment faults leave the batch: not failures, not successes; counted, warned, and a step with
too many of them stops the run."""
import json
import logging
import os
import signal

import numpy as np
import pytest

from cope_jax.run import faults
from cope_jax.objective.advantages import grpo_advantages
from cope_jax.rollout.trajectory import Trajectory
from tests.stages.test_train_e2e import tiny_config


def _traj(group: int, success: bool, reason: str = "done", pid=None) -> Trajectory:
    env = {"error": reason[4:], "reason": "worker lost: killed", "worker_pid": pid} if reason.startswith("env_") else {}
    return Trajectory(tokens=np.arange(6), action_mask=np.r_[[False] * 3, [True] * 3], obs_mask=np.zeros(6, bool),
                      success=success, group_id=group, task_id=group, finish_reason=reason,
                      metadata={"env": env})


def test_faults_leave_the_batch_counted_by_reason_and_warned_per_worker(caplog):
    batch = [_traj(0, True), _traj(0, False, "env_crashed", 41), _traj(0, False), _traj(1, True),
             _traj(1, False, "env_crashed", 41), _traj(1, False, "env_timeout", 42), _traj(1, False), _traj(2, True)]
    with caplog.at_level(logging.WARNING):
        kept, report = faults.drop(batch, max_fraction=0.5, what="step 3")
    assert kept == [batch[i] for i in (0, 2, 3, 6, 7)]
    assert report.record() == {"env_faults": 3.0, "env_crashed": 2.0, "env_timeout": 1.0}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one per (worker, reason)
    assert any("2 episode(s) of this step 3" in m and "env_crashed" in m and "pid 41" in m for m in lines)
    assert any("env_timeout" in m and "pid 42" in m for m in lines)


def test_a_group_keeps_its_statistics_over_the_episodes_that_finished():
    """Group 0 loses its failure to a crash: the success left alone is method §2.1's group of one
    (A = Y = 1), not a success beside a 'failure' (A = +0.71)."""
    batch = [_traj(0, True), _traj(0, False, "env_crashed", 7), _traj(1, True), _traj(1, False)]
    kept, _ = faults.drop(batch, max_fraction=0.5)
    adv = grpo_advantages([float(t.success) for t in kept], [t.group_id for t in kept])
    np.testing.assert_allclose(adv, [1.0, 0.7071, -0.7071], atol=1e-4)


def test_too_many_faults_stop_with_one_line():
    batch = [_traj(0, True), _traj(0, False, "env_crashed", 7), _traj(1, False, "env_timeout", 8), _traj(1, True)]
    with pytest.raises(faults.FaultError) as e:
        faults.drop(batch, max_fraction=0.25, what="step 1")
    msg = str(e.value)
    assert "\n" not in msg and "2 of 4 episodes of this step 1" in msg and "max_fault_fraction=0.25" in msg
    assert faults.drop(batch, max_fraction=0.5)[1].total == 2  # at the limit: trained on the rest


def test_a_worker_killed_mid_rollout_leaves_its_episodes_out_of_the_step(tmp_path, monkeypatch):
    """A real run: one of two environment workers is SIGKILLed while the first step's episodes play.
    Its episodes reach neither the forecasting examples nor the mini-batches (which hold exactly the
    finished episodes), and the step record counts them."""
    from cope_jax.run.build import build
    from cope_jax.stages import loop
    from cope_jax.stages.rl import train
    from envs.pool import EnvPool

    c = tiny_config("cope", steps=1)
    c.env.update(workers=2, max_rounds_train=6)
    c.rollout.update(tasks_per_step=2, group_size=4, sampler_rows=8, max_fault_fraction=0.75, prefetch_resets=False)
    c.eval.update(every=0)
    c.env.max_replays = 0  # the faults themselves (replays: the test below)
    seen = {}
    real_build = loop.build_minibatches

    def build_recorded(trajs, *args, **kwargs):
        seen["trajs"] = list(trajs)
        return real_build(trajs, *args, **kwargs)

    polls = {"n": 0}
    real_poll = EnvPool.poll

    def poll(self, timeout=0.0):
        results = real_poll(self, timeout)
        polls["n"] += sum(r.kind == "step" for r in results)
        if polls["n"] >= 4 and "killed" not in seen:  # mid-rollout: some steps done, episodes live
            seen["killed"] = self.worker_pids("builtin")[0]
            os.kill(seen["killed"], signal.SIGKILL)
        return results

    monkeypatch.setattr(loop, "build_minibatches", build_recorded)
    parts = build(c, str(tmp_path / "run"))
    monkeypatch.setattr(EnvPool, "poll", poll)  # after the tokenizer's corpus, which plays through the pool
    try:
        train(parts, progress=False)
    finally:
        parts.close()
    record = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][-1]
    lost = int(record["env_faults"])
    assert lost >= 1 and record.get("env_crashed", 0) >= 1, record
    trained = seen["trajs"]
    assert len(trained) == 8 - lost and not any(t.finish_reason.startswith("env_") for t in trained)


def test_a_worker_killed_mid_rollout_costs_replays_not_episodes(tmp_path, monkeypatch):
    """The same kill with replays on (the default): every episode the dead worker held is played again
    from its start on a live worker, the step trains on all 8 episodes, and the record counts the
    replays and no fault."""
    from cope_jax.run.build import build
    from cope_jax.stages import loop
    from cope_jax.stages.rl import train
    from envs.pool import EnvPool

    c = tiny_config("cope", steps=1)
    c.env.update(workers=2, max_rounds_train=6)
    c.rollout.update(tasks_per_step=2, group_size=4, sampler_rows=8, prefetch_resets=False)
    c.eval.update(every=0)
    assert c.env.max_replays == 2
    seen = {}
    real_build, real_poll = loop.build_minibatches, EnvPool.poll

    def build_recorded(trajs, *args, **kwargs):
        seen["trajs"] = list(trajs)
        return real_build(trajs, *args, **kwargs)

    def poll(self, timeout=0.0):
        results = real_poll(self, timeout)
        seen["steps"] = seen.get("steps", 0) + sum(r.kind == "step" for r in results)
        if seen["steps"] >= 4 and "killed" not in seen:
            seen["killed"] = self.worker_pids("builtin")[0]
            os.kill(seen["killed"], signal.SIGKILL)
        return results

    monkeypatch.setattr(loop, "build_minibatches", build_recorded)
    parts = build(c, str(tmp_path / "run"))
    monkeypatch.setattr(EnvPool, "poll", poll)
    try:
        train(parts, progress=False)
        assert seen["killed"] not in parts.pool.worker_pids() and len(parts.pool.worker_pids()) == 2
    finally:
        parts.close()
    record = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert record["env_faults"] == 0 and record["env_replays"] >= 1, record
    trained = seen["trajs"]
    assert len(trained) == 8 and not any(t.finish_reason.startswith("env_") for t in trained)
    assert sum(t.metadata["replays"] for t in trained) == record["env_replays"]


def test_a_task_that_hangs_every_replay_is_a_fault_naming_the_task(caplog):
    """The chaos family hangs on a negative task id: the episode times out, is replayed twice (each
    time a fresh worker, a fresh reset) and then ends as env_timeout; the warning names the task and
    the replays. The other episode of the batch is untouched."""
    from tests.rollout.test_rollout import _runner_parts

    chat, sampler = _runner_parts()
    from cope_jax.rollout.runner import RolloutConfig, RolloutRunner
    from envs.pool import EnvPool
    from envs.registry import make_family

    family = make_family("chaos")
    task = family.task_ids("test")[0]
    with EnvPool({"chaos": 2}, call_timeout=1.0) as pool:
        runner = RolloutRunner(sampler, pool, "chaos", family, chat, RolloutConfig(max_rounds=3, max_turn_tokens=6))
        import jax
        trajs, stats = runner.run([(-1, 0), (task, 1)], jax.random.key(0))
    bad, good = trajs
    assert bad.finish_reason == "env_timeout" and bad.metadata["replays"] == 2 and stats.replays == 2
    assert not good.finish_reason.startswith("env_") and good.metadata["replays"] == 0
    with caplog.at_level(logging.WARNING):
        with pytest.raises(faults.FaultError, match=r"\(task -1, after 2 replays\)"):
            faults.drop(trajs, 0.25)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_worker_killed_at_a_random_moment_of_the_first_rollout_costs_no_episode(tmp_path, seed):
    """The demo's path at small settings, the next batch's resets prefetched (the default): one of
    two workers SIGKILLed at a random moment of the first rollout (a random round of its loop, then
    up to 0.3 s: resets or steps in flight, the sampler compiling or decoding while the episodes and
    the prefetched ones sit idle). Both steps train on every episode; nothing hangs."""
    import threading

    from cope_jax.rollout.runner import RolloutRunner
    from cope_jax.stages.entry import train_run

    c = tiny_config("cope", steps=2)
    c.env.update(workers=2, max_rounds_train=4)
    c.rollout.update(tasks_per_step=2, group_size=4, sampler_rows=8)
    c.eval.update(every=0)
    assert c.rollout.prefetch_resets and c.rollout.sync
    rng = np.random.default_rng(seed)
    round_, delay, victim = int(rng.integers(1, 5)), rng.uniform(0.0, 0.3), int(rng.integers(2))
    rounds, killed = [], []
    real_collect = RolloutRunner._collect

    def collect(self, *args, **kwargs):
        rounds.append(None)
        if len(rounds) == round_:
            pid = self.pool.worker_pids()[victim]
            killed.append(pid)
            threading.Timer(delay, os.kill, (pid, signal.SIGKILL)).start()
        return real_collect(self, *args, **kwargs)

    def stop(*_):
        raise TimeoutError("hung: still running after 240 s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(240)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(RolloutRunner, "_collect", collect)
            train_run(c, str(tmp_path / "run"), progress=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert killed
    records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert sum(r["env_faults"] for r in train) == 0, train
