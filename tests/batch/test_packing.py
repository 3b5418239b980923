"""Packing, truncation, the data records and mini-batch assembly (host side, numpy only)."""
import dataclasses

import numpy as np
import pytest

from cope_jax.batch import batching, packing, segments
from cope_jax.objective import methods
from cope_jax.objective.advantages import forecast_weights
from cope_jax.rollout.trajectory import ForecastExample, Trajectory


def _tokens(seed, n):
    """Random data from the caller's seed, never a module-wide generator: under xdist its draws
    would depend on which tests ran before on the same worker."""
    return np.random.RandomState(seed).randint(1, 50, n)


def _segment(n, index):
    rng = np.random.RandomState(100 * n + index)
    return packing.Segment(tokens=rng.randint(1, 100, n), seq_index=index, action_mask=rng.rand(n) < 0.5,
                           old_logp=rng.randn(n), advantage=rng.randn(n), weights={"pg": rng.rand(n)})


def test_first_fit_decreasing():
    assert packing.first_fit_decreasing([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert packing.first_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="longer than the row length"):
        packing.first_fit_decreasing([3, 9], 8)


def test_pack_round_trips_every_segment():
    segs = [_segment(n, i) for i, n in enumerate([7, 3, 9, 2, 5, 6])]
    batch, stats = packing.pack(segs, 10, terms=("pg",), rows_multiple=4)
    assert batch.shape == (4, 10) and stats.rows == 4 and stats.tokens == 32
    seen = set()
    for r in range(4):
        for s in set(batch.segment_ids[r]) - {0}:
            cols = np.where(batch.segment_ids[r] == s)[0]
            assert np.all(np.diff(cols) == 1)  # contiguous
            i = int(batch.seq_index[r, cols[0]])
            assert np.all(batch.seq_index[r, cols] == i)
            seg = segs[i]
            np.testing.assert_array_equal(batch.positions[r, cols], np.arange(len(seg)))
            for name in ("tokens", "action_mask", "old_logp", "advantage"):
                np.testing.assert_array_equal(getattr(batch, name)[r, cols], getattr(seg, name))
            np.testing.assert_array_equal(batch.weights["pg"][r, cols], seg.weights["pg"])
            seen.add(i)
    assert seen == set(range(6))
    pad = batch.segment_ids == 0
    assert np.all(batch.seq_index[pad] == -1) and np.all(batch.weights["pg"][pad] == 0)


def test_truncation_is_left_and_recorded():
    seg = _segment(12, 0)
    cut = packing.truncate_left(seg, 8)
    assert cut.truncated == 4 and len(cut) == 8
    np.testing.assert_array_equal(cut.tokens, seg.tokens[4:])
    np.testing.assert_array_equal(cut.old_logp, seg.old_logp[4:])
    assert packing.truncate_left(seg, 12) is seg
    np.testing.assert_array_equal(cut.weights["pg"], seg.weights["pg"][4:])
    _, stats = packing.pack([cut, _segment(3, 1)], 8, terms=("pg",))
    assert stats.truncated_sequences == 1 and stats.truncated_tokens == 4
    with pytest.raises(ValueError, match="truncate_left"):
        packing.pack([seg], 8, terms=("pg",))
    with pytest.raises(ValueError, match="outside the packed terms"):
        packing.pack([cut], 8, terms=("kl",))


def _example(source, prefix, branch, n_target=2):
    tokens = np.r_[prefix, branch]
    mask = np.r_[np.zeros(len(tokens) - n_target), np.ones(n_target)]
    return ForecastExample(tokens=tokens, target_mask=mask, weight=0.5, group_id=source, source=source, step=0,
                           prefix_len=len(prefix))


def test_forecasting_examples_of_one_episode_share_their_history():
    rng = np.random.RandomState(1)
    history, other = rng.randint(1, 100, 30), rng.randint(1, 100, 20)
    exs = [_example(0, history[:20], [7, 8, 9, 10]), _example(1, other[:12], [5, 6, 7]),
           _example(0, history[:12], [1, 2, 3]), _example(0, history[:28], [4, 5, 6, 7, 8])]
    # by prefix length, while the longest prefix + all branches fit: 20 + 3 + 4 = 27, then 28 + 5
    assert segments.forecast_bundles(exs, 32) == [[2, 0], [3], [1]]
    assert segments.forecast_bundles(exs, 40) == [[2, 0, 3], [1]]
    unshared = [dataclasses.replace(e, prefix_len=0) for e in exs]  # nothing shared: each alone
    assert segments.forecast_bundles(unshared, 40) == [[0], [2], [3], [1]]
    cfg = methods.LossConfig(af_normalization="paper_exact")
    segs = batching.example_segments(exs, 2, ("af",), cfg, 40)
    tree = segs[0]
    # one trunk (the longest history), then each example's continuation at its own positions
    np.testing.assert_array_equal(tree.tokens, np.r_[history[:28], [1, 2, 3], [7, 8, 9, 10], [4, 5, 6, 7, 8]])
    np.testing.assert_array_equal(tree.branch_ids, np.r_[[0] * 28, [1] * 3, [2] * 4, [3] * 5])
    np.testing.assert_array_equal(tree.positions, np.r_[np.arange(28), 12 + np.arange(3), 20 + np.arange(4),
                                                         28 + np.arange(5)])
    assert tree.target_mask.sum() == 6 and not tree.target_mask[:28].any()
    # the same per-example weights as if each example were packed alone
    flat = [batching.example_segments([e], 2, ("af",), cfg, 40)[0] for e in exs]
    assert tree.weights["af"].sum() == pytest.approx(sum(f.weights["af"].sum() for i, f in enumerate(flat) if i != 1))
    np.testing.assert_array_equal(segs[1].tokens, exs[1].tokens)  # alone: a plain sequence
    assert not segs[1].branch_ids.any()
    batch, stats = packing.pack(segs, 40, terms=("af",))
    assert stats.tokens == 28 + 12 + 15 and stats.rows == 2
    with pytest.raises(ValueError, match="built to fit"):
        packing.truncate_left(tree, 30)
    bad = exs[:3] + [_example(0, np.r_[history[:10], [99] * 18], [4, 5, 6])]
    with pytest.raises(ValueError, match="does not continue the history"):
        batching.example_segments(bad, 2, ("af",), cfg, 40)
    with pytest.raises(ValueError, match="shared prefix"):
        ForecastExample(tokens=np.arange(6), target_mask=[0, 0, 0, 1, 1, 0], weight=1, group_id=0, source=0,
                        step=0, prefix_len=3)
    # with its trajectory's own row as the trunk: the examples that fit hang on it, the rest share a copy
    traj = packing.Segment(tokens=history, seq_index=0, weights={"pg": np.full(30, 0.1)})
    segs = batching.example_segments(exs, 2, ("af",), cfg, 40, first_index=1, trunks={0: traj})
    assert len(traj) == 30 + 3 + 4 and traj.branch_ids.max() == 2  # prefixes 12 and 20 fit, 28 + 5 did not
    np.testing.assert_array_equal(traj.tokens[30:], [1, 2, 3, 7, 8, 9, 10])
    assert traj.weights["pg"][30:].sum() == 0 and traj.weights["af"][:30].sum() == 0
    assert [len(s) for s in segs] == [len(exs[3]), len(exs[1])] and [s.seq_index for s in segs] == [1, 2]
    total = traj.weights["af"].sum() + sum(s.weights["af"].sum() for s in segs)
    assert total == pytest.approx(sum(f.weights["af"].sum() for f in flat))


def test_split_and_pad_micro():
    batch, _ = packing.pack([_segment(n, i) for i, n in enumerate([6, 6, 6])], 8, terms=("pg",), rows_multiple=2)
    micro = packing.split_micro(batch, 2)
    assert micro.shape == (2, 2, 8) and micro.num_micro == 2
    np.testing.assert_array_equal(micro.micro(1).tokens, batch.tokens[2:])
    padded = packing.pad_micro(micro, 3)
    assert padded.shape == (3, 2, 8)
    assert np.all(padded.segment_ids[2] == 0) and np.all(padded.seq_index[2] == -1)
    with pytest.raises(ValueError, match="rows_multiple"):
        packing.split_micro(batch, 3)


def test_records_validate_their_arrays():
    with pytest.raises(ValueError, match="shape"):
        packing.Segment(tokens=[1, 2, 3], seq_index=0, action_mask=[1, 0])
    with pytest.raises(ValueError, match="both an action and an observation"):
        Trajectory(tokens=[1, 2], action_mask=[1, 0], obs_mask=[1, 0])
    with pytest.raises(ValueError, match="span"):
        Trajectory(tokens=[1, 2], action_mask=[0, 1], obs_mask=[0, 0], action_spans=[[1, 3]])
    with pytest.raises(ValueError, match="weight"):
        ForecastExample(tokens=[1, 2], target_mask=[0, 1], weight=-1.0, group_id=0, source=0, step=0)
    t = Trajectory(tokens=[1, 2, 3], action_mask=[0, 1, 1], obs_mask=[1, 0, 0], action_spans=[[1, 3]])
    assert t.tokens.dtype == np.int32 and t.action_mask.dtype == bool and t.num_steps == 1


def _trajectories(successes, lengths, acting=None):
    """Random trajectories; each has an action token after its first (it carries policy loss) unless
    `acting[i]` is False, where it has none."""
    rng = np.random.RandomState(sum(lengths))
    out = []
    for i, (g, y) in enumerate(successes):
        n = lengths[i]
        kind = rng.randint(0, 3, n)
        kind[0] = 0
        if acting is None or acting[i]:
            kind[-1] = 1
        else:
            kind[kind == 1] = 2
        out.append(Trajectory(tokens=rng.randint(1, 50, n), action_mask=kind == 1, obs_mask=kind == 2,
                              success=y, group_id=g))
    return out


def test_minibatch_weights_are_normalized_over_the_whole_minibatch():
    successes = [(0, 1), (0, 0), (1, 0), (1, 0), (2, 1), (2, 1)]
    trajs = _trajectories(successes, [9, 14, 7, 11, 20, 6])
    w = forecast_weights([y for _, y in successes], [g for g, _ in successes])
    exs = [ForecastExample(tokens=_tokens(i, 8), target_mask=[0] * 5 + [1] * 3, weight=w[i],
                           group_id=g, source=i, step=0) for i, (g, y) in enumerate(successes) if y]
    cfg = methods.LossConfig()
    mbs, stats = batching.build_minibatches(trajs, exs, methods.get_method("cope"), cfg,
                                            groups_per_minibatch=3, row_len=16, rows_per_micro=2)
    assert len(mbs) == 1 and mbs[0].terms == ("pg", "kl", "entropy", "af")
    b = mbs[0].batch
    assert b.tokens.ndim == 3 and b.shape[1] == 2
    # the 20-token trajectory was cut to 16 from the left
    assert mbs[0].stats.truncated_tokens == 4 and stats["truncated_tokens"] == 4
    assert stats["success_group_frac"] == pytest.approx(2 / 3)  # groups 0 and 2 of 3 have a success
    # seq-mean-token-mean: each trajectory's weights sum to 1/G, all of them to 1
    assert b.weights["pg"].sum() == pytest.approx(1.0, rel=1e-6)
    for i in range(6):
        assert b.weights["pg"][b.seq_index == i].sum() == pytest.approx(1 / 6, rel=1e-5)
    # af: sum over examples of w_ex / (groups with a success = 2)
    assert b.weights["af"].sum() == pytest.approx(sum(e.weight for e in exs) / 2, rel=1e-6)
    # advantage only on action tokens; the first token of a segment carries no loss
    assert np.all(b.advantage[~b.action_mask] == 0)
    starts = (b.positions == 0) & (b.segment_ids > 0)
    assert np.all(b.weights["pg"][starts] == 0) and np.all(b.weights["af"][starts] == 0)


def test_a_trajectory_without_actions_leaves_the_mean_to_the_others():
    successes = [(0, 1), (0, 0), (1, 0), (1, 1)]
    trajs = _trajectories(successes, [9, 12, 7, 10], acting=[True, False, True, True])
    mbs, _ = batching.build_minibatches(trajs, [], methods.get_method("grpo"), methods.LossConfig(),
                                        groups_per_minibatch=2, row_len=16, rows_per_micro=2)
    b = mbs[0].batch
    assert b.weights["pg"][b.seq_index == 1].sum() == 0
    for i in (0, 2, 3):
        assert b.weights["pg"][b.seq_index == i].sum() == pytest.approx(1 / 3, rel=1e-5)


def test_sequential_af_mode_and_rft_selection():
    successes = [(0, 1), (0, 0), (1, 1), (1, 1)]
    trajs = _trajectories(successes, [10, 10, 10, 10])
    exs = [ForecastExample(tokens=_tokens(0, 6), target_mask=[0, 0, 0, 1, 1, 1], weight=1.0,
                           group_id=0, source=0, step=0)]
    seq = methods.LossConfig(af_mode="sequential")
    mbs, _ = batching.build_minibatches(trajs, exs, methods.get_method("cope"), seq,
                                        groups_per_minibatch=1, row_len=16, rows_per_micro=1)
    assert [m.terms for m in mbs] == [("pg", "kl", "entropy")] * 2 + [("af",)]
    assert mbs[0].num_examples == 0 and mbs[2].num_examples == 1 and mbs[2].num_trajectories == 0
    assert "af" not in mbs[0].batch.weights and mbs[2].batch.weights["af"].sum() > 0
    rft, _ = batching.build_minibatches(trajs, [], methods.get_method("rft"), methods.LossConfig(),
                                        groups_per_minibatch=2, row_len=16, rows_per_micro=1)
    assert rft[0].num_trajectories == 3 and rft[0].terms == ("rft",)
    assert set(rft[0].batch.weights) == {"rft"} and rft[0].batch.weights["rft"].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no active forecasting term"):
        batching.build_minibatches(trajs, exs, methods.get_method("grpo"), seq, groups_per_minibatch=1,
                                   row_len=16, rows_per_micro=1)


def test_method_table():
    assert set(methods.METHODS) == {"grpo", "cope", "cope_k0", "sft_success", "echo", "rft", "progpo",
                                    "cope+progpo", "warmstart"}
    assert methods.get_method("cope_k0").horizon == 0 and methods.get_method("cope").horizon == 2
    assert methods.get_method("cope", horizon=4).horizon == 4
    assert methods.get_method("sft_success").forecast_kind == "sft"
    with pytest.raises(ValueError, match="unknown method"):
        methods.get_method("ppo")
    with pytest.raises(ValueError, match="advantage"):
        methods.MethodSpec("bad", ("kl",), advantage="grpo")
