"""Rollout correction (`train.rollout_correction`): token-level truncated (TIS) and masked (MIS)
importance weights for the sampler / trainer mismatch, on a hand-built batch and through the
train step on tokens a real sampler drew."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cope_jax.batch import batching
from cope_jax.objective import losses, methods
from cope_jax.train import train_step
from models import qwen
from tests.train.test_sampler_drift import _sampled
from tests.train.test_train_step import CFG


def test_mis_masks_exactly_the_tokens_outside_its_band_and_tis_caps_them():
    """w = exp(old - sampler) of 8 hand-picked tokens, two of them padding (weight 0)."""
    w = np.array([[0.3, 0.5, 0.9, 1.0, 1.9, 2.0, 2.5, 9.0]], np.float32)
    sampler = np.full_like(w, -1.5)
    old = sampler + np.log(w)
    weight = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], np.float32) * 0.25
    factor, m = losses.rollout_correction(old, sampler, weight, mode="mis", low=0.5, high=2.0)
    np.testing.assert_array_equal(np.asarray(factor), [[0, 1, 1, 1, 1, 1, 0, 0]])
    assert float(m["rollout_corrected"]) == 2  # 0.3 and 2.5; the padding token 9.0 is not counted
    np.testing.assert_allclose(float(m["rollout_is_sum"]), w[0, :7].sum(), rtol=1e-5)
    factor, m = losses.rollout_correction(old, sampler, weight, mode="tis", low=0.5, high=2.0)
    np.testing.assert_allclose(np.asarray(factor), np.minimum(w, 2.0), rtol=1e-5)
    assert float(m["rollout_corrected"]) == 1  # 2.5 (2.0 itself is not capped)
    factor, m = losses.rollout_correction(old, sampler, weight, mode="none", low=0.5, high=2.0)
    assert np.all(np.asarray(factor) == 1) and float(m["rollout_corrected"]) == 0
    with pytest.raises(ValueError, match="unknown rollout correction"):
        losses.rollout_correction(old, sampler, weight, mode="is", low=0.5, high=2.0)


def _minibatch(trainer_temperature):
    """A GRPO mini-batch of a real sampler's tokens (drawn at temperature 0.7), its old log-probs
    filled by the trainer at `trainer_temperature`: at 0.7 the two differ only numerically, at 1.0
    by a real mismatch."""
    model = qwen.create_model(CFG, seed=1)
    trajs = _sampled(model, 0.7)
    base = dataclasses.replace(methods.LossConfig(), temperature=trainer_temperature, kl_coef=0.0)
    [mb], _ = batching.build_minibatches(trajs, [], methods.get_method("grpo"), base, groups_per_minibatch=2,
                                         row_len=64, rows_per_micro=2)
    batch = train_step.Learner(model, base, optax.sgd(0.0)).fill_logprobs(mb.batch)
    return model, base, batch


@pytest.fixture(scope="module")
def drifted():
    return _minibatch(1.0)


def _loss_and_grads(model, batch, cfg):
    loss, grads, sums = train_step.loss_and_grads(model, batch, cfg.device_part(), cfg.coefficients(batch.weights))
    return float(loss), jax.tree.leaves(grads), {k: float(v) for k, v in losses.finalize_metrics(sums).items()}


def test_tis_with_a_cap_no_weight_reaches_is_plain_importance_weighting(drifted):
    """Where the sampler and the trainer agree (numeric drift only), TIS with cap 1e9 changes
    nothing; under a real mismatch it weighs each token by its whole w = exp(old - sampler), the
    same loss and gradients as the uncorrected step on weights multiplied by w by hand."""
    model, base, batch = _minibatch(0.7)
    capped = dataclasses.replace(base, rollout_correction="tis", rollout_correction_high=1e9)
    loss, grads, metrics = _loss_and_grads(model, batch, base)
    loss_tis, grads_tis, metrics_tis = _loss_and_grads(model, batch, capped)
    assert "rollout_corrected_frac" not in metrics  # off: the step record is as before
    assert metrics_tis["rollout_corrected_frac"] == 0.0
    assert metrics_tis["rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert loss_tis == pytest.approx(loss, rel=1e-4)
    for a, b in zip(grads_tis, grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-7)

    model, base, batch = drifted
    w = jnp.exp(batch.old_logp - batch.sampler_logp)
    by_hand = batch.replace(weights=dict(batch.weights, pg=batch.weights["pg"] * w))
    loss, grads, _ = _loss_and_grads(model, by_hand, base)
    loss_tis, grads_tis, metrics_tis = _loss_and_grads(model, batch, dataclasses.replace(capped, temperature=1.0))
    assert metrics_tis["rollout_is_mean"] != pytest.approx(1.0, abs=1e-3)  # the mismatch is real
    assert loss_tis == pytest.approx(loss, rel=1e-5)
    for a, b in zip(grads_tis, grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-8)


def test_a_tight_band_changes_the_update_and_reports_what_it_touched(drifted):
    """Capped at 1, every token whose weight exceeds it is corrected; masked to [0.999, 1.001],
    nearly all are: each reported as a share of the sampled tokens, the loss moved."""
    model, base, batch = drifted
    loss, _, _ = _loss_and_grads(model, batch, base)
    w = np.exp(np.asarray(batch.old_logp) - np.asarray(batch.sampler_logp))
    sampled = np.asarray(batch.weights["pg"]) > 0
    tis = dataclasses.replace(base, rollout_correction="tis", rollout_correction_high=1.0)
    loss_tis, _, metrics = _loss_and_grads(model, batch, tis)
    assert metrics["rollout_corrected_frac"] == pytest.approx((w[sampled] > 1.0).mean(), abs=1e-6)
    assert loss_tis != pytest.approx(loss, rel=1e-4)
    mis = dataclasses.replace(base, rollout_correction="mis", rollout_correction_low=0.999,
                              rollout_correction_high=1.001)
    _, _, metrics = _loss_and_grads(model, batch, mis)
    outside = (w[sampled] < 0.999) | (w[sampled] > 1.001)
    assert outside.mean() > 0.5
    assert metrics["rollout_corrected_frac"] == pytest.approx(outside.mean(), abs=1e-6)


def test_a_band_without_one_is_refused():
    with pytest.raises(ValueError, match="must hold 1"):
        methods.LossConfig(rollout_correction="mis", rollout_correction_low=1.2, rollout_correction_high=2.0)
