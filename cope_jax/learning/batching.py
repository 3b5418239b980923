"""Host side of a training iteration: train batch -> advantages -> PPO mini-batches of packed rows.

`build_minibatches` takes the rollouts of one train batch (n rollouts per task) and the forecasting
examples built from them, and returns the packed mini-batches to optimize, in order, each with the
loss terms its optimizer step uses:

- The train batch is split into PPO mini-batches of whole rollout groups (`groups_per_minibatch`
  tasks' worth; SPEC 2, Table 9), one optimizer step each.
- `af_mode='joint'` (default): a group's forecasting examples ride in its mini-batch and the step
  minimizes L_GRPO + lambda L_AF at once; the AF normalizer counts the mini-batch's groups. The
  examples hang as branches on their own trajectory's row where it has room (`example_segments`),
  so the shared history is computed once for both losses.
- `af_mode='sequential'`: the GRPO mini-batches carry only the policy terms, then one more
  mini-batch holds every forecasting example of the train batch (normalizer over all its groups)
  and is optimized alone, with the same AdamW state (what the authors' released code does).

Exact aggregation: every loss weight is computed here, from token counts of the whole mini-batch,
after left-truncation, so any packing or micro-batch split of the mini-batch gives the same loss and
gradients (see `cope_jax/learning/losses.py`). The first token of every segment has no prediction inside
the segment and is never a loss token.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cope_jax.learning import advantages as adv_lib
from cope_jax.learning.methods import TERMS, LossConfig, MethodSpec, WeightInputs, ordered
from cope_jax.learning.packing import (TOKEN_FIELDS, PackedBatch, PackStats, Segment, concat_rows, pack, split_micro,
                              truncate_left)
from cope_jax.rollout.trajectory import ForecastExample, Trajectory


@dataclasses.dataclass
class MiniBatch:
    """One optimizer step's data: numpy PackedBatch [micro, rows, L], whose weights name the terms
    it optimizes."""

    batch: PackedBatch
    stats: PackStats
    groups: tuple[int, ...]
    num_trajectories: int
    num_examples: int

    @property
    def terms(self) -> tuple[str, ...]:
        return ordered(self.batch.weights)


def _rewards(trajectories: Sequence[Trajectory]) -> np.ndarray:
    return np.array([float(t.success) for t in trajectories], np.float64)


def _grpo(trajectories, cfg: LossConfig):
    groups = [t.group_id for t in trajectories]
    return adv_lib.grpo_advantages(_rewards(trajectories), groups), {}


def _progpo(trajectories, cfg: LossConfig):
    groups = [t.group_id for t in trajectories]
    progress = [adv_lib.first_visit_coverage(t.observations, t.num_steps) for t in trajectories]
    return adv_lib.progpo_advantages(_rewards(trajectories), progress, groups, scale=cfg.progpo_scale)


ADVANTAGE_FNS = {"grpo": _grpo, "progpo": _progpo}


def compute_advantages(spec: MethodSpec, trajectories: Sequence[Trajectory],
                       cfg: LossConfig) -> tuple[np.ndarray, dict[str, float]]:
    """Per-trajectory advantages of the method's estimator over the whole train batch ([N], stats)."""
    if spec.advantage is None:
        return np.zeros(len(trajectories), np.float32), {}
    return ADVANTAGE_FNS[spec.advantage](trajectories, cfg)


def minibatch_groups(group_ids: Sequence[int], groups_per_minibatch: int) -> list[tuple[int, ...]]:
    """Groups in order of first appearance, cut into consecutive mini-batches."""
    if groups_per_minibatch < 1:
        raise ValueError("groups_per_minibatch must be >= 1")
    order = list(dict.fromkeys(int(g) for g in group_ids))
    return [tuple(order[i:i + groups_per_minibatch]) for i in range(0, len(order), groups_per_minibatch)]


def _loss_mask(mask: np.ndarray) -> np.ndarray:
    out = mask.astype(bool).copy()
    if len(out):
        out[0] = False  # no context inside the segment
    return out


def _set_weights(segments: list[Segment], masks: list[np.ndarray], term: str, cfg: LossConfig,
                 **inputs) -> None:
    """Gives each segment the weights of `term` on its loss tokens `masks` (the term's host weight
    function over the whole mini-batch's counts)."""
    counts = np.array([m.sum() for m in masks], np.float32)
    per_token = TERMS[term].weights(WeightInputs(counts=counts, **inputs), cfg)
    for seg, w, m in zip(segments, per_token, masks):
        seg.weights[term] = seg.weight(term) + np.float32(w) * m


