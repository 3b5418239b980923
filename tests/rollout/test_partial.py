"""Partial rollouts at the runner: a run ends once n groups are complete, the others' episodes are
parked and continue first in the next run, with their tokens, sampler log-probs and turn versions
as they were; a parked episode whose environment is gone is caught up (or played again when the
environment does not replay); stale groups are dropped whole; over a run of steps, every sampled
group is trained or dropped exactly once, and long episodes are not trained less often than short."""
import json

import jax
import numpy as np
import pytest

from cope_jax.rollout import parking
from cope_jax.rollout.episode import PlayedEpisode
from cope_jax.rollout.runner import RolloutConfig, RolloutRunner
from cope_jax.stages.partial import PartialRollouts
from envs.pool import EnvPool
from envs.registry import make_family
from envs.tail import NEVER
from tests.rollout.test_rollout import _runner_parts

FAMILY = make_family("tail")
ROUNDS = 8
TASKS = FAMILY.task_ids("train")
# one short task (2 rounds) and one that runs to the cap, so a run with one group to complete parks the other
SHORT = next(t for t in TASKS if FAMILY.length(t) == 2)
LONG = next(t for t in TASKS if FAMILY.length(t) == NEVER)


@pytest.fixture(scope="module")
def parts():
    return _runner_parts()


@pytest.fixture
def runner(parts):
    chat, sampler = parts
    with EnvPool({"tail": 1}, envs_per_worker=8) as pool:
        yield RolloutRunner(sampler, pool, "tail", FAMILY, chat,
                            RolloutConfig(max_rounds=ROUNDS, max_turn_tokens=4, sync=True))


def _play_first(runner):
    """Group 0 (short) completes and trains; group 1 (long) is parked mid-episode."""
    schedule = [(SHORT, 0), (SHORT, 0), (LONG, 1), (LONG, 1)]
    trajs, _ = runner.run(schedule, jax.random.key(0), episode_ids=range(4), complete_groups=1, version=0)
    assert {t.group_id for t in trajs} == {0} and len(trajs) == 2
    assert {ep.group_id for ep in runner.parked} == {1} and len(runner.parked) == 2
    assert all(0 < len(ep.actions) < ROUNDS and not ep.done for ep in runner.parked)
    return [(list(ep.tokens), list(ep.sampler_logp), list(ep.versions)) for ep in runner.parked]


def _assert_continued(trajs, before):
    """The parked episodes' trajectories start with what they had when parked, bit for bit."""
    assert len(trajs) == 2 and all(t.finish_reason == "max_rounds" for t in trajs)
    for t, (tokens, logp, versions) in zip(trajs, before):
        assert t.tokens[:len(tokens)].tolist() == tokens
        assert np.array_equal(t.sampler_logp[:len(logp)], np.asarray(logp, np.float32))
        assert t.metadata["versions"][:len(versions)] == versions == [0] * len(versions)
        assert t.metadata["versions"][len(versions):] == [1] * (len(t.actions) - len(versions))
        assert len(t.actions) == ROUNDS and t.metadata["replays"] == 0


def test_a_parked_episode_continues_in_the_next_run_with_its_tokens_and_logprobs(runner):
    before = _play_first(runner)
    trajs, stats = runner.run([], jax.random.key(1), complete_groups=0, version=1)
    _assert_continued(trajs, before)
    assert stats.replays == 0 and runner.parked == []
    # each continued episode's context went into the cache again (the cost of parking): the tokens
    # of the two trajectories were prefilled or sampled in this run, all but the closing tokens
    # of each one's last turn (never fed back: the episode ended)
    assert stats.prefill_tokens > sum(len(tokens) for tokens, _, _ in before)
    assert 0 < sum(len(t.tokens) for t in trajs) - stats.generated_tokens - stats.prefill_tokens <= 2 * len(trajs)


def test_a_parked_episode_whose_environment_is_gone_is_caught_up_from_its_checkpoint_form(runner):
    before = _play_first(runner)
    saved = json.loads(json.dumps([parking.episode_state(ep) for ep in runner.parked]))
    runner.release_parked()  # what a restart or an evaluation on the same pool leaves
    runner.parked = [parking.episode_from_state(s) for s in saved]
    trajs, stats = runner.run([], jax.random.key(1), complete_groups=0, version=1)
    _assert_continued(trajs, before)
    assert stats.replays == 0  # the environment replayed the record: nothing played again


def test_an_environment_that_does_not_replay_its_record_plays_the_episode_again(runner):
    _play_first(runner)
    saved = [parking.episode_state(ep) for ep in runner.parked]
    saved[0]["observations"][1] = "Round 41."  # not what the environment will say
    runner.release_parked()
    runner.parked = [parking.episode_from_state(s) for s in saved]
    trajs, stats = runner.run([], jax.random.key(1), complete_groups=0, version=1)
    assert stats.replays == 1
    again, kept = trajs
    assert again.metadata["replays"] == 1 and again.metadata["versions"] == [1] * ROUNDS  # from its reset
    assert kept.metadata["replays"] == 0 and kept.metadata["versions"][0] == 0
    assert "Round 41." not in again.observations


