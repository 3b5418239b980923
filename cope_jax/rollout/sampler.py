"""Batched generation with a preallocated per-row KV cache, stop sequences and multi-turn reuse.

A `SamplerState` is a fixed-capacity batch of rows (one episode each), every row with its own cache
slots. The rollout loop drives it with four calls:

    state = sampler.start(prompts)                     # prefill prompts into free rows
    out = sampler.generate(state, rows, max_new_tokens=..., temperature=..., key=...)
    fits = sampler.extend(state, rows, observation_ids)  # prefill only the new tokens
    sampler.free(state, rows)                          # the row can start a new episode

Invariant: every live row holds all of its tokens but the last in the cache; the last one is the
row's *next input*. A generation step feeds the next input and samples the next one, so a prompt,
a finished turn and an appended observation all continue the same way, and extending a row
prefills exactly [next input, new[:-1]]. A row holds at most `max_len` tokens; a turn that runs into
that limit finishes with `context_full`, and an `extend` or `start` that does not fit marks the row
full (it then only reports `context_full`); nothing is ever truncated.

`start` prefills each distinct prompt once, in a cache of its own with one row per distinct prompt,
and copies its slots into every row that starts with it: the episodes of a group, which share their
prompt, cost one prefill (`decode.share`). The rows' tokens and log-probs are those of prefilling
each row on its own.

This module is the host side: rows, validation, bucketing and streaming. The jitted programs it
calls (`prefill`, `decode_start`, `decode_loop`, `decode_end`) are `cope_jax/rollout/decode.py`.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cope_jax.rollout.decode import (CONTEXT_FULL, FINISH_REASONS, IDLE_ROW_KNOBS, LENGTH, RowLayout, abstract_cache,
                             abstract_window, bucket, decode_end, decode_loop, decode_start, eos_array, new_run,
                             power_buckets, prefill, report_finished, row_buckets, row_keys, share, stop_array,
                             unrolled_params)
from cope_jax.rollout.sampling import draw_of
from models import attention as attn
from models import sharding as shd
from models import qwen
from models.qwen import KVCache

# where the sampler runs the layers on its own per-layer copy of the weights by default (`Sampler`)
UNROLLED_PLATFORMS = ("cpu",)


@dataclasses.dataclass
class SamplerState:
    """The rows of a sampler. Device: the cache and each row's next input. Host: mirrors used for
    bucketing and validation, so no call waits on a device-to-host copy to plan its work."""

    cache: KVCache
    next_input: jax.Array  # [B] int32: each live row's last token, not yet in the cache
    cached: np.ndarray  # [B] int64: tokens in the cache per row (mirror of cache.lengths)
    live: np.ndarray  # [B] bool: the row holds a sequence
    full: np.ndarray  # [B] bool: a start/extend did not fit; generate reports context_full
    prefilled: int = 0  # tokens `start` and `extend` put into the cache (a shared prompt once)

    @property
    def batch_size(self) -> int:
        return len(self.live)

    def num_tokens(self) -> np.ndarray:
        """[B]: tokens each row holds (cached + next input); 0 for free rows."""
        return np.where(self.live, self.cached + 1, 0)

    def free_rows(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(~self.live)]


@dataclasses.dataclass(frozen=True)
class Generation:
    """One assistant turn per requested row, in request order."""

    rows: list[int]
    tokens: list[np.ndarray]  # int32 ids, EOS / stop sequence included
    logprobs: list[np.ndarray]  # float32: log-softmax of logits / temperature at each sampled token
    finish_reasons: list[str]  # "eos" | "stop" | "length" | "context_full"


class Sampler:
    """Generation over `model` (a `models.Qwen`) for a fixed batch of rows of `max_len` tokens.

    eos_ids: token ids that end a turn (default: the model config's eos_token_id).
    min_window / prefill_chunk: smallest cache window compiled, longest append done in one call
    (longer ones are prefilled in chunks). The model's parameters are read at every call, so an
    optimizer updating the model in place is seen by the next turn without re-building anything.

    unroll_layers (default: on CPU, the platform of the model's mesh) runs the layers unrolled on
    per-layer copies of the weights in the decode layout (`Qwen.layer_params`), kept until the
    model's parameters change (and dropped after each rollout). XLA:CPU and XLA:GPU would otherwise
    copy each layer's weights out of the stacked arrays at every step (on GPU a dynamic-slice fusion
    per projection: a 7B decode step writes and reads 13 GB more than the 15 GB it must read); the
    fused QKV and gate-up matrices also launch fewer kernels, and XLA:CPU multiplies few rows faster
    by [out, in] matrices. It costs a second copy of the layer weights for the rollout's length: on
    a GPU with room for it, pass True (a 14B LoRA run on one H100 has none); the TPU compiler reads
    the stacked weights in place.
    """

    def __init__(self, model, *, batch_size: int, max_len: int, eos_ids: Sequence[int] | None = None,
                 cache_dtype=None, min_window: int = 128, prefill_chunk: int = 512,
                 unroll_layers: bool | None = None):
        if batch_size < 1 or max_len < 2:
            raise ValueError(f"need batch_size >= 1 and max_len >= 2, got {batch_size}, {max_len}")
        self.model, self.cfg, self.mesh = model, model.cfg, model.mesh
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        if eos_ids is None:
            eos = self.cfg.eos_token_id
            eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self._check_ids(self.eos_ids, "eos_ids")
        self.cache_dtype = jnp.dtype(cache_dtype or self.cfg.dtype)
        self.unroll = (attn.platform_of(self.mesh) in UNROLLED_PLATFORMS if unroll_layers is None
                       else bool(unroll_layers))
        self._layer_params_of: list[weakref.ref] = []  # the parameter arrays the unrolled copy was made from
        self._layer_params = None
        self._unused_key = None
        # a call gathers its rows, so idle rows cost it nothing, unless the mesh splits rows over
        # devices: then they stay in place (moving caches across devices costs more than their reads)
        self.gather = self.mesh is None or shd.logical_to_spec(("batch",), (self.batch_size,), self.mesh)[0] is None
        self.row_buckets = row_buckets(self.batch_size) if self.gather else (self.batch_size,)
        # rows of the prompts' own cache: split over devices like the rows (a multiple of their ways)
        ways = 1 if self.gather else self.batch_size // self._row_shard()
        self.prompt_buckets = tuple(b for b in row_buckets(self.batch_size) if b % ways == 0)
        self.windows = power_buckets(min(min_window, self.max_len), self.max_len)
        self.chunks = power_buckets(min(16, prefill_chunk), min(prefill_chunk, self.max_len))
        self._shardings = qwen.cache_shardings(self.cfg, self.batch_size, self.max_len, self.mesh)

    def _row_shard(self) -> int:
        """Rows of the batch each device holds."""
        return shd.named_sharding(("batch",), (self.batch_size,), self.mesh).shard_shape((self.batch_size,))[0]

    # -- rows --------------------------------------------------------------------------------------
    def init_state(self) -> SamplerState:
        """All rows free, cache zeroed (placed on the mesh when the model has one)."""
        return self._new_state(self.batch_size, self.max_len)

    def _new_state(self, rows: int, slots: int) -> SamplerState:
        cache = KVCache.zeros(self.cfg, rows, slots, dtype=self.cache_dtype, mesh=self.mesh)
        next_input = shd.shard_batch(np.zeros(rows, np.int32), self.mesh)
        return SamplerState(cache=cache, next_input=next_input, cached=np.zeros(rows, np.int64),
                            live=np.zeros(rows, bool), full=np.zeros(rows, bool))

    def start(self, prompts: Sequence[Sequence[int]], state: SamplerState | None = None,
              rows: Sequence[int] | None = None) -> SamplerState:
        """Starts one episode per prompt in `rows` (default: the first free rows) of `state`
        (default: a new one) and returns the state. A prompt longer than max_len marks its row full."""
        state = self.init_state() if state is None else state
        prompts = [self._as_ids(p, "prompt") for p in prompts]
        if rows is None:
            free = state.free_rows()
            if len(free) < len(prompts):
                raise ValueError(f"{len(prompts)} prompts but only {len(free)} free rows")
            rows = free[:len(prompts)]
        rows = self._check_rows(state, rows, len(prompts))
        for p in prompts:
            if not p:
                raise ValueError("empty prompt: a row needs at least one token")
        state.live[rows] = True
        state.cached[rows] = 0
        fits = np.array([len(p) <= self.max_len for p in prompts])
        state.full[rows] = ~fits
        ok = np.flatnonzero(fits)
        if len(ok):
            self._start_rows(state, rows[ok], [prompts[i] for i in ok])
        return state

    def _start_rows(self, state: SamplerState, rows: np.ndarray, prompts: list[list[int]]) -> None:
        """Prefills each distinct prompt once, in a state of its own (`prompt_buckets` rows, as
        many slots as the longest needs), and copies it into every row that starts with it."""
        distinct: dict[tuple[int, ...], int] = {}
        source = np.array([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], np.int32)
        unique = list(distinct)
        n = bucket(len(unique), self.prompt_buckets)
        window = bucket(max(1, max(len(p) for p in unique) - 1), self.windows)
        own = self._new_state(n, window)
        self._append(own, RowLayout(np.arange(len(unique)), n, (n,), gather=False), [p[:-1] for p in unique],
                     [-1] * len(unique), prepend=False, shardings=qwen.cache_shardings(self.cfg, n, window, self.mesh))
        lay = self._layout(rows)
        state.cache, state.next_input = share(state.cache, state.next_input, own.cache, lay.rows, lay(source, -1),
                                              lay(np.array([p[-1] for p in prompts], np.int32), 0), window=window,
                                              compact=lay.compact, shardings=self._shardings)
        state.cached[rows] = [len(p) - 1 for p in prompts]
        state.prefilled += sum(map(len, unique))

    def extend(self, state: SamplerState, rows: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Appends token_ids[i] to live row rows[i] (an observation turn), prefilling only them.

        Returns fits [len(rows)] bool; a row whose tokens do not fit is left as it was and marked
        full (its next generate reports context_full).
        """
        ids = [self._as_ids(t, "token_ids") for t in token_ids]
        rows = self._check_rows(state, rows, len(ids), live=True)
        fits = (state.num_tokens()[rows] + np.array([len(t) for t in ids], np.int64) <= self.max_len) \
            & ~state.full[rows]
        state.full[rows] |= ~fits
        keep = [i for i in range(len(rows)) if fits[i] and ids[i]]
        if keep:  # row tokens to append: [next input, ids[:-1]] (the leading 0 is replaced on device)
            self._append(state, self._layout(rows[keep]), [[0] + ids[i][:-1] for i in keep],
                         [ids[i][-1] for i in keep], prepend=True, shardings=self._shardings)
            state.prefilled += sum(len(ids[i]) for i in keep)
        return fits

    def free(self, state: SamplerState, rows: Sequence[int]) -> None:
        """Releases rows; they can `start` a new episode."""
        rows = self._check_rows(state, rows, None)
        state.live[rows] = False
        state.full[rows] = False
        state.cached[rows] = 0

    def generate(self, state: SamplerState, rows: Sequence[int] | None = None, max_new_tokens=256, *,
                 temperature=1.0, top_p=1.0, top_k=0, greedy=False,
                 stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] | None = None,
                 key=None, on_finish: Callable[[int, np.ndarray, np.ndarray, str], None] | None = None,
                 stream_every: int = 16) -> Generation:
        """One turn for `rows` (default: every live row); other rows stay idle.

        max_new_tokens, temperature, top_p, top_k, greedy: scalars or one value per row. A row ends
        at an EOS id ("eos"), right after a stop token sequence ("stop"), after max_new_tokens
        ("length"), or when it reaches max_len tokens ("context_full"). `key` is required when any
        row samples: a PRNG key or int seed (row r draws from fold_in(key, r)), or one PRNG key per
        requested row ([n] keys: a row's tokens then depend only on its key, whatever row or batch
        it runs in). Results are deterministic given it. `eos_ids` overrides the sampler's EOS ids
        for this call.

        on_finish(i, tokens, logprobs, finish_reason) streams the turns: it is called for request
        i as soon as its turn has ended, checked every `stream_every` steps, while the other rows
        go on decoding (the rollout hands the action to its environment there). The tokens do not
        depend on streaming. Of this sampler it may only call `free` (its row's episode ended);
        the returned Generation still holds every row.
        """
        rows = self._check_rows(state, np.flatnonzero(state.live) if rows is None else rows, None, live=True)
        n = len(rows)
        if n == 0:
            return Generation([], [], [], [])
        if stream_every < 1:
            raise ValueError(f"stream_every must be >= 1, got {stream_every}")
        max_new, knobs = _turn_knobs(n, max_new_tokens, temperature, top_k, top_p, greedy)
        keys = self._row_keys(key, rows, needed=not knobs["greedy"].all())
        stops = self._stop_array(stop_sequences)
        eos = eos_array(self.eos_ids if eos_ids is None else self._as_ids(eos_ids, "eos_ids"))
        room = np.where(state.full[rows], 0, self.max_len - state.num_tokens()[rows])
        step_limit = np.minimum(max_new, room)
        limit_code = np.where(max_new <= room, LENGTH, CONTEXT_FULL)
        toks, lps, counts, codes = self._decode_turn(state, rows, knobs, step_limit, limit_code, eos, stops, keys,
                                                     on_finish, stream_every)
        return Generation(rows=[int(r) for r in rows],
                          tokens=[toks[i, :counts[i]].astype(np.int32) for i in range(n)],
                          logprobs=[lps[i, :counts[i]].astype(np.float32) for i in range(n)],
                          finish_reasons=[FINISH_REASONS[c] for c in codes])

    # -- internals ---------------------------------------------------------------------------------
    def _decode_turn(self, state: SamplerState, rows: np.ndarray, knobs: dict, step_limit, limit_code, eos, stops,
                     keys, on_finish, stream_every: int):
        """Decodes one turn of `generate`: (tokens [n, S], logprobs [n, S], counts [n], finish codes [n])."""
        n = len(rows)
        lay = self._layout(rows)
        steps = bucket(max(1, int(step_limit.max())), power_buckets(16, self.max_len))
        window = bucket(max(1, int((state.cached[rows] + step_limit).max())), self.windows)
        draw = draw_of(**knobs)
        knobs = {k: lay(v, IDLE_ROW_KNOBS[k]) for k, v in knobs.items()}
        reported = step_limit <= 0  # rows with no room left end at once
        if on_finish is not None:
            for i in np.flatnonzero(reported):
                on_finish(int(i), np.zeros(0, np.int32), np.zeros(0, np.float32), FINISH_REASONS[limit_code[i]])
        if reported.all():
            return np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32), np.zeros(n, np.int64), limit_code
        graphdef, params, layer_params, run, args = self._turn_inputs(state, lay, knobs, step_limit, limit_code, eos,
                                                                 stops, keys, window=window, steps=steps)
        chunk, until = (stream_every if on_finish is not None else steps), 0
        try:
            while not reported.all():
                if until >= steps:
                    raise RuntimeError("decode loop ended with rows still running")  # step_limit <= steps
                until = min(until + chunk, steps)
                run = decode_loop(graphdef, params, layer_params, run, np.int32(until), *args, draw=draw)
                report_finished(run, lay.index, reported, on_finish)
        finally:  # the cache holds what was decoded, even if a callback raised
            state.cache, state.next_input = decode_end(state.cache, state.next_input, run["cache"], run["next_input"],
                                                       lay.rows, window=window, compact=lay.compact,
                                                       shardings=self._shardings)
            counts = np.asarray(run["n"])[lay.index].astype(np.int64)
            state.cached[rows] += np.where(state.live[rows], counts, 0)  # a callback may free its row
        toks, lps, codes = (np.asarray(run[k])[lay.index] for k in ("tokens", "logprobs", "code"))
        return toks, lps, counts, codes

    def _append(self, state: SamplerState, lay: RowLayout, appends: list[list[int]], next_inputs: list[int],
                *, prepend: bool, shardings) -> None:
        """Prefills appends[i] into row lay.rows[lay.index[i]] of `state` in chunks of at most
        prefill_chunk tokens, then sets the rows' next inputs (-1: keeps it). With `prepend`,
        appends[i][0] stands for the row's next input."""
        rows = lay.rows[lay.index]
        lengths = np.array([len(a) for a in appends], np.int64)
        chunk = self.chunks[-1]
        n_chunks = max(1, -(-int(lengths.max()) // chunk))
        n = len(rows)
        for c in range(n_chunks):
            part = [a[c * chunk:(c + 1) * chunk] for a in appends]
            counts = np.array([len(p) for p in part], np.int64)
            T = bucket(max(1, int(counts.max())), self.chunks)
            tokens = np.zeros((n, T), np.int32)
            for i, p in enumerate(part):
                tokens[i, :len(p)] = p
            last = c == n_chunks - 1
            after = state.cached[rows] + counts
            window = bucket(max(1, int(after.max())), self.windows)
            args, static = self._prefill_inputs(state, lay, tokens, counts, np.full(n, prepend and c == 0),
                                                np.array(next_inputs) if last else np.full(n, -1),
                                                window=window, shardings=shardings)
            state.cache, state.next_input = prefill(*args, **static)
            state.cached[rows] = after

    def _prefill_inputs(self, state, lay, tokens, counts, prepend, set_next_input, *, window: int,
                        shardings):
        """`prefill`'s (arguments, static arguments) for one chunk of appends ([n] arrays per row)."""
        graphdef, params, layer_params = self._params()
        args = (graphdef, params, layer_params, state.cache, state.next_input, lay.rows, lay(tokens, 0), lay(counts, 0),
                lay(prepend, False), lay(set_next_input, -1))
        return args, dict(window=window, compact=lay.compact, shardings=shardings)

    def _turn_inputs(self, state, lay, knobs, step_limit, limit_code, eos, stops, keys, *, window: int, steps: int,
                     start=None):
        """`decode_loop`'s inputs for one turn: (graphdef, params, layer_params, run, per-call arguments).
        `start` takes the turn's cache window (default `decode_start`)."""
        graphdef, params, layer_params = self._params()
        args = (knobs, lay(step_limit, 0), lay(limit_code, 0), eos, stops, keys[lay(np.arange(len(step_limit)), 0)])
        cache, next_input = (start or decode_start)(state.cache, state.next_input, lay.rows, window=window,
                                                    compact=lay.compact)
        run = new_run(cache, next_input, lay(step_limit, 0), lay(limit_code, 0), steps, stops.shape[1])
        return graphdef, params, layer_params, run, args

    # -- ahead-of-time compilation -------------------------------------------------------------------
    def abstract_state(self, rows: int | None = None, slots: int | None = None) -> SamplerState:
        """Every row live, the cache as abstract arrays laid out as `init_state` lays them out (or
        as a state of `rows` x `slots`, the prompts' own, is)."""
        rows, slots = rows or self.batch_size, slots or self.max_len
        cache, next_input = abstract_cache(self.cfg, rows, slots, self.cache_dtype, self.mesh)
        return SamplerState(cache=cache, next_input=next_input, cached=np.zeros(rows, np.int64),
                            live=np.ones(rows, bool), full=np.zeros(rows, bool))

    def lower(self, max_new_tokens: int, rows: int | None = None, *, group_size: int = 1,
              prompt_len: int | None = None) -> dict[str, Callable[[], "jax.stages.Lowered"]]:
        """The sampler's programs at the largest shapes a run gives them, each lowered on abstract
        inputs (nothing allocated) when called: "prefill" (every row, or a call of the first `rows`,
        a full chunk into the whole cache window), "prefill@group" (a first turn's prompts of
        `prompt_len` tokens, default max_len: one row per group of `group_size` of those rows, a
        chunk into the prompts' own state) and "decode" (a turn of `max_new_tokens` steps).
        `launch.plan` compiles them for a target."""
        state = self.abstract_state()
        rows = np.arange(self.batch_size if rows is None else rows)
        n = len(rows)
        lay, window = self._layout(rows), self.windows[-1]
        chunk = self.chunks[-1]
        groups, group_chunk, slots = self.group_prefill_shape(n, group_size, prompt_len or self.max_len)

        def prefill_program(state, lay, n, T, window):
            args, static = self._prefill_inputs(state, lay, np.zeros((n, T), np.int32), np.full(n, T),
                                                np.zeros(n, bool), np.full(n, -1), window=window,
                                                shardings=qwen.cache_shardings(self.cfg, state.batch_size, state.cache.max_len, self.mesh))
            return prefill.lower(*args, **static)

        def decode_program():
            steps = bucket(min(max_new_tokens, self.max_len), power_buckets(16, self.max_len))
            knobs = dict(temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                         top_p=np.ones(n, np.float32), greedy=np.zeros(n, bool))
            graphdef, params, layer_params, run, call_args = self._turn_inputs(
                state, lay, {k: lay(v, IDLE_ROW_KNOBS[k]) for k, v in knobs.items()}, np.full(n, steps),
                np.full(n, LENGTH), eos_array(self.eos_ids), self._stop_array(()),
                self._row_keys(0, rows, needed=True), window=window, steps=steps, start=abstract_window)
            return decode_loop.lower(graphdef, params, layer_params, run, np.int32(steps), *call_args, draw=draw_of(**knobs))

        return {"prefill": lambda: prefill_program(state, lay, n, chunk, window),
                "prefill@group": lambda: prefill_program(
                    self.abstract_state(groups, slots), RowLayout(np.arange(groups), groups, (groups,), gather=False),
                    groups, group_chunk, slots),
                "decode": decode_program}

    def group_prefill_shape(self, rows: int, group_size: int, prompt_len: int) -> tuple[int, int, int]:
        """(prompt rows, chunk, cache slots) of the largest first-turn prefill of `rows` rows in
        groups of `group_size` with prompts of `prompt_len` tokens: one prompt row per group."""
        slots = bucket(prompt_len, self.windows)
        return (bucket(-(-rows // group_size), self.prompt_buckets), bucket(min(self.chunks[-1], slots), self.chunks),
                slots)

    def _params(self):
        """(graphdef, params, the unrolled per-layer copy or None), re-making the unrolled copy only when the
        model's parameter arrays changed (an optimizer step replaces them)."""
        graphdef, params = nnx.split(self.model)
        if not self.unroll:
            return graphdef, params, None
        leaves = jax.tree.leaves(params)
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):  # lowering ahead of time (`lower`)
            return graphdef, params, _abstract_layer_params(graphdef, params)
        if len(leaves) != len(self._layer_params_of) or any(r() is not a for r, a in zip(self._layer_params_of, leaves)):
            self._layer_params = None  # drop the stale copy before making the new one
            self._layer_params = unrolled_params(graphdef, params)
            self._layer_params_of = [weakref.ref(a) for a in leaves]
        return graphdef, params, self._layer_params

    def drop_unrolled_params(self) -> None:
        """Frees the per-layer copy of the weights (if any); the next call makes it again."""
        self._layer_params, self._layer_params_of = None, []

    def _layout(self, rows: np.ndarray) -> RowLayout:
        return RowLayout(rows, self.batch_size, self.row_buckets, self.gather)

    def _check_rows(self, state: SamplerState, rows, count: int | None, live: bool = False) -> np.ndarray:
        rows = np.asarray(rows, np.int64).reshape(-1)
        if count is not None and len(rows) != count:
            raise ValueError(f"got {len(rows)} rows for {count} sequences")
        if len(rows) and (rows.min() < 0 or rows.max() >= state.batch_size):
            raise ValueError(f"rows {rows.tolist()} out of range [0, {state.batch_size})")
        if len(set(rows.tolist())) != len(rows):
            raise ValueError(f"rows {rows.tolist()} repeat a row")
        if live and not state.live[rows].all():
            raise ValueError(f"rows {rows[~state.live[rows]].tolist()} are free: start them first")
        return rows

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what} has ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")

    def _as_ids(self, ids, what: str) -> list[int]:
        out = [int(i) for i in np.asarray(ids).reshape(-1)]
        self._check_ids(out, what)
        return out

    def _stop_array(self, stop_sequences) -> np.ndarray:
        seqs = [self._as_ids(s, "stop sequence") for s in stop_sequences]
        if any(not s for s in seqs):
            raise ValueError("empty stop sequence")
        return stop_array(seqs)

    def _row_keys(self, key, rows: np.ndarray, *, needed: bool) -> jax.Array:
        """[n] typed PRNG keys, one per requested row (see `generate`)."""
        if key is None:
            if needed:
                raise ValueError("sampling (temperature > 0 and not greedy) needs a PRNG key: pass key=")
            if self._unused_key is None:
                self._unused_key = jax.random.key(0)  # greedy calls: any key, made once
            key = self._unused_key
        return row_keys(key, rows)


def _per_row(value, n: int, dtype, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full(n, arr, dtype)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or one value per row ({n}), got shape {arr.shape}")
    return arr


def _turn_knobs(n: int, max_new_tokens, temperature, top_k, top_p, greedy) -> tuple[np.ndarray, dict]:
    """(max_new_tokens [n], the sampling knobs as [n] arrays), checked; temperature 0 samples greedily."""
    max_new = _per_row(max_new_tokens, n, np.int64, "max_new_tokens")
    knobs = dict(temperature=_per_row(temperature, n, np.float32, "temperature"),
                 top_k=_per_row(top_k, n, np.int32, "top_k"), top_p=_per_row(top_p, n, np.float32, "top_p"),
                 greedy=_per_row(greedy, n, bool, "greedy"))
    checks = [(max_new >= 1, "max_new_tokens must be >= 1"),
              (np.isfinite(knobs["temperature"]) & (knobs["temperature"] >= 0), "temperature must be finite and >= 0"),
              (knobs["top_k"] >= 0, "top_k must be >= 0 (0 = off)"),
              ((knobs["top_p"] > 0) & (knobs["top_p"] <= 1), "top_p must be in (0, 1]")]
    for ok, msg in checks:
        if not np.all(ok):
            raise ValueError(msg)
    knobs["greedy"] = knobs["greedy"] | (knobs["temperature"] == 0)
    return max_new, knobs


def _abstract_layer_params(graphdef, params):
    """`unrolled_params` of abstract parameters: its shapes, on the shardings its program gives them."""
    shapes = jax.eval_shape(unrolled_params, graphdef, params)
    shardings = unrolled_params.lower(graphdef, params).compile().output_shardings
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