def sequence_segments(tokens: Sequence, action_masks: Sequence, advantages, terms: Sequence[str],
                      cfg: LossConfig, row_len: int, *, obs_masks: Sequence | None = None,
                      sampler_logps: Sequence | None = None, first_index: int = 0) -> list[Segment]:
    """Sequences of token ids -> segments carrying the weights of `terms` (those reading action or
    observation tokens), cut from the left to `row_len`; weights are normalized over all of them
    (one mini-batch). tokens / action_masks / obs_masks / sampler_logps: one [T_i] array per
    sequence; advantages [S]: one per sequence, spread over its action tokens."""
    n = len(tokens)
    obs_masks = [None] * n if obs_masks is None else obs_masks
    sampler_logps = [None] * n if sampler_logps is None else sampler_logps
    segs = []
    for i in range(n):
        action = np.asarray(action_masks[i], bool)
        seg = Segment(tokens=tokens[i], seq_index=first_index + i, action_mask=action, obs_mask=obs_masks[i],
                      sampler_logp=sampler_logps[i], advantage=np.float32(advantages[i]) * action)
        segs.append(truncate_left(seg, row_len))
    mask_of = {"action": lambda s: s.action_mask, "observation": lambda s: s.obs_mask}
    for term in terms:
        if TERMS[term].tokens in mask_of:
            _set_weights(segs, [_loss_mask(mask_of[TERMS[term].tokens](s)) for s in segs], term, cfg)
    return segs


def trajectory_segments(trajectories: Sequence[Trajectory], advantages: np.ndarray, terms: Sequence[str],
                        cfg: LossConfig, row_len: int, first_index: int = 0) -> list[Segment]:
    """Trajectory rows of one mini-batch with the weights of their terms (`sequence_segments`)."""
    return sequence_segments([t.tokens for t in trajectories], [t.action_mask for t in trajectories],
                             advantages, terms, cfg, row_len, obs_masks=[t.obs_mask for t in trajectories],
                             sampler_logps=[t.sampler_logp for t in trajectories], first_index=first_index)


def example_segments(examples: Sequence[ForecastExample], num_groups: int, terms: Sequence[str],
                     cfg: LossConfig, row_len: int, first_index: int = 0,
                     trunks: dict[int, Segment] | None = None) -> list[Segment]:
    """Forecasting-example rows with the weights of `terms` (those reading target tokens);
    `num_groups` is the normalizer (losses).

    Examples of one trajectory share its history (`ForecastExample.prefix_len`), so they are packed
    as trees (`cope_jax/learning/packing.py`): each example's continuation is a branch of a trunk holding the
    history. `trunks` maps a source trajectory to its own (policy) segment in the same mini-batch:
    its examples hang on it while the row has room, costing only their continuations. The others
    share a trunk copy of the longest history they need, as many per segment as fit in a row; an
    example alone is a plain sequence (cut from the left if it is too long). Returns the new
    segments (trunks are extended in place).
    """
    trunks = {k: v for k, v in (trunks or {}).items() if not v.truncated and not v.branch_ids.any()}
    placed: list[tuple[Segment, list[int]]] = []  # (segment, the examples on its branches)
    rest = []
    for source, members in _by_source(examples).items():
        trunk = trunks.get(source)
        if trunk is not None:
            room, on = row_len - len(trunk), []
            for j in members:
                branch = len(examples[j]) - examples[j].prefix_len
                if examples[j].prefix_len and branch <= room:
                    on.append(j)
                    room -= branch
            if on:
                _add_branches(trunk, [examples[j] for j in on])
                placed.append((trunk, on))
            members = [j for j in members if j not in on]
        rest += members
    new = []
    for bundle in forecast_bundles([examples[j] for j in rest], row_len):
        bundle = [rest[j] for j in bundle]
        seg = _bundle_segment([examples[j] for j in bundle], first_index + len(new), row_len)
        new.append(seg)
        placed.append((seg, bundle))
    masks = [_loss_mask(m) for seg, _ in placed for m in _branch_masks(seg)]
    order = [j for _, members in placed for j in members]
    segs = [seg for seg, members in placed for _ in members]
    for seg, mask in zip(segs, masks):
        seg.target_mask = seg.target_mask | mask
    example_weight = np.array([examples[j].weight for j in order], np.float32)
    for term in (t for t in terms if TERMS[t].tokens == "target"):
        _set_weights(segs, masks, term, cfg, example_weight=example_weight, num_groups=num_groups)
    return new


