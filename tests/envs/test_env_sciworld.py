"""Real ScienceWorld: pool and splits, gold replays through the adapter and the pool, Y rules."""

import hashlib
import time

import pytest

from envs.pool import EnvPool
from envs.sciworld import EXCLUDED, INVALID, POOL, SPLIT_IDS, TASKS, SciWorldEnv
from tests.envs.splits import digest_in_fresh_interpreter

# One variation of several task types whose gold paths are quick to generate.
GOLD_TASKS = ["find-living-thing", "use-thermometer", "chemistry-mix", "lifespan-longest-lived"]


def _first_id(task_name, k=1):
    return [i for i, (name, _) in enumerate(POOL) if name == task_name][k]


@pytest.fixture(scope="module")
def env():
    e = SciWorldEnv()
    yield e
    e.close()


@pytest.fixture(scope="module")
def pool():
    # one worker with two JVMs, which it drives at once (FamilySpec.concurrent_instances)
    with EnvPool({"sciworld": 1}, envs_per_worker=2) as p:
        yield p


def test_task_table_matches_the_package():
    """Task ids, names and variation counts as the package's own API reports them (its own JVM)."""
    from scienceworld import ScienceWorldEnv
    from scienceworld.constants import ID2TASK

    assert [(tid, name) for tid, name, _ in TASKS] == list(ID2TASK.items())
    package = ScienceWorldEnv()
    try:
        for _, name, count in TASKS:
            assert package.get_max_variations(name) == count, name
    finally:
        package.close()


def test_pool_has_exactly_4639_ids():
    assert len(POOL) == 4639 == SciWorldEnv().num_tasks()
    names = {name for name, _ in POOL}
    assert len(names) == 23
    assert not names & {name for tid, name, _ in TASKS if tid in EXCLUDED}
    assert POOL[0] == ("boil", 0) and POOL[-1] == ("identify-life-stages-2", 9)


def test_splits_disjoint_sized_and_stable():
    fam = SciWorldEnv()
    train, test = fam.task_ids("train"), fam.task_ids("test")
    assert len(train) == 2120 and len(test) == 200
    assert not set(train) & set(test)
    assert all(0 <= i < 4639 for i in train + test)
    # pinned against silent drift, and the same in a fresh interpreter with other hash seeds
    assert {digest_in_fresh_interpreter("sciworld", seed) for seed in ("1", "2")} == {PINNED_SPLIT_DIGEST}
    digest = hashlib.sha256(repr((SPLIT_IDS["train"], SPLIT_IDS["test"])).encode()).hexdigest()
    assert test[:6] == [2, 18, 21, 22, 46, 57]
    assert digest[:16] == PINNED_SPLIT_DIGEST
    assert len({fam.task_family(i) for i in train}) == 23


PINNED_SPLIT_DIGEST = "9dcd7a87e3b7ee43"  # sha256 of repr((train, test)), first 16 hex


def test_gold_replay_through_the_adapter(env):
    for name in GOLD_TASKS[:2]:
        tid = _first_id(name)
        gold = env.gold_actions(tid)
        obs, info = env.reset(tid, max_rounds=len(gold))
        assert obs.startswith("Your task is to") and info["task_name"] == name
        for a in gold:
            obs, score, done, info = env.step(a)
            if done:
                break
        assert done and score == 100 and env.success(score, done, info), name


def test_gold_replay_through_the_pool_gives_y1(env, pool):
    golds = {}
    for name in GOLD_TASKS:
        tid = _first_id(name)
        golds[tid] = list(env.gold_actions(tid))
        pool.submit_reset(tid, "sciworld", tid, max_rounds=len(golds[tid]))
    finals = {}
    deadline = time.monotonic() + 120
    while len(finals) < len(golds) and time.monotonic() < deadline:
        for r in pool.poll(timeout=30):
            assert r.ok, r
            if r.done:
                finals[r.env_key] = r
            else:
                pool.submit_step(r.env_key, golds[r.env_key].pop(0))
    assert len({POOL[t][0] for t in finals}) >= 3
    assert len({r.worker_pid for r in finals.values()}) == 1
    for tid, r in finals.items():
        assert r.success and r.score == 100, (POOL[tid], r)


def test_wrong_focus_gives_y0(pool):
    tid = _first_id("find-living-thing")
    pool.submit_reset("wrong", "sciworld", tid, max_rounds=10)
    assert pool.wait_all(timeout=60)[0].ok
    pool.submit_step("wrong", "focus on air")
    (r,) = pool.wait_all(timeout=60)
    assert r.ok and r.done and not r.success and r.score == -100


def test_the_gold_family_steps_the_gold_path_whatever_the_model_says(env):
    """`sciworld_gold` (the bench's tail on the real engine): junk and unparsed replies step the gold
    path, so a task ends a success within its gold length, and a cap below that truncates."""
    from envs.sciworld_gold import GoldSciWorldEnv

    tid = _first_id("lifespan-longest-lived")
    n = len(env.gold_actions(tid))
    gold = GoldSciWorldEnv()
    try:
        obs, info = gold.reset(tid, max_rounds=n + 5)
        assert obs.startswith("Your task is to") and info["gold_length"] == n
        done, rounds = False, 0
        while not done:
            rounds += 1
            obs, score, done, info = gold.step("dance wildly" if rounds % 2 else None)
        assert rounds <= n and gold.success(score, done, info) and not info["truncated"]
        gold.reset(tid, max_rounds=rounds - 1)
        for k in range(rounds - 1):
            obs, score, done, info = gold.step("dance wildly")
            assert done == (k == rounds - 2)
        assert info["truncated"] and not gold.success(score, done, info)
    finally:
        gold.close()


def test_invalid_actions_and_step_cap(env):
    tid = _first_id("chemistry-mix")
    env.reset(tid, max_rounds=3)
    obs, score, done, info = env.step("dance wildly")
    assert obs == INVALID and info["invalid"] and not done
    obs, score, done, info = env.step(None)
    assert obs == INVALID and info["parsed"] is False and not done
    # `look around` is not a simulator move, but it is a round for our cap.
    obs, score, done, info = env.step("look around")
    assert done and info["truncated"] and not env.success(score, done, info)


def test_raw_path_matches_the_package_step(env):
    from scienceworld import ScienceWorldEnv
    tid = _first_id("lifespan-longest-lived")
    name, variation = POOL[tid]
    gold = env.gold_actions(tid)
    ref = ScienceWorldEnv()
    try:
        ref.load(name, variation)
        ref_obs, _ = ref.reset()
        obs, _ = env.reset(tid)
        # The simulator lists a room's objects in no fixed order across JVMs: compare line sets.
        lines = lambda text: sorted(text.split("\n"))  # noqa: E731
        assert lines(obs.split("\n", 1)[1]) == lines(ref_obs)
        for a in gold:
            o, score, done, _ = env.step(a)
            ro, _, rdone, rinfo = ref.step(a)
            assert (lines(o), score, done) == (lines(ro), rinfo["score"], rdone)
            if done:
                break
        assert done and score == 100
    finally:
        ref.close()


def test_jvm_heap_is_capped(env):
    env.reset(0)
    with open(f"/proc/{env._proc.pid}/cmdline", "rb") as f:
        assert b"-Xmx512m" in f.read().split(b"\0")
