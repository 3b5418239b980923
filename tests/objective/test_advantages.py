"""GRPO / ProGPO advantages and the CoPE group weights, against hand-computed values (method §2-4)."""
import numpy as np
import pytest

from cope_jax.objective import advantages as adv


def test_grpo_group_normalization_unbiased_std():
    # group 7: [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3); group 2 (interleaved): all equal
    rewards = [1, 0, 1, 0, 1, 1]
    groups = [7, 7, 2, 7, 2, 7]
    out = adv.grpo_advantages(rewards, groups)
    a = 0.5 / (np.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(out, [a, -a, 0.0, -a, 0.0, a], rtol=1e-6)
    assert out.dtype == np.float32


def test_grpo_group_of_one_gets_its_reward():
    out = adv.grpo_advantages([1.0, 0.0, 1.0, 0.0], [0, 1, 2, 2])
    np.testing.assert_allclose(out, [1.0, 0.0, 0.5 / (np.sqrt(0.5) + 1e-6), -0.5 / (np.sqrt(0.5) + 1e-6)], rtol=1e-6)


def test_first_visit_coverage():
    assert adv.first_visit_coverage(["a", "b", "a", "c"]) == pytest.approx(2 / 3)
    assert adv.first_visit_coverage(["a", "a", "a"]) == 0.0
    assert adv.first_visit_coverage(["a", "b"], num_steps=4) == pytest.approx(1 / 4)
    assert adv.first_visit_coverage(["a"]) == 0.0


def test_progpo_branches():
    # g0 mixed rewards -> GRPO; g1 all-fail with varying P -> fallback; g2 all-fail, equal P -> 0;
    # g3 all success -> 0; g4 single success -> Y (GRPO's group-of-one rule)
    rewards = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    progress = [0.9, 0.1, 0.2, 0.6, 0.5, 0.5, 0.5, 0.5, 0.3, 0.7, 0.4]
    groups = [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    out, stats = adv.progpo_advantages(rewards, progress, groups, scale=0.3)
    np.testing.assert_allclose(out[:2], adv.grpo_advantages([1, 0], [0, 0]), rtol=1e-6)
    lam = 0.3 * 2 / 5  # two of five groups are all-fail
    p = np.array([0.2, 0.6, 0.5])
    np.testing.assert_allclose(out[2:5], lam * (p - p.mean()) / p.std(), rtol=1e-5)
    np.testing.assert_array_equal(out[5:10], 0.0)
    assert out[10] == 1.0
    assert stats["progpo_lambda_eff"] == pytest.approx(lam)
    assert stats["progpo_fallback_trajectories"] == 3


def test_forecast_weights_groups_with_0_1_3_successes():
    success = [0, 0, 0, 1, 0, 0, 1, 1, 1]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    w = adv.forecast_weights(success, groups)
    np.testing.assert_allclose(w, [0, 0, 0, 1, 0, 0, 1 / 3, 1 / 3, 1 / 3], rtol=1e-6)
    assert adv.successful_groups(success, groups) == {1, 2}


def test_bad_input_raises():
    with pytest.raises(ValueError, match="shape"):
        adv.grpo_advantages([1, 0], [0])
    with pytest.raises(ValueError, match="finite"):
        adv.grpo_advantages([np.nan, 0], [0, 0])
    with pytest.raises(ValueError, match="0/1"):
        adv.forecast_weights([0.5, 1], [0, 0])