def _by_source(examples: Sequence[ForecastExample]) -> dict[int, list[int]]:
    """Example indices per source trajectory, each list by increasing prefix length."""
    out: dict[int, list[int]] = {}
    for j, e in enumerate(examples):
        out.setdefault(e.source, []).append(j)
    return {k: sorted(v, key=lambda j: (examples[j].prefix_len, j)) for k, v in out.items()}


def forecast_bundles(examples: Sequence[ForecastExample], row_len: int) -> list[list[int]]:
    """Indices of the examples packed together: one trajectory's, by increasing prefix length, as
    long as the longest prefix plus every continuation fits in `row_len` (an example without a
    shared prefix is alone)."""
    out = []
    for members in _by_source(examples).values():
        out += [[j] for j in members if not examples[j].prefix_len]
        bundle, size = [], 0
        for j in (j for j in members if examples[j].prefix_len):
            e = examples[j]
            branch = len(e) - e.prefix_len
            if bundle and e.prefix_len + size + branch > row_len:
                out.append(bundle)
                bundle, size = [], 0
            bundle.append(j)
            size += branch
        if bundle:
            out.append(bundle)
    return out


def _bundle_segment(bundle: list[ForecastExample], index: int, row_len: int) -> Segment:
    if len(bundle) == 1:
        e = bundle[0]
        return truncate_left(Segment(tokens=e.tokens, seq_index=index, target_mask=e.target_mask), row_len)
    seg = Segment(tokens=bundle[-1].tokens[:bundle[-1].prefix_len], seq_index=index)
    _add_branches(seg, bundle)
    return seg


def _add_branches(seg: Segment, examples: list[ForecastExample]) -> None:
    """Appends each example's continuation to `seg` as a new branch of its trunk (branch 0)."""
    trunk = seg.tokens[seg.branch_ids == 0]
    parts = {name: [getattr(seg, name)] for name in TOKEN_FIELDS}
    positions = [seg.positions]
    first = int(seg.branch_ids.max(initial=0)) + 1
    for b, e in enumerate(examples, start=first):
        p, n = e.prefix_len, len(e) - e.prefix_len
        if p > len(trunk) or not np.array_equal(e.tokens[:p], trunk[:p]):
            raise ValueError(f"forecasting example of trajectory {e.source} (step {e.step}) does not continue "
                             "the history it is packed with")
        for name, dtype in TOKEN_FIELDS.items():
            parts[name].append(np.zeros(n, dtype))
        parts["tokens"][-1] = e.tokens[p:]
        parts["branch_ids"][-1] = np.full(n, b, np.int32)
        parts["target_mask"][-1] = e.target_mask[p:]
        positions.append(p + np.arange(n, dtype=np.int32))
    for name, arrays in parts.items():
        setattr(seg, name, np.concatenate(arrays).astype(TOKEN_FIELDS[name], copy=False))
    seg.positions = np.concatenate(positions)
    # the branches carry none of the segment's existing weights (theirs are added by the caller)
    seg.weights = {k: np.concatenate([w, np.zeros(len(seg) - len(w), np.float32)]) for k, w in seg.weights.items()}


def _branch_masks(seg: Segment) -> list[np.ndarray]:
    """The target mask of each example in a segment (one per branch; the whole mask if none)."""
    if not seg.branch_ids.any():
        return [seg.target_mask]
    return [seg.target_mask & (seg.branch_ids == b) for b in range(1, int(seg.branch_ids.max()) + 1)]


def _forecast_groups(trajectories: Sequence[Trajectory], cfg: LossConfig) -> int:
    groups = [t.group_id for t in trajectories]
    if cfg.af_normalization == "paper_exact":
        return len(set(groups))
    return adv_lib.groups_with_success(_rewards(trajectories), groups)


