"""Loss terms of GRPO, CoPE and the baselines (method §2-4): pure functions on per-token arrays.

Exact aggregation by weights. Every term is a weighted sum over tokens, `sum_t w_t * l_t`, where the
per-token weight `w_t` already contains the whole normalization (the aggregation mode's 1/T_i and
1/G, the forecasting group normalization, ...). The weights are computed once per mini-batch from
token counts of the *whole* mini-batch (`sequence_token_weights`, `forecast_token_weights`), so
a term's value over a mini-batch is the plain sum of its values over any split of the tokens into
packed rows and micro-batches, and so are its gradients: gradient accumulation is exact, and a
trajectory contributes the same whatever it is packed next to.

Each term returns `(loss, metrics)`. Metrics are *additive* (sums and counts), so they can be summed
over micro-batches; `finalize_metrics` forms the ratios at the end (table `RATIOS`).

Token coordinates: all arrays are indexed by the predicted token (logp[t] = log p(token_t | tokens
before t)); shapes are any common shape, typically [rows, L].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios before exp so one wild token cannot overflow
KL_CLAMP = 10.0
FORECAST_NORMALIZATIONS = ("success_groups", "paper_exact")


def _xp(a):
    return np if isinstance(a, (np.ndarray, np.generic, list, tuple, float, int)) else jnp


# -- aggregation ------------------------------------------------------------------------------------
def sequence_token_weights(counts, mode: str, norm_length: float | None = None):
    """Per-token weight of each sequence's tokens under an aggregation mode.

    counts [S]: loss tokens of each sequence in the mini-batch (numpy on the host or jax).
    Returns [S] float32 such that `aggregate = sum_i w_i * sum_{t in i} l_t`:
      token-mean               w_i = 1 / sum_j T_j                 (every token equal)
      seq-mean-token-mean      w_i = 1 / (G * T_i)                 (the paper's 1/G sum_i 1/T_i sum_t)
      seq-mean-token-sum       w_i = 1 / G
      seq-mean-token-sum-norm  w_i = 1 / (G * norm_length)         (Dr. GRPO: a constant horizon)
    G counts the sequences with at least one loss token; empty sequences get weight 0.
    """
    xp = _xp(counts)
    counts = xp.asarray(counts, xp.float32)
    nonempty = (counts > 0).astype(xp.float32)
    n_seq = xp.maximum(nonempty.sum(), 1.0)
    if mode == "token-mean":
        w = nonempty / xp.maximum(counts.sum(), 1.0)
    elif mode == "seq-mean-token-mean":
        w = nonempty / (n_seq * xp.maximum(counts, 1.0))
    elif mode == "seq-mean-token-sum":
        w = nonempty / n_seq
    elif mode == "seq-mean-token-sum-norm":
        if not norm_length or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (e.g. the max response length)")
        w = nonempty / (n_seq * float(norm_length))
    else:
        raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")
    return w.astype(xp.float32)


def forecast_token_weights(example_weight, target_counts, num_groups: int,
                           normalization: str = "success_groups"):
    """Per-token weight of each forecasting example's target tokens (method §3).

    example_weight [X]: 1 / max(1, |S_x|) of the source group. target_counts [X]: target tokens.
      success_groups (default): L_AF = sum_ex w * (mean target-token CE) / num_groups, with
                                num_groups = groups of the batch with at least one success;
      paper_exact (eq. 5):      L_AF = sum_ex w * (summed target-token CE) / num_groups, with
                                num_groups = all groups of the batch.
    """
    xp = _xp(example_weight)
    w = xp.asarray(example_weight, xp.float32)
    counts = xp.asarray(target_counts, xp.float32)
    groups = float(max(num_groups, 1))
    if normalization == "success_groups":
        out = w * (counts > 0) / (xp.maximum(counts, 1.0) * groups)
    elif normalization == "paper_exact":
        out = w * (counts > 0) / groups
    else:
        raise ValueError(f"unknown forecast normalization {normalization!r}; "
                         f"expected one of {FORECAST_NORMALIZATIONS}")
    return out.astype(xp.float32)


# -- terms ------------------------------------------------------------------------------------------
def clipped_policy_loss(logp, old_logp, advantage, weight, *, clip_low: float = 0.2,
                        clip_high: float = 0.2, dual_clip: float | None = None):
    """GRPO/PPO clipped surrogate (method §2), verl semantics.

    r = exp(clip(logp - old_logp, -20, 20));
    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    dual clip (A < 0 only): l = min(l, -A * dual_clip).
    loss = sum(weight * l). Metrics: pg_clipped (tokens where the clipped branch is active),
    pg_clipped_dual, pg_tokens (weight > 0), ppo_kl_sum (sum of old_logp - logp).
    """
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantage * ratio
    clipped = -advantage * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    active = (weight > 0).astype(jnp.float32)
    clipped_frac = (clipped > unclipped).astype(jnp.float32) * active
    dual_frac = jnp.zeros_like(active)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantage * dual_clip
        dual_frac = ((per_token > cap) & (advantage < 0)).astype(jnp.float32) * active
        per_token = jnp.where(advantage < 0, jnp.minimum(per_token, cap), per_token)
    loss = jnp.sum(weight * per_token)
    return loss, {"pg_loss": loss, "pg_clipped": jnp.sum(clipped_frac), "pg_clipped_dual": jnp.sum(dual_frac),
                  "pg_tokens": jnp.sum(active), "ppo_kl_sum": jnp.sum(-log_ratio * active)}


def low_var_kl(logp, ref_logp, weight):
    """k3 estimator of KL(pi || ref) (method §2): k = ref - logp, exp(k) - k - 1, clamped to [-10, 10].

    k itself is clamped to [-20, 20] first (verl), so exp cannot overflow.
    """
    k = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = jnp.clip(jnp.exp(k) - k - 1.0, -KL_CLAMP, KL_CLAMP)
    loss = jnp.sum(weight * kl)
    return loss, {"kl": loss}


def entropy_bonus(entropy, weight):
    """Aggregated entropy (positive); the objective subtracts `entropy_coef` times it (method §2)."""
    value = jnp.sum(weight * entropy)
    return value, {"entropy": value}


def weighted_nll(logp, weight, name: str):
    """Cross-entropy of target tokens, `-sum(weight * logp)`: forecasting (AF), success-filtered
    imitation, RFT and ECHO differ only in which tokens carry weight and how much."""
    loss = -jnp.sum(weight * logp)
    return loss, {f"{name}_loss": loss, f"{name}_tokens": jnp.sum((weight > 0).astype(jnp.float32))}


# -- rollout correction -----------------------------------------------------------------------------
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def rollout_correction(old_logp, sampler_logp, weight, *, mode: str, low: float, high: float):
    """Token-level importance correction for the sampler / trainer mismatch: the sampler drew each
    token under its own log-prob (`sampler_logp`, bf16, other kernels), the objective scores it
    under `old_logp`, so w = exp(old_logp - sampler_logp) [rows, L] reweighs it (stop-gradient).

    mode 'tis' (truncated IS): factor min(w, high); 'mis' (masked IS): factor 1 where
    low <= w <= high, else 0 (the token drops out); 'none': 1.
    -> (factor [rows, L] float32, metrics): `rollout_corrected`, the tokens (weight > 0) capped or
    masked, and `rollout_is_sum`, the sum of their w (its mean over the sampled tokens is ~1 when
    the two agree).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; expected one of {ROLLOUT_CORRECTIONS}")
    sampled = weight > 0
    w = jax.lax.stop_gradient(jnp.exp(jnp.clip(old_logp - sampler_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
    if mode == "tis":
        factor, corrected = jnp.minimum(w, high), w > high
    elif mode == "mis":
        kept = (w >= low) & (w <= high)
        factor, corrected = kept.astype(jnp.float32), ~kept
    else:
        factor, corrected = jnp.ones_like(w), jnp.zeros_like(sampled)
    return factor, {"rollout_corrected": jnp.sum((corrected & sampled).astype(jnp.float32)),
                    "rollout_is_sum": jnp.sum(jnp.where(sampled, w, 0.0))}


# -- metrics ----------------------------------------------------------------------------------------
RATIOS = {  # finished metric -> (numerator, denominator) of additive sums
    "pg_clip_frac": ("pg_clipped", "pg_tokens"),
    "pg_clip_frac_dual": ("pg_clipped_dual", "pg_tokens"),
    "ppo_kl": ("ppo_kl_sum", "pg_tokens"),
    "sampler_drift_mean": ("sampler_drift_sum", "sampler_drift_tokens"),
    "rollout_corrected_frac": ("rollout_corrected", "sampler_drift_tokens"),
    "rollout_is_mean": ("rollout_is_sum", "sampler_drift_tokens"),
}
_PARTS = {"pg_clipped", "pg_clipped_dual", "ppo_kl_sum", "sampler_drift_sum", "sampler_drift_tokens",
          "rollout_corrected", "rollout_is_sum"}


def accumulate_metrics(sums: dict, metrics: dict) -> dict:
    """Metrics of one more micro-batch added to the running ones: `*_max` by maximum, the rest
    (additive sums and counts) by sum."""
    return {k: jnp.maximum(v, metrics[k]) if k.endswith("_max") else v + metrics[k] for k, v in sums.items()}


def finalize_metrics(sums: dict) -> dict:
    """Additive metric sums (over micro-batches) -> reported metrics, ratios formed once."""
    out = {k: v for k, v in sums.items() if k not in _PARTS}
    for name, (num, den) in RATIOS.items():
        if num in sums and den in sums:
            out[name] = sums[num] / jnp.maximum(sums[den], 1.0)
    return out
