"""Trajectory-level advantages and group statistics (method §2-4). Pure numpy, host side.

Every function takes flat per-trajectory arrays plus `group_ids` (the rollout group of each
trajectory; groups need not be contiguous) and returns per-trajectory float32 values.

- `grpo_advantages`: A_i = (Y_i - mean_g) / (std_g + 1e-6), std_g unbiased (ddof=1); a group of
  one gets A_i = Y_i (there is no baseline to subtract).
- `progpo_advantages`: the ProGPO fallback for all-fail groups (method §4.3) on top of GRPO.
- `first_visit_coverage`: ProGPO's progress score P = (distinct observations - 1) / T.
- `forecast_weights`: the CoPE group normalization Y / max(1, |S_x|) (method §3).

`compute_advantages` applies a method's estimator to a train batch's trajectories.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

GRPO_EPS = 1e-6


def _groups(group_ids) -> tuple[np.ndarray, np.ndarray]:
    """(unique group ids, inverse index [N])."""
    ids = np.asarray(group_ids)
    if ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {ids.shape}")
    return np.unique(ids, return_inverse=True)


def _check(values, group_ids, name: str) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if v.shape != np.shape(group_ids):
        raise ValueError(f"{name} has shape {v.shape}, group_ids has {np.shape(group_ids)}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name} must be finite")
    return v


def _group_moments(values: np.ndarray, inverse: np.ndarray, n_groups: int, ddof: int):
    """Per-trajectory (group mean, group std with `ddof`, group size)."""
    count = np.bincount(inverse, minlength=n_groups).astype(np.float64)
    mean = np.bincount(inverse, values, minlength=n_groups) / count
    sq = np.bincount(inverse, (values - mean[inverse]) ** 2, minlength=n_groups)
    std = np.sqrt(sq / np.maximum(count - ddof, 1))
    return mean[inverse], std[inverse], count[inverse]


def grpo_advantages(rewards, group_ids, eps: float = GRPO_EPS) -> np.ndarray:
    """rewards [N], group_ids [N] -> advantages [N] (float32)."""
    r = _check(rewards, group_ids, "rewards")
    _, inv = _groups(group_ids)
    mean, std, count = _group_moments(r, inv, inv.max(initial=-1) + 1, ddof=1)
    adv = np.where(count > 1, (r - mean) / (std + eps), r)
    return adv.astype(np.float32)


def first_visit_coverage(observations: Sequence[str], num_steps: int | None = None) -> float:
    """ProGPO progress P = (number of distinct strings in o_0..o_T - 1) / T.

    `num_steps` is T (actions taken); it defaults to len(observations) - 1. T = 0 gives 0.
    """
    steps = len(observations) - 1 if num_steps is None else int(num_steps)
    if steps <= 0:
        return 0.0
    return (len(set(observations)) - 1) / steps


def progpo_advantages(rewards, progress, group_ids, *, scale: float = 0.3,
                      reward_std_min: float = 1e-3, progress_std_min: float = 1e-4,
                      eps: float = GRPO_EPS) -> tuple[np.ndarray, dict[str, float]]:
    """ProGPO (method §4.3): rewards [N], progress P [N], group_ids [N] -> (advantages [N], stats).

    Per group, with population (ddof=0) standard deviations:
    - reward std >= reward_std_min: the GRPO advantage;
    - else all rewards 0 and std(P) > progress_std_min:
      A_i = lambda_eff (P_i - mean P) / std P, lambda_eff = scale x (fraction of all-fail groups);
    - else the GRPO advantage. For every group of two or more this is exactly 0 (no reward
      variation); for a group of one it is Y (method §2.1's rule), so ProGPO stays a strict extension
      of GRPO: it changes nothing where GRPO gives a signal.
    """
    r = _check(rewards, group_ids, "rewards")
    p = _check(progress, group_ids, "progress")
    uniq, inv = _groups(group_ids)
    n_groups = len(uniq)
    _, r_std, _ = _group_moments(r, inv, n_groups, ddof=0)
    p_mean, p_std, _ = _group_moments(p, inv, n_groups, ddof=0)
    all_fail_group = np.bincount(inv, r != 0, minlength=n_groups) == 0
    all_fail = all_fail_group[inv]
    frac_fail = float(all_fail_group.mean()) if n_groups else 0.0
    lam = scale * frac_fail
    fallback = (r_std < reward_std_min) & all_fail & (p_std > progress_std_min)
    base = grpo_advantages(r, group_ids, eps).astype(np.float64)
    adv = np.where(fallback, lam * (p - p_mean) / np.where(fallback, p_std, 1.0), base)
    stats = {"progpo_all_fail_frac": frac_fail, "progpo_lambda_eff": lam,
             "progpo_fallback_trajectories": float(fallback.sum())}
    return adv.astype(np.float32), stats


def forecast_weights(success, group_ids) -> np.ndarray:
    """CoPE group normalization (method §3): w_i = Y_i / max(1, |S_x|), S_x = successes in i's group."""
    y = _check(success, group_ids, "success")
    if np.any((y != 0) & (y != 1)):
        raise ValueError("success must be 0/1")
    _, inv = _groups(group_ids)
    n_success = np.bincount(inv, y, minlength=inv.max(initial=-1) + 1)[inv]
    return y / np.maximum(1.0, n_success)  # float64: the exact ratio, rounded once where packed


def successful_groups(success, group_ids) -> set[int]:
    """The groups with at least one successful trajectory."""
    y = _check(success, group_ids, "success")
    return {int(g) for g in np.asarray(group_ids)[y > 0]}


def flat_groups(advantages, group_ids) -> set[int]:
    """The groups whose every advantage is zero: the policy term learns nothing from them (GRPO: all
    rewards equal, every episode of the task succeeded or every one failed)."""
    a = _check(advantages, group_ids, "advantages")
    g = np.asarray(group_ids)
    return {int(x) for x in np.unique(g)} - {int(x) for x in g[np.abs(a) > FLAT]}


FLAT = 1e-8  # |advantage| at or below this is no signal


# A train batch's trajectories: the host side's first step (`batching.build_minibatches`)

def rewards(trajectories) -> np.ndarray:
    """Y per trajectory [N] (float64)."""
    return np.array([float(t.success) for t in trajectories], np.float64)


def _grpo(trajectories, cfg):
    return grpo_advantages(rewards(trajectories), [t.group_id for t in trajectories]), {}


def _progpo(trajectories, cfg):
    progress = [first_visit_coverage(t.observations, t.num_steps) for t in trajectories]
    return progpo_advantages(rewards(trajectories), progress, [t.group_id for t in trajectories],
                             scale=cfg.progpo_scale)


ESTIMATORS = {"grpo": _grpo, "progpo": _progpo}  # a method's `advantage` field -> its estimator


def compute_advantages(spec, trajectories, cfg) -> tuple[np.ndarray, dict[str, float]]:
    """Per-trajectory advantages of the method's (`MethodSpec`) estimator over the whole train
    batch ([N], stats); zeros for a method without one."""
    if spec.advantage is None:
        return np.zeros(len(trajectories), np.float32), {}
    return ESTIMATORS[spec.advantage](trajectories, cfg)
