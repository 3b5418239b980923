"""Groups whose advantages are all zero (`train.zero_variance`): masked out of the policy terms on
the host, or filtered out of a step's batch and refilled by more rollout rounds, up to a cap."""
import dataclasses

import numpy as np
import pytest

from cope_jax.objective import advantages as adv_lib
from cope_jax.batch import batching
from cope_jax.objective import methods
from cope_jax.rollout.trajectory import ForecastExample
from cope_jax.rollout.runner import RolloutStats
from cope_jax.stages import rl
from tests.batch.test_packing import _tokens, _trajectories

# group 0 all succeed, group 1 all fail (no signal), group 2 mixed
SUCCESSES = [(0, 1), (0, 1), (1, 0), (1, 0), (2, 1), (2, 0)]


def test_flat_groups_are_those_without_a_nonzero_advantage():
    a = adv_lib.grpo_advantages([1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 2, 2])
    assert adv_lib.flat_groups(a, [0, 0, 1, 1, 2, 2]) == {0, 1}
    assert adv_lib.flat_groups([0.0, 0.3], [5, 5]) == set()


def _minibatch(zero_variance):
    trajs = _trajectories(SUCCESSES, [9, 14, 7, 11, 20, 6])
    w = adv_lib.forecast_weights([y for _, y in SUCCESSES], [g for g, _ in SUCCESSES])
    exs = [ForecastExample(tokens=_tokens(i, 8), target_mask=[0] * 5 + [1] * 3, weight=w[i], group_id=g,
                           source=i, step=0) for i, (g, y) in enumerate(SUCCESSES) if y]
    cfg = dataclasses.replace(methods.LossConfig(), zero_variance=zero_variance)
    [mb], stats = batching.build_minibatches(trajs, exs, methods.get_method("cope"), cfg, groups_per_minibatch=3,
                                             row_len=16, rows_per_micro=2)
    return mb, stats


def _per_group(mb, term):
    """The term's total weight on each trajectory's tokens, by group (`seq_index`: the sequence's
    place in the mini-batch, the trajectories first and in order)."""
    b = mb.batch
    seq, w = np.asarray(b.seq_index), np.asarray(b.weights[term])
    out = {}
    for i, (g, _) in enumerate(SUCCESSES):
        out[g] = out.get(g, 0.0) + float(w[seq == i].sum())
    return out


def test_mask_takes_flat_groups_out_of_the_policy_terms_only():
    kept, kept_stats = _minibatch("keep")
    masked, stats = _minibatch("mask")
    assert "zero_variance_groups" not in kept_stats and stats["zero_variance_groups"] == 2
    for term in ("pg", "kl", "entropy"):
        before, after = _per_group(kept, term), _per_group(masked, term)
        assert before[0] > 0 and before[1] > 0
        assert after[0] == after[1] == 0.0
        # the normalizer counts only the group with signal: its sequences weigh more than before
        assert after[2] > before[2]
        assert sum(after.values()) == pytest.approx(1.0, rel=1e-5)  # seq-mean-token-mean: sums to one
    # forecasting examples of the all-success group still train
    np.testing.assert_array_equal(np.asarray(masked.batch.weights["af"]), np.asarray(kept.batch.weights["af"]))


class _Tasks:
    """The step's task source: batches of 2 new task ids per take."""

    def __init__(self):
        self.taken = 0

    def take(self):
        self.taken += 1
        return [10 * self.taken, 10 * self.taken + 1]


def _refill(monkeypatch, outcome, rounds_cap, tasks_per_step=2, group_size=2):
    """`rl._refilled` with rollouts stubbed: task t's episodes succeed per `outcome(t)` (a list of
    group_size 0/1). -> (kept trajectories, record, rollout calls)."""
    import ml_collections

    c = ml_collections.ConfigDict(dict(rollout=dict(tasks_per_step=tasks_per_step, group_size=group_size)))
    calls = []

    def fake_rollout(parts, runner, schedule, key, next_schedule=(), on_progress=None):
        calls.append(schedule)
        trajs = _trajectories([(g, y) for (t, g), y in zip(schedule, [y for t, _ in schedule[::group_size]
                                                                     for y in outcome(t)])], [8] * len(schedule))
        for tr, (t, _) in zip(trajs, schedule):
            tr.task_id = t
        return trajs, RolloutStats(wall_s=1.0, env_steps=len(schedule))

    monkeypatch.setattr(rl, "rollout", fake_rollout)
    parts = type("Parts", (), dict(config=c, spec=methods.get_method("grpo"), loss_cfg=methods.LossConfig(),
                                   max_fault_fraction=0.25))()
    played = fake_rollout(parts, None, rl._schedule(c, 0, [1, 2]), None)[0]
    calls.clear()
    kept, stats, record = rl._refilled(parts, None, _Tasks(), 0, __import__("jax").random.key(0), played,
                                       RolloutStats(wall_s=1.0), rounds_cap)
    return kept, stats, record, calls


def test_filter_refills_until_enough_groups_carry_signal(monkeypatch):
    # tasks 1 and 2 (the step's own) have no signal; of the refills every even task does
    kept, stats, record, calls = _refill(monkeypatch, lambda t: [1, 0] if t % 2 == 0 and t >= 10 else [1, 1],
                                         rounds_cap=5)
    assert len(calls) == 2  # round 1 gives one group with signal (task 10), round 2 another (task 20)
    groups = {t.group_id for t in kept}
    assert len(groups) == 2 and {t.task_id for t in kept} == {10, 20}
    assert all(not adv_lib.flat_groups(adv_lib.grpo_advantages(
        [t.success for t in kept if t.group_id == g], [g] * 2), [g] * 2) for g in groups)
    assert record == {"zero_variance_groups": 4.0, "refill_rollouts": 8.0}
    assert stats.wall_s == 3.0 and stats.env_steps == 8  # the rounds ran one after another


def test_filter_stops_at_its_cap_and_never_trains_on_a_flat_group(monkeypatch):
    kept, _, record, calls = _refill(monkeypatch, lambda t: [0, 0], rounds_cap=2)
    assert kept == [] and len(calls) == 2
    assert record == {"zero_variance_groups": 6.0, "refill_rollouts": 8.0}
    kept, _, record, calls = _refill(monkeypatch, lambda t: [1, 1], rounds_cap=0)
    assert kept == [] and calls == [] and record == {"zero_variance_groups": 2.0, "refill_rollouts": 0.0}


def test_filter_keeps_the_configured_number_of_groups(monkeypatch):
    """More groups with signal than tasks_per_step after a round: the first ones are kept."""
    kept, _, record, calls = _refill(monkeypatch, lambda t: [1, 0] if t != 1 else [1, 1], rounds_cap=3)
    assert len(calls) == 1 and len({t.group_id for t in kept}) == 2
    assert {t.task_id for t in kept} == {2, 10}
