"""Packing variable-length training sequences into fixed `[rows, L]` batches.

A `Segment` is one sequence (a rollout trajectory or a forecasting example) with all of its
per-token training inputs. `pack` places segments into rows of length L by first-fit-decreasing;
each row holds whole segments back to back, numbered 1, 2, ... by `segment_ids` (0 = padding), with
each segment's own RoPE positions (by default 0, 1, ...); the model never attends across segments,
so a packed segment computes exactly what it would alone.

A segment may also be a *tree*: a trunk (`branch_ids` 0) followed by branches 1, 2, ... that each
continue a prefix of the trunk (positions going on from the prefix length). Forecasting examples of
one trajectory share its history this way, packed once instead of once per example
(`cope_jax/batch/batching.py` builds them; `models.attention.packed_ids` gives the attention pattern).

Sequences longer than L are cut from the left by `truncate_left` (the most recent context and all
later tokens are kept), counted in `PackStats`; `pack` itself refuses an over-long segment, so
nothing is ever dropped silently. Loss weights must be computed *after* truncation, from the kept
tokens (`cope_jax/batch/batching.py` does this).

All masks and per-token values are in token coordinates: entry t describes token t itself (its
logprob is computed from the hidden state at t - 1 of the same segment).
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

# per-token fields of Segment and PackedBatch, with their dtypes
TOKEN_FIELDS: dict[str, type] = {
    "tokens": np.int32,
    "branch_ids": np.int32,
    "action_mask": np.bool_,
    "obs_mask": np.bool_,
    "target_mask": np.bool_,
    "old_logp": np.float32,
    "ref_logp": np.float32,
    "sampler_logp": np.float32,
    "advantage": np.float32,
}


@dataclasses.dataclass(eq=False)
class Segment:
    """One sequence with its per-token training inputs (numpy, [T] each).

    advantage: the trajectory's advantage on its action tokens (0 elsewhere).
    weights: {loss term: [T] float32}, each token's weight in that term's loss (`cope_jax/objective/methods.py`;
        0 = no loss); a term the segment has no tokens of is absent (packed as zeros).
    old_logp / ref_logp: logprobs under the rollout and reference policies (filled by the
        forward-only functions of `cope_jax/train/train_step.py` after packing, or given directly).
    branch_ids / positions: the tree layout (module docstring); default one branch, 0, 1, ...
    seq_index: the sequence's index in its mini-batch (the packed batch's `seq_index`).
    truncated: tokens already cut from the left.
    """

    tokens: np.ndarray
    seq_index: int
    positions: np.ndarray | None = None
    branch_ids: np.ndarray | None = None
    action_mask: np.ndarray | None = None
    obs_mask: np.ndarray | None = None
    target_mask: np.ndarray | None = None
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    sampler_logp: np.ndarray | None = None
    advantage: np.ndarray | None = None
    weights: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    truncated: int = 0

    def __post_init__(self):
        n = len(np.asarray(self.tokens).reshape(-1))
        for name, dtype in TOKEN_FIELDS.items():
            value = getattr(self, name)
            arr = np.zeros(n, dtype) if value is None else _token_array(self.seq_index, name, value, n, dtype)
            setattr(self, name, arr)
        self.weights = {k: _token_array(self.seq_index, f"weights[{k}]", w, n, np.float32)
                        for k, w in self.weights.items()}
        positions = np.arange(n) if self.positions is None else np.asarray(self.positions)
        if positions.shape != (n,):
            raise ValueError(f"segment {self.seq_index}: positions have shape {positions.shape}, tokens have ({n},)")
        self.positions = positions.astype(np.int32, copy=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def weight(self, term: str) -> np.ndarray:
        """[T] weights of `term` (zeros if the segment has none)."""
        return self.weights.get(term, np.zeros(len(self), np.float32))


def _token_array(index: int, name: str, value, n: int, dtype) -> np.ndarray:
    arr = np.asarray(value).astype(dtype, copy=False)
    if arr.shape != (n,):
        raise ValueError(f"segment {index}: {name} has shape {arr.shape}, tokens have ({n},)")
    return arr


def truncate_left(segment: Segment, max_len: int) -> Segment:
    """Keeps the last `max_len` tokens; the cut is recorded in `truncated`. (The first token of
    any segment has no context inside it, so it is never a loss token: see batching.)"""
    n = len(segment)
    if n <= max_len:
        return segment
    if segment.branch_ids.any():
        raise ValueError(f"segment {segment.seq_index} has branches and is longer than {max_len} tokens; "
                         "tree segments must be built to fit a row")
    cut = n - max_len
    fields = {name: getattr(segment, name)[cut:].copy() for name in TOKEN_FIELDS}
    fields["weights"] = {k: w[cut:].copy() for k, w in segment.weights.items()}
    return Segment(seq_index=segment.seq_index, truncated=segment.truncated + cut,
                   positions=segment.positions[cut:] - segment.positions[cut], **fields)


@flax.struct.dataclass
class PackedBatch:
    """Packed rows: every field is [rows, L] (or [micro, rows, L] after `split_micro`).

    segment_ids: int32, 1.. per segment within a row, 0 = padding. positions: int32 RoPE positions.
    branch_ids: int32, 0 = a segment's trunk, 1.. its branches (module docstring).
    seq_index: int32 index of the segment's sequence in the mini-batch, -1 on padding.
    weights: {loss term: weights}, one array per term the batch optimizes (`terms`).
    The rest as in `Segment`.
    """

    tokens: jax.Array
    branch_ids: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    seq_index: jax.Array
    action_mask: jax.Array
    obs_mask: jax.Array
    target_mask: jax.Array
    old_logp: jax.Array
    ref_logp: jax.Array
    sampler_logp: jax.Array
    advantage: jax.Array
    weights: dict[str, jax.Array]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tokens.shape)

    @property
    def num_micro(self) -> int:
        """Micro-batches along the leading axis (1 for an unsplit [rows, L] batch)."""
        return self.tokens.shape[0] if self.tokens.ndim == 3 else 1

    def micro(self, i: int) -> "PackedBatch":
        return jax.tree.map(lambda a: a[i], self)


@dataclasses.dataclass(frozen=True)
class PackStats:
    rows: int
    row_len: int
    sequences: int
    tokens: int             # real (non-padding) tokens
    truncated_sequences: int
    truncated_tokens: int


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins of item indices; items sorted by length (descending, ties by index), each placed in
    the first bin with room. Raises if an item exceeds the capacity."""
    lengths = [int(n) for n in lengths]
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"sequences {too_long[:5]} are longer than the row length {capacity}; "
                         "cut them with truncate_left first")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(segments: list[Segment], row_len: int, *, terms, rows_multiple: int = 1,
         min_rows: int = 0) -> tuple[PackedBatch, PackStats]:
    """Segments -> numpy PackedBatch [rows, row_len] by first-fit-decreasing, with one weight array
    per loss term in `terms` (a segment's weights of other terms are refused).

    rows is rounded up to a multiple of `rows_multiple` (and to at least `min_rows`) with padding
    rows, so the batch splits evenly into micro-batches / over the data-parallel devices.
    """
    if row_len < 1 or rows_multiple < 1:
        raise ValueError("row_len and rows_multiple must be >= 1")
    stray = {k for s in segments for k in s.weights} - set(terms)
    if stray:
        raise ValueError(f"segments carry weights of terms {sorted(stray)} outside the packed terms {tuple(terms)}")
    bins = first_fit_decreasing([len(s) for s in segments], row_len)
    rows = max(len(bins), min_rows, 1)
    rows = -(-rows // rows_multiple) * rows_multiple
    out = {name: np.zeros((rows, row_len), dtype) for name, dtype in TOKEN_FIELDS.items()}
    out["segment_ids"] = np.zeros((rows, row_len), np.int32)
    out["positions"] = np.zeros((rows, row_len), np.int32)
    out["seq_index"] = np.full((rows, row_len), -1, np.int32)
    out["weights"] = {t: np.zeros((rows, row_len), np.float32) for t in terms}
    for r, members in enumerate(bins):
        start = 0
        for seg_id, i in enumerate(members, start=1):
            seg = segments[i]
            end = start + len(seg)
            for name in TOKEN_FIELDS:
                out[name][r, start:end] = getattr(seg, name)
            for t, w in seg.weights.items():
                out["weights"][t][r, start:end] = w
            out["segment_ids"][r, start:end] = seg_id
            out["positions"][r, start:end] = seg.positions
            out["seq_index"][r, start:end] = seg.seq_index
            start = end
    stats = PackStats(rows=rows, row_len=row_len, sequences=len(segments),
                      tokens=sum(len(s) for s in segments),
                      truncated_sequences=sum(s.truncated > 0 for s in segments),
                      truncated_tokens=sum(s.truncated for s in segments))
    return PackedBatch(**out), stats


def concat_rows(parts: list[tuple[PackedBatch, PackStats]]) -> tuple[PackedBatch, PackStats]:
    """Packed [rows, L] batches (and their stats) stacked row-wise, in order."""
    if len(parts) == 1:
        return parts[0]
    batch = jax.tree.map(lambda *a: np.concatenate(a), *[b for b, _ in parts])
    stats = [st for _, st in parts]
    total = PackStats(rows=sum(st.rows for st in stats), row_len=stats[0].row_len,
                      **{f: sum(getattr(st, f) for st in stats)
                         for f in ("sequences", "tokens", "truncated_sequences", "truncated_tokens")})
    return batch, total


def split_micro(batch: PackedBatch, rows_per_micro: int) -> PackedBatch:
    """[rows, L] -> [rows // rows_per_micro, rows_per_micro, L] (rows must divide evenly)."""
    rows = batch.tokens.shape[0]
    if rows % rows_per_micro:
        raise ValueError(f"{rows} rows do not split into micro-batches of {rows_per_micro}; "
                         "pack with rows_multiple=rows_per_micro")
    return jax.tree.map(lambda a: a.reshape(rows // rows_per_micro, rows_per_micro, *a.shape[1:]), batch)


def pad_micro(batch: PackedBatch, num_micro: int) -> PackedBatch:
    """Appends all-padding micro-batches up to `num_micro` (to reuse one compiled step)."""
    have = batch.num_micro
    if batch.tokens.ndim != 3 or have > num_micro:
        raise ValueError(f"need a [micro, rows, L] batch with at most {num_micro} micro-batches")

    def grow(a, fill=0):
        pad = np.full((num_micro - have, *a.shape[1:]), fill, a.dtype)
        return np.concatenate([np.asarray(a), pad])

    return jax.tree.map(grow, batch).replace(seq_index=grow(batch.seq_index, -1))