def pack_minibatch(segments: Sequence[Segment], terms: Sequence[str], row_len: int, rows_per_micro: int,
                   num_sequences: int | None = None) -> tuple[PackedBatch, PackStats]:
    """Segments -> PackedBatch [micro, rows_per_micro, row_len] with one weight array per term.

    The first `num_sequences` segments (default: all) are the trajectory rows, packed into their own
    leading micro-batches: only they need the old / reference log-probs, so those forward passes
    run on the leading micro-batches alone (`Learner.fill_logprobs`)."""
    n = len(segments) if num_sequences is None else num_sequences
    kinds = [[s for s in segments if s.seq_index < n], [s for s in segments if s.seq_index >= n]]
    packed, stats = concat_rows([pack(k, row_len, terms=terms, rows_multiple=rows_per_micro) for k in kinds if k])
    return split_micro(packed, rows_per_micro), stats


def _minibatch(segments, terms, groups, n_traj, n_ex, row_len, rows_per_micro) -> MiniBatch:
    batch, stats = pack_minibatch(segments, terms, row_len, rows_per_micro, num_sequences=n_traj)
    return MiniBatch(batch=batch, stats=stats, groups=tuple(groups), num_trajectories=n_traj, num_examples=n_ex)


def build_minibatches(trajectories: Sequence[Trajectory], examples: Sequence[ForecastExample],
                      spec: MethodSpec, cfg: LossConfig, *, groups_per_minibatch: int, row_len: int,
                      rows_per_micro: int,
                      advantages: np.ndarray | None = None) -> tuple[list[MiniBatch], dict[str, float]]:
    """The optimizer steps of one train batch, in order (module docstring).

    `advantages` overrides the method's estimator (per trajectory, [N]). Returns the mini-batches
    (mini-batches left without any loss token are dropped) and host statistics.
    """
    if advantages is None:
        advantages, stats = compute_advantages(spec, trajectories, cfg)
    else:
        stats = {}
        advantages = np.asarray(advantages, np.float32)
        if advantages.shape != (len(trajectories),):
            raise ValueError(f"advantages has shape {advantages.shape}, expected ({len(trajectories)},)")
    terms = cfg.active_terms(spec.terms)
    target_terms = tuple(t for t in terms if TERMS[t].tokens == "target")
    if examples and not target_terms:
        raise ValueError(f"method {spec.name!r} has no active forecasting term but {len(examples)} examples "
                         "were given")
    known = {t.group_id for t in trajectories}
    stray = sorted({e.group_id for e in examples} - known)
    if stray:
        raise ValueError(f"forecasting examples of groups {stray[:5]} have no trajectories in this batch")
    joint = cfg.af_mode == "joint"
    # sequential: the forecasting terms get a mini-batch of their own, after the others
    step_terms = terms if joint else tuple(t for t in terms if t not in target_terms)
    out: list[MiniBatch] = []
    for groups in minibatch_groups([t.group_id for t in trajectories], groups_per_minibatch):
        members = set(groups)
        idx = [i for i, t in enumerate(trajectories)
               if t.group_id in members and (spec.trajectories == "all" or t.success)]
        trajs = [trajectories[i] for i in idx]
        segs = trajectory_segments(trajs, advantages[idx], step_terms, cfg, row_len) if step_terms else []
        exs = [e for e in examples if e.group_id in members] if joint else []
        if exs:
            in_groups = [t for t in trajectories if t.group_id in members]
            segs += example_segments(exs, _forecast_groups(in_groups, cfg), step_terms, cfg, row_len,
                                     first_index=len(trajs), trunks=dict(zip(idx, segs)))
        if any(w.any() for s in segs for w in s.weights.values()):
            out.append(_minibatch(segs, step_terms, groups, len(trajs), len(exs), row_len, rows_per_micro))
    if not joint and examples:
        segs = example_segments(examples, _forecast_groups(trajectories, cfg), target_terms, cfg, row_len)
        all_groups = tuple(dict.fromkeys(e.group_id for e in examples))
        out.append(_minibatch(segs, target_terms, all_groups, 0, len(examples), row_len, rows_per_micro))
    groups = [t.group_id for t in trajectories]
    stats["success_group_frac"] = adv_lib.groups_with_success(_rewards(trajectories), groups) / max(1, len(set(groups)))
    stats["minibatches"] = float(len(out))
    stats["truncated_tokens"] = float(sum(m.stats.truncated_tokens for m in out))
    stats["truncated_sequences"] = float(sum(m.stats.truncated_sequences for m in out))
    return out, stats
