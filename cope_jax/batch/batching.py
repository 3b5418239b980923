"""Host side of a training iteration: a train batch's trajectories and forecasting examples ->
PPO mini-batches of packed rows, in one straight line, each step once:

  advantages (`advantages.py`, over the whole train batch)
  -> segments (`segments.py`: per mini-batch, its trajectories cut to the row, then their
     forecasting examples as branches)
  -> per-term weights (`weights.py`: normalized over the tokens the segments keep)
  -> packed rows (`packing.py`).

Weights come after segments because they are normalized by the loss tokens left after the cut to
the row, and an example's tokens depend on where it hangs.

`build_minibatches` takes the rollouts of one train batch (n rollouts per task) and the forecasting
examples built from them, and returns the packed mini-batches to optimize, in order, each with the
loss terms its optimizer step uses:

- The train batch is split into PPO mini-batches of whole rollout groups (`groups_per_minibatch`
  tasks' worth; method §2.4, Table 9), one optimizer step each.
- `af_mode='joint'` (default): a group's forecasting examples ride in its mini-batch and the step
  minimizes L_GRPO + lambda L_AF at once; the AF normalizer counts the mini-batch's groups. The
  examples hang as branches on their own trajectory's row where it has room (`example_segments`),
  so the shared history is computed once for both losses.
- `af_mode='sequential'`: the GRPO mini-batches carry only the policy terms, then one more
  mini-batch holds every forecasting example of the train batch (normalizer over all its groups)
  and is optimized alone, with the same AdamW state (what the authors' released code does).

`sequence_segments` / `example_segments` are the two middle steps for one set of sequences, for
driving the train step without trajectories (`docs/api.md`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cope_jax.objective import advantages as adv_lib
from cope_jax.batch import segments as seg_lib
from cope_jax.batch import weights as weight_lib
from cope_jax.objective.methods import TERMS, LossConfig, MethodSpec, ordered
from cope_jax.batch.packing import PackedBatch, PackStats, Segment, concat_rows, pack, split_micro
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


def minibatch_groups(group_ids: Sequence[int], groups_per_minibatch: int) -> list[tuple[int, ...]]:
    """Groups in order of first appearance, cut into consecutive mini-batches."""
    if groups_per_minibatch < 1:
        raise ValueError("groups_per_minibatch must be >= 1")
    order = list(dict.fromkeys(int(g) for g in group_ids))
    return [tuple(order[i:i + groups_per_minibatch]) for i in range(0, len(order), groups_per_minibatch)]


def sequence_segments(tokens: Sequence, action_masks: Sequence, advantages, terms: Sequence[str],
                      cfg: LossConfig, row_len: int, *, obs_masks: Sequence | None = None,
                      sampler_logps: Sequence | None = None, first_index: int = 0) -> list[Segment]:
    """Sequences of token ids -> segments carrying the weights of `terms` (those reading action or
    observation tokens), cut from the left to `row_len`, weights normalized over all of them (one
    mini-batch). Arrays as `segments.sequence_segments`."""
    segs = seg_lib.sequence_segments(tokens, action_masks, advantages, row_len, obs_masks=obs_masks,
                                     sampler_logps=sampler_logps, first_index=first_index)
    weight_lib.sequence_weights(segs, terms, cfg)
    return segs


def example_segments(examples: Sequence[ForecastExample], num_groups: int, terms: Sequence[str],
                     cfg: LossConfig, row_len: int, first_index: int = 0,
                     trunks: dict[int, Segment] | None = None) -> list[Segment]:
    """Forecasting examples -> the new segments (`segments.example_segments`; `trunks` extended in
    place) with the weights of `terms` (those reading targets); `num_groups`: the AF normalizer."""
    new, branches = seg_lib.example_segments(examples, row_len, first_index=first_index, trunks=trunks)
    weight_lib.example_weights(branches, examples, terms, cfg, num_groups)
    return new


def pack_minibatch(segments: Sequence[Segment], terms: Sequence[str], row_len: int, rows_per_micro: int,
                   num_sequences: int | None = None) -> tuple[PackedBatch, PackStats]:
    """Segments -> PackedBatch [micro, rows_per_micro, row_len] with one weight array per term.

    The first `num_sequences` segments (default: all) are the trajectory rows, packed into their own
    leading micro-batches: only they need the old / reference log-probs, so those forward passes
    skip the micro-batches after them (`Learner.fill_logprobs`)."""
    n = len(segments) if num_sequences is None else num_sequences
    kinds = [[s for s in segments if s.seq_index < n], [s for s in segments if s.seq_index >= n]]
    packed, stats = concat_rows([pack(k, row_len, terms=terms, rows_multiple=rows_per_micro) for k in kinds if k])
    return split_micro(packed, rows_per_micro), stats


def build_minibatches(trajectories: Sequence[Trajectory], examples: Sequence[ForecastExample],
                      spec: MethodSpec, cfg: LossConfig, *, groups_per_minibatch: int, row_len: int,
                      rows_per_micro: int,
                      advantages: np.ndarray | None = None) -> tuple[list[MiniBatch], dict[str, float]]:
    """The optimizer steps of one train batch, in order (module docstring).

    `advantages` overrides the method's estimator (per trajectory, [N]). Returns the mini-batches
    (mini-batches left without any loss token are dropped) and host statistics.
    """
    terms = cfg.active_terms(spec.terms)
    target_terms = tuple(t for t in terms if TERMS[t].tokens == "target")
    _check_inputs(trajectories, examples, spec, target_terms, advantages)
    # 1. advantages, over the whole train batch
    if advantages is None:
        advantages, stats = adv_lib.compute_advantages(spec, trajectories, cfg)
    else:
        advantages, stats = np.asarray(advantages, np.float32), {}
    groups = [t.group_id for t in trajectories]
    succeeded = adv_lib.successful_groups(adv_lib.rewards(trajectories), groups)
    masked = set()
    if cfg.zero_variance == "mask":  # 'filter' left them out of the batch before
        masked = adv_lib.flat_groups(advantages, groups)
        stats["zero_variance_groups"] = float(len(masked))

    def normalizer(groups_in) -> int:  # the AF normalizer of a mini-batch's groups (losses)
        return len(set(groups_in)) if cfg.af_normalization == "paper_exact" else len(succeeded & set(groups_in))

    joint = cfg.af_mode == "joint"
    # sequential: the forecasting terms get a mini-batch of their own, after the others
    step_terms = terms if joint else tuple(t for t in terms if t not in target_terms)
    out = []
    for members in minibatch_groups(groups, groups_per_minibatch):
        idx = [i for i, t in enumerate(trajectories)
               if t.group_id in members and (spec.trajectories == "all" or t.success)]
        exs = [e for e in examples if e.group_id in members] if joint else []
        mb = _minibatch(trajectories, idx, advantages, exs, step_terms, cfg, normalizer(members), members,
                        row_len, rows_per_micro, drop_empty=True, masked=masked)
        if mb is not None:
            out.append(mb)
    if not joint and examples:
        example_groups = tuple(dict.fromkeys(e.group_id for e in examples))
        out.append(_minibatch(trajectories, [], advantages, examples, target_terms, cfg, normalizer(groups),
                              example_groups, row_len, rows_per_micro, drop_empty=False))
    stats["success_group_frac"] = len(succeeded) / max(1, len(set(groups)))
    stats["minibatches"] = float(len(out))
    stats["truncated_tokens"] = float(sum(m.stats.truncated_tokens for m in out))
    stats["truncated_sequences"] = float(sum(m.stats.truncated_sequences for m in out))
    return out, stats


def _minibatch(trajectories, idx: list[int], advantages, examples, terms, cfg: LossConfig, num_groups: int,
               groups, row_len: int, rows_per_micro: int, drop_empty: bool,
               masked: set[int] = frozenset()) -> MiniBatch | None:
    """Steps 2-4 for one mini-batch: trajectories `idx` and `examples` -> its MiniBatch (None where
    `drop_empty` and no token carries a loss weight). `masked`: groups the policy terms skip."""
    trajs = [trajectories[i] for i in idx]
    # 2. segments: the trajectories, then their forecasting examples (on their rows where they fit)
    segs = seg_lib.sequence_segments([t.tokens for t in trajs], [t.action_mask for t in trajs], advantages[idx],
                                     row_len, obs_masks=[t.obs_mask for t in trajs],
                                     sampler_logps=[t.sampler_logp for t in trajs]) if terms else []
    new, branches = seg_lib.example_segments(examples, row_len, first_index=len(trajs),
                                             trunks=dict(zip(idx, segs))) if examples else ([], [])
    # 3. per-term weights, over the tokens the segments keep
    weight_lib.sequence_weights(segs, terms, cfg, masked=[t.group_id in masked for t in trajs] if masked else None)
    if examples:
        weight_lib.example_weights(branches, examples, terms, cfg, num_groups)
    segs += new
    if drop_empty and not any(w.any() for s in segs for w in s.weights.values()):
        return None
    # 4. packed rows
    batch, stats = pack_minibatch(segs, terms, row_len, rows_per_micro, num_sequences=len(trajs))
    return MiniBatch(batch=batch, stats=stats, groups=tuple(groups), num_trajectories=len(trajs),
                     num_examples=len(examples))


def _check_inputs(trajectories, examples, spec: MethodSpec, target_terms, advantages) -> None:
    if advantages is not None and np.shape(advantages) != (len(trajectories),):
        raise ValueError(f"advantages has shape {np.shape(advantages)}, expected ({len(trajectories)},)")
    if examples and not target_terms:
        raise ValueError(f"method {spec.name!r} has no active forecasting term but {len(examples)} examples "
                         "were given")
    stray = sorted({e.group_id for e in examples} - {t.group_id for t in trajectories})
    if stray:
        raise ValueError(f"forecasting examples of groups {stray[:5]} have no trajectories in this batch")
