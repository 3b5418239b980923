"""The synthetic long-tailed family: lengths fixed by the task, the stated distribution, through the
pool as every family is played."""
import time

import numpy as np

from envs.pool import EnvPool
from envs.registry import make_family
from envs.tail import NEVER, TailEnv


def test_lengths_follow_the_stated_distribution():
    env = TailEnv(success_rate=0.7, mean_success_rounds=3.0)
    lengths = np.array([env.length(t) for t in env.task_ids("train")])
    solved = lengths[lengths != NEVER]
    assert abs(len(solved) / len(lengths) - 0.7) < 0.05  # 1000 tasks: 3.5 binomial standard errors
    assert abs(solved.mean() - 3.0) < 0.3 and solved.min() == 1
    assert [env.length(t) for t in range(50)] == [TailEnv().length(t) for t in range(50)]  # fixed by the task
    assert [env.length(t) for t in range(50)] != [TailEnv(seed=1).length(t) for t in range(50)]


def test_every_reply_costs_a_round_and_the_cap_ends_a_failing_task():
    env = TailEnv()
    solvable = next(t for t in range(100) if 2 <= env.length(t) < NEVER)
    failing = next(t for t in range(100) if env.length(t) == NEVER)
    env.reset(solvable, max_rounds=20)
    steps = [env.step(None if i % 2 else "anything") for i in range(env.length(solvable))]
    assert [done for _, _, done, _ in steps] == [False] * (len(steps) - 1) + [True]
    assert env.success(steps[-1][1], True, steps[-1][3]) and not steps[-1][3]["truncated"]
    env.reset(failing, max_rounds=5)
    steps = [env.step("wait") for _ in range(5)]
    assert steps[-1][2] and steps[-1][3]["truncated"] and not env.success(steps[-1][1], True, steps[-1][3])


def test_the_pool_plays_it():
    family = make_family("tail")
    tasks = family.task_ids("test")[:6]
    with EnvPool({"tail": 2}, envs_per_worker=3) as pool:
        for t in tasks:
            pool.submit_reset(t, "tail", t, max_rounds=8)
        deadline, done = time.monotonic() + 60, {}
        while len(done) < len(tasks) and time.monotonic() < deadline:
            for r in pool.poll(timeout=1.0):
                assert r.ok, r.reason
                if r.done:
                    done[r.env_key] = r
                    continue
                pool.submit_step(r.env_key, "wait")
    assert set(done) == set(tasks)
    for t, r in done.items():
        assert r.info["rounds"] == min(family.length(t), 8) and r.success == (family.length(t) <= 8)


def test_a_reset_with_actions_replays_them_in_one_call():
    """How a parked episode is caught up: the worker resets and steps the actions in one call and
    answers with every observation; the replay stops where the episode ends."""
    family = make_family("tail")
    long = next(t for t in family.task_ids("test") if family.length(t) == NEVER)
    short = next(t for t in family.task_ids("test") if family.length(t) == 2)
    with EnvPool({"tail": 1}, envs_per_worker=2, call_timeout=5.0) as pool:
        pool.submit_reset("long", "tail", long, max_rounds=8, actions=["wait", None, "wait"])
        pool.submit_reset("short", "tail", short, max_rounds=8, actions=["wait"] * 4)
        got = {r.env_key: r for r in pool.wait_all(timeout=30)}
    assert got["long"].replayed == [f"Task {long}. Round 0.", "Round 1.", "Round 2.", "Round 3."]
    assert got["long"].observation == "Round 3." and not got["long"].done
    assert got["short"].replayed == [f"Task {short}. Round 0.", "Round 1.", "Round 2."]
    assert got["short"].done and got["short"].success
