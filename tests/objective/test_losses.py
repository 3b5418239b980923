"""Loss terms and aggregation weights against hand-computed values (method §2-4)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cope_jax.objective import losses


def test_sequence_token_weights_all_modes():
    counts = np.array([2, 0, 4], np.float32)  # the empty sequence is not counted in G
    expected = {
        "token-mean": [1 / 6, 0, 1 / 6],
        "seq-mean-token-mean": [1 / 4, 0, 1 / 8],
        "seq-mean-token-sum": [1 / 2, 0, 1 / 2],
        "seq-mean-token-sum-norm": [1 / 20, 0, 1 / 20],
    }
    for mode, want in expected.items():
        host = losses.sequence_token_weights(counts, mode, norm_length=10)
        dev = losses.sequence_token_weights(jnp.asarray(counts), mode, norm_length=10)
        assert isinstance(host, np.ndarray)
        np.testing.assert_allclose(host, want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dev), want, rtol=1e-6)
    with pytest.raises(ValueError, match="norm_length"):
        losses.sequence_token_weights(counts, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        losses.sequence_token_weights(counts, "mean")


def test_weighted_sums_match_literal_aggregation_formulas():
    rng = np.random.RandomState(0)
    values = rng.randn(3, 7).astype(np.float32)
    seq = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3], [3, 3, 4, 4, 4, 4, 4]])
    mask = rng.rand(3, 7) < 0.7
    mask[seq == 1] = False  # a sequence without loss tokens
    per_seq = [(values[(seq == i) & mask]) for i in range(5)]
    nonempty = [v for v in per_seq if len(v)]
    G = len(nonempty)
    literal = {
        "token-mean": sum(v.sum() for v in nonempty) / sum(len(v) for v in nonempty),
        "seq-mean-token-mean": sum(v.mean() for v in nonempty) / G,
        "seq-mean-token-sum": sum(v.sum() for v in nonempty) / G,
        "seq-mean-token-sum-norm": sum(v.sum() for v in nonempty) / (G * 16),
    }
    counts = np.array([((seq == i) & mask).sum() for i in range(5)])
    for mode, want in literal.items():
        w = losses.sequence_token_weights(counts, mode, norm_length=16)[seq] * mask  # per token
        np.testing.assert_allclose(float(np.sum(w * values)), want, rtol=1e-5)


def test_forecast_token_weights():
    w = np.array([1.0, 1 / 3, 0.0], np.float32)
    counts = np.array([4, 2, 5], np.float32)
    np.testing.assert_allclose(losses.forecast_token_weights(w, counts, 2, "success_groups"),
                               [1 / 8, 1 / 12, 0], rtol=1e-6)
    np.testing.assert_allclose(losses.forecast_token_weights(w, counts, 4, "paper_exact"),
                               [1 / 4, 1 / 12, 0], rtol=1e-6)


def _pg(logp, old, adv, **kw):
    logp, old, adv = (jnp.asarray(x, jnp.float32) for x in (logp, old, adv))
    w = jnp.ones_like(logp)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: losses.clipped_policy_loss(lp, old, adv, w, **kw), has_aux=True)(logp)
    return float(loss), metrics, np.asarray(grad)


def test_clipped_token_contributes_zero_gradient():
    r_hi, r_lo, r_in = 1.5, 0.5, 1.1
    old = np.zeros(4)
    logp = np.log([r_hi, r_lo, r_in, r_in])
    adv = np.array([2.0, -1.0, 2.0, -1.0])
    loss, metrics, grad = _pg(logp, old, adv)
    # A>0 above 1+eps and A<0 below 1-eps are clipped (constant); the others are -A r
    np.testing.assert_allclose(grad, [0.0, 0.0, -2.0 * r_in, 1.0 * r_in], rtol=1e-6)
    np.testing.assert_allclose(loss, -2 * 1.2 + 1 * 0.8 - 2 * r_in + r_in, rtol=1e-6)
    assert float(metrics["pg_clipped"]) == 2 and float(metrics["pg_tokens"]) == 4


def test_pessimistic_side_is_not_clipped():
    # A>0 with r far below 1-eps keeps the unclipped -A r (max picks it) and its gradient
    loss, _, grad = _pg(np.log([0.3]), [0.0], [1.0])
    np.testing.assert_allclose(loss, -0.3, rtol=1e-6)
    np.testing.assert_allclose(grad, [-0.3], rtol=1e-6)


def test_dual_clip_caps_the_loss():
    logp = np.log([10.0, 2.0])
    adv = np.array([-1.0, -1.0])
    loss, metrics, grad = _pg(logp, [0.0, 0.0], adv, dual_clip=3.0)
    # r=10: max(-A r, -A clip) = 10 -> capped at -A c = 3 with zero gradient; r=2 stays 2
    np.testing.assert_allclose(loss, 3.0 + 2.0, rtol=1e-6)
    np.testing.assert_allclose(grad, [0.0, 2.0], rtol=1e-6)
    assert float(metrics["pg_clipped_dual"]) == 1
    no_dual, _, _ = _pg(logp, [0.0, 0.0], adv)
    np.testing.assert_allclose(no_dual, 12.0, rtol=1e-6)


def test_low_var_kl_values_and_clamp():
    logp = jnp.array([-1.0, -2.0, -30.0])
    ref = jnp.array([-1.0, -1.5, -1.0])
    w = jnp.array([1.0, 2.0, 1.0])
    loss, _ = losses.low_var_kl(logp, ref, w)
    k = 0.5
    np.testing.assert_allclose(float(loss), 0.0 + 2 * (np.exp(k) - k - 1) + 10.0, rtol=1e-6)


def test_entropy_and_nll_are_weighted_sums():
    ent, m = losses.entropy_bonus(jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.0, 0.25]))
    assert float(ent) == pytest.approx(1.25)
    nll, m = losses.weighted_nll(jnp.array([-1.0, -2.0, -3.0]), jnp.array([0.5, 0.0, 0.25]), "af")
    assert float(nll) == pytest.approx(1.25)
    assert float(m["af_tokens"]) == 2


def test_finalize_metrics_forms_ratios_once():
    sums = {"pg_clipped": jnp.array(3.0), "pg_tokens": jnp.array(12.0), "ppo_kl_sum": jnp.array(0.6),
            "pg_clipped_dual": jnp.array(0.0), "loss": jnp.array(1.0)}
    out = losses.finalize_metrics(sums)
    assert float(out["pg_clip_frac"]) == pytest.approx(0.25)
    assert float(out["ppo_kl"]) == pytest.approx(0.05)
    assert "pg_clipped" not in out and float(out["loss"]) == 1.0