def test_a_stale_group_is_dropped_whole_and_its_environments_freed(runner):
    _play_first(runner)
    pool = runner.pool
    assert parking.stale_groups(runner.parked, 1, max_staleness=1) == []
    assert parking.stale_groups(runner.parked, 2, max_staleness=1) == [1]
    dropped = runner.drop_parked([1])
    assert len(dropped) == 2 and runner.parked == []
    assert pool.poll(timeout=None) == []  # the answers of their steps in flight are dropped
    assert "0/8 instances held" in pool.describe()


def test_staleness_counts_each_token_with_its_turns_version():
    ep = PlayedEpisode(0, 0, 5, versions=[3, 4])
    done = PlayedEpisode(1, 0, 5, versions=[1], done=True)  # a group is as stale as its oldest turn
    assert parking.oldest_version(ep) == 3 and parking.oldest_version(PlayedEpisode(2, 0, 6)) is None
    assert parking.stale_groups([ep, done], 4, max_staleness=2) == [5]
    assert parking.stale_groups([ep, done], 3, max_staleness=2) == []
    s = parking.Staleness()
    s.add([3, 4], [10, 30], version=5)
    assert s.record() == {"staleness_mean": (10 * 2 + 30 * 1) / 40, "staleness_max": 2.0}


class _Tasks:
    """The stage's task iterator: the train tasks in order."""

    def __init__(self):
        self.next = 0

    def take(self, n):
        self.next += n
        return [int(t) for t in TASKS[self.next - n:self.next]]


def _stage(runner, max_staleness=100):
    return PartialRollouts(runner, _Tasks(), group_size=2, tasks_per_step=2, groups_in_flight=4,
                           max_staleness=max_staleness, played_under={"max_rounds": ROUNDS})


def _steps(stage, n):
    """n partial steps, the last draining; -> (trained trajectories, the steps' counts)."""
    trained, counts = [], []
    for i in range(n):
        trajs, _, record = stage.step(i, jax.random.key(i), last=i + 1 == n)
        trained += trajs
        counts.append(record)
    return trained, counts


def test_over_a_run_every_group_is_trained_or_dropped_once_and_long_episodes_are_not_trained_less(runner):
    """Tail lengths (70% end after 1 + Geometric(mean 3) rounds, the rest run to the cap of 8): the
    share of round-capped episodes among the trained ones is their share among the sampled ones.
    Tolerance: none is needed without staleness drops (every group drains by the last step); with
    max_staleness 1 the dropped groups are counted, and the capped share stays within 0.25."""
    stage = _stage(runner)
    trained, counts = _steps(stage, 6)
    started = sum(r["groups_started"] for r in counts)
    groups = [t.group_id for t in trained]
    assert len(set(groups)) == started == stage.next_group and len(groups) == 2 * started  # each once
    assert counts[-1]["parked_groups"] == 0 and not runner.parked
    assert sum(r["stale_groups_dropped"] for r in counts) == 0
    sampled = [min(FAMILY.length(t), ROUNDS) for t in TASKS[:stage.next_group] for _ in range(2)]
    assert sorted(len(t.actions) for t in trained) == sorted(sampled)  # the same lengths, each once
    assert any(r["parked_groups"] for r in counts[:-1])  # and some were parked on the way


def test_with_a_tight_staleness_bound_dropped_groups_are_counted_not_lost(runner):
    stage = _stage(runner, max_staleness=1)
    trained, counts = _steps(stage, 6)
    dropped = sum(r["stale_groups_dropped"] for r in counts)
    assert dropped > 0 and len({t.group_id for t in trained}) + dropped == stage.next_group
    capped = np.mean([len(t.actions) == ROUNDS for t in trained])
    sampled = np.mean([FAMILY.length(t) == NEVER for t in TASKS[:stage.next_group]])
    assert abs(capped - sampled) <= 0.25, (capped, sampled, dropped)


def test_a_restore_under_other_settings_plays_the_parked_episodes_again_from_their_reset(runner):
    stage = _stage(runner)
    stage.step(0, jax.random.key(0), last=False)
    state = json.loads(json.dumps(stage.state()))
    assert state["next_group"] == 4 and state["hosts"][0]
    parked = len(runner.parked)
    runner.release_parked()
    assert stage.restore(state) == 0 and len(runner.parked) == parked  # same settings: continued
    state["played_under"] = {"max_rounds": ROUNDS + 1}
    runner.release_parked()
    assert stage.restore(state) == parked
    assert all(ep.tokens == [] and ep.versions == [] and ep.replays == 0 for ep in runner.parked)
