"""Per-term loss weights on one mini-batch's segments (host side, numpy).

Each term's host weight function (`methods.TERMS[term].weights`) sees the loss-token counts of the
whole mini-batch, after the segments were cut to the row, so any packing or micro-batch split of
the mini-batch gives the same loss and gradients (`cope_jax/objective/losses.py`). The first token of
a segment has no prediction inside it and is never a loss token.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from cope_jax.objective.methods import TERMS, LossConfig, WeightInputs
from cope_jax.batch.packing import Segment
from cope_jax.batch.segments import Branch
from cope_jax.rollout.trajectory import ForecastExample

_MASKS = {"action": lambda s: s.action_mask, "observation": lambda s: s.obs_mask}


def sequence_weights(segments: list[Segment], terms: Sequence[str], cfg: LossConfig,
                     masked: Sequence[bool] | None = None) -> None:
    """Adds the weights of `terms` that read action or observation tokens to `segments`. masked [S]:
    sequences the policy terms (`Term.policy`) skip, their normalizers counting only the others."""
    for term in terms:
        if TERMS[term].tokens in _MASKS:
            masks = [_loss_mask(_MASKS[TERMS[term].tokens](s)) for s in segments]
            if masked is not None and TERMS[term].policy:
                masks = [m & (not off) for m, off in zip(masks, masked)]
            _add(segments, masks, term, cfg)


def example_weights(branches: list[Branch], examples: Sequence[ForecastExample], terms: Sequence[str],
                    cfg: LossConfig, num_groups: int) -> None:
    """Adds the weights of `terms` that read forecasting targets on each example's branch;
    `num_groups` is the AF normalizer (losses)."""
    example_weight = np.array([examples[b.example].weight for b in branches], np.float32)
    masks = [_loss_mask(b.mask) for b in branches]
    for term in (t for t in terms if TERMS[t].tokens == "target"):
        _add([b.segment for b in branches], masks, term, cfg, example_weight=example_weight, num_groups=num_groups)


def _loss_mask(mask: np.ndarray) -> np.ndarray:
    out = mask.astype(bool).copy()
    if len(out):
        out[0] = False  # no context inside the segment
    return out


def _add(segments: list[Segment], masks: list[np.ndarray], term: str, cfg: LossConfig, **inputs) -> None:
    """Gives each segment the weights of `term` on its loss tokens `masks` (the term's host weight
    function over the whole mini-batch's counts)."""
    counts = np.array([m.sum() for m in masks], np.float32)
    per_token = TERMS[term].weights(WeightInputs(counts=counts, **inputs), cfg)
    for seg, w, m in zip(segments, per_token, masks):
        seg.weights[term] = seg.weight(term) + np.float32(w) * m
