"""One mini-batch's sequences as segments: trajectories cut to the row, then their forecasting
examples as branches (host side, numpy; no loss weights yet: `cope_jax/batch/weights.py` gives
them from the tokens these segments keep).

Examples of one trajectory share its history (`ForecastExample.prefix_len`), so they are laid out
as trees (`cope_jax/batch/packing.py`): each example's continuation is a branch of a trunk holding
the history. Where the trajectory's own segment is in the mini-batch and its row has room, the
examples hang on it, costing only their continuations; the others share a trunk copy of the longest
history they need, as many per segment as fit in a row; an example without a shared prefix is a
plain sequence (cut from the left if it is too long).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cope_jax.batch.packing import TOKEN_FIELDS, Segment, truncate_left
from cope_jax.rollout.trajectory import ForecastExample


@dataclasses.dataclass
class Branch:
    """Where one forecasting example's target tokens sit: `segment`, under `mask` [len(segment)]."""

    segment: Segment
    mask: np.ndarray
    example: int  # its index in the examples laid out


def sequence_segments(tokens: Sequence, action_masks: Sequence, advantages, row_len: int, *,
                      obs_masks: Sequence | None = None, sampler_logps: Sequence | None = None,
                      first_index: int = 0) -> list[Segment]:
    """Sequences -> segments cut from the left to `row_len`. tokens / action_masks / obs_masks /
    sampler_logps: one [T_i] array per sequence; advantages [S]: one per sequence, spread over its
    action tokens."""
    n = len(tokens)
    obs_masks = [None] * n if obs_masks is None else obs_masks
    sampler_logps = [None] * n if sampler_logps is None else sampler_logps
    segs = []
    for i in range(n):
        action = np.asarray(action_masks[i], bool)
        seg = Segment(tokens=tokens[i], seq_index=first_index + i, action_mask=action, obs_mask=obs_masks[i],
                      sampler_logp=sampler_logps[i], advantage=np.float32(advantages[i]) * action)
        segs.append(truncate_left(seg, row_len))
    return segs


def example_segments(examples: Sequence[ForecastExample], row_len: int, *, first_index: int = 0,
                     trunks: dict[int, Segment] | None = None) -> tuple[list[Segment], list[Branch]]:
    """(the new segments, every example's Branch, in the order laid out). `trunks` maps a source
    trajectory to its own segment in the same mini-batch (extended in place where its examples
    hang on it)."""
    trunks = {k: v for k, v in (trunks or {}).items() if not v.truncated and not v.branch_ids.any()}
    placed: list[tuple[Segment, list[int]]] = []  # (segment, the examples on its branches)
    rest = []
    for source, members in _by_source(examples).items():
        trunk = trunks.get(source)
        on = _fitting(examples, members, row_len - len(trunk)) if trunk is not None else []
        if on:
            _add_branches(trunk, [examples[j] for j in on])
            placed.append((trunk, on))
        rest += [j for j in members if j not in on]
    new = []
    for bundle in forecast_bundles([examples[j] for j in rest], row_len):
        bundle = [rest[j] for j in bundle]
        seg = _bundle_segment([examples[j] for j in bundle], first_index + len(new), row_len)
        new.append(seg)
        placed.append((seg, bundle))
    return new, [Branch(seg, mask, j) for seg, members in placed for mask, j in zip(_branch_masks(seg), members)]


def _fitting(examples, members: list[int], room: int) -> list[int]:
    """The members (by increasing prefix) whose continuations fit in `room` tokens, in turn."""
    on = []
    for j in members:
        branch = len(examples[j]) - examples[j].prefix_len
        if examples[j].prefix_len and branch <= room:
            on.append(j)
            room -= branch
    return on


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
    # the branches carry none of the segment's existing weights (theirs are added after)
    seg.weights = {k: np.concatenate([w, np.zeros(len(seg) - len(w), np.float32)]) for k, w in seg.weights.items()}


def _branch_masks(seg: Segment) -> list[np.ndarray]:
    """The target mask of each example in a segment (one per branch; the whole mask if none)."""
    if not seg.branch_ids.any():
        return [seg.target_mask]
    return [seg.target_mask & (seg.branch_ids == b) for b in range(1, int(seg.branch_ids.max()) + 1)]
