"""Batched generation with a preallocated per-row KV cache, stop sequences and multi-turn reuse.

A `SamplerState` is a fixed-capacity batch of rows (one episode each), every row with its own cache
slots. The rollout loop drives it with four calls:

    state = sampler.start(prompts)                     # prefill prompts into free rows
    out = sampler.generate(state, rows, max_new_tokens=..., temperature=..., key=...)
    fits = sampler.extend(state, rows, observation_ids)  # prefill only the new tokens
    sampler.free(state, rows)                          # the slot can start a new episode

Invariant: every live row holds all of its tokens but the last in the cache; the last one is the
row's *pending* token. A generation step feeds the pending token and samples the next one, so a
prompt, a finished turn and an appended observation all continue the same way, and extending a row
prefills exactly [pending, new[:-1]]. A row holds at most `max_len` tokens; a turn that runs into
that limit finishes with `context_full`, and an `extend` or `start` that does not fit marks the row
full (it then only reports `context_full`); nothing is ever truncated.

Device work happens in jitted functions on a *window* of the cache: the participating rows
(gathered into a power-of-two bucket on a single device; all rows, in place, under a multi-device
mesh so caches never move between devices) and the first W slots (W a power-of-two bucket covering
the longest row), so the cost of a step follows the rows' real lengths, not `max_len`. `_prefill`
appends tokens; a turn is `_decode_start` (take the window), `_decode_loop` (a `lax.while_loop`
over single-token steps, resumable, so a streamed turn hands finished rows to the host every few
steps while the window stays on the device) and `_decode_end` (write it back). The state is
donated, so the cache is updated in place; only token ids, logprobs and finish codes cross to the
host.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cope_jax.sampling import sample_tokens, stop_matched, token_logprobs
from models import sharding as shd
from models.qwen import CACHE_AXES, KVCache

# finish code -> reason; 0 means "still running" and never leaves the device loop
FINISH_REASONS = ("running", "eos", "stop", "length", "context_full")
EOS, STOP, LENGTH, CONTEXT_FULL = 1, 2, 3, 4
# knobs of rows a call does not run (bucket padding, other rows under a mesh): greedy and unfiltered,
# so they never send a step down the sorting top-k / top-p path (a sort over the vocabulary)
_IDLE_ROW_KNOBS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": True}


@dataclasses.dataclass
class SamplerState:
    """The rows of a sampler. Device: the cache and each row's pending token. Host: mirrors used
    for bucketing and validation, so no call waits on a device-to-host copy to plan its work."""

    cache: KVCache
    pending: jax.Array  # [B] int32: each live row's last token, not yet in the cache
    cached: np.ndarray  # [B] int64: tokens in the cache per row (mirror of cache.lengths)
    live: np.ndarray  # [B] bool: the row holds a sequence
    full: np.ndarray  # [B] bool: a start/extend did not fit; generate reports context_full

    @property
    def batch_size(self) -> int:
        return len(self.live)

    def num_tokens(self) -> np.ndarray:
        """[B]: tokens each row holds (cached + pending); 0 for free rows."""
        return np.where(self.live, self.cached + 1, 0)

    def free_rows(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(~self.live)]


@dataclasses.dataclass(frozen=True)
class Generation:
    """One assistant turn per requested row, in request order."""

    rows: list[int]
    tokens: list[np.ndarray]  # int32 ids, EOS / stop sequence included
    logprobs: list[np.ndarray]  # float32: log-softmax of the raw logits at each sampled token
    finish_reasons: list[str]  # "eos" | "stop" | "length" | "context_full"


def power_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """(lo, 2lo, 4lo, ..., hi): the compiled sizes for a dimension that ranges up to hi."""
    out, v = [], max(1, lo)
    while v < hi:
        out.append(v)
        v *= 2
    return tuple(out) + (hi,)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


# -- device functions ------------------------------------------------------------------------------
def _take(cache: KVCache, pending, rows, window: int, compact: bool):
    """The window of the cache that a call works on: rows (compact) x slots [0, window)."""
    if not compact:
        return KVCache(k=cache.k[:, :, :window], v=cache.v[:, :, :window], lengths=cache.lengths), pending
    idx = jnp.minimum(rows, cache.lengths.shape[0] - 1)  # padding rows (index B) read row B-1
    sub = KVCache(k=cache.k[:, idx, :window], v=cache.v[:, idx, :window], lengths=cache.lengths[idx])
    return sub, pending[idx]


def _put(cache: KVCache, pending, sub: KVCache, sub_pending, rows, window: int, compact: bool):
    """Writes a window back in place; padding rows (index B) are dropped."""
    if not compact:
        k = jax.lax.dynamic_update_slice_in_dim(cache.k, sub.k, 0, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(cache.v, sub.v, 0, axis=2)
        return KVCache(k=k, v=v, lengths=sub.lengths), sub_pending
    k = cache.k.at[:, rows, :window].set(sub.k, mode="drop")
    v = cache.v.at[:, rows, :window].set(sub.v, mode="drop")
    lengths = cache.lengths.at[rows].set(sub.lengths, mode="drop")
    return KVCache(k=k, v=v, lengths=lengths), pending.at[rows].set(sub_pending, mode="drop")


@functools.partial(jax.jit, static_argnames=("graphdef", "window", "compact", "shardings"),
                   donate_argnames=("cache", "pending"))
def _prefill(graphdef, params, weights, cache, pending, rows, tokens, num_new, prepend, new_pending, reset, *,
             window: int, compact: bool, shardings):
    """Appends tokens[r, :num_new[r]] to each row (R rows, T = tokens.shape[1]).

    rows [R] (compact: state rows, padding = B); tokens [R, T]; prepend [R] bool: tokens[r, 0] is
    replaced by the row's pending token (extension); new_pending [R] (-1: keep); reset [R] bool:
    the row starts empty (a new episode in a reused slot). weights: `_unrolled_weights` or None.
    """
    model = nnx.merge(graphdef, params)
    sub, sub_pending = _take(cache, pending, rows, window, compact)
    sub = sub.replace(lengths=jnp.where(reset, 0, sub.lengths))
    tokens = tokens.at[:, 0].set(jnp.where(prepend, sub_pending, tokens[:, 0]))
    _, sub = model.decode(tokens, num_new, sub, weights)
    sub_pending = jnp.where(new_pending >= 0, new_pending, sub_pending)
    return _constrain(_put(cache, pending, sub, sub_pending, rows, window, compact), shardings)


@functools.partial(jax.jit, static_argnames=("window", "compact"))
def _decode_start(cache, pending, rows, *, window: int, compact: bool):
    """The window of the cache a turn decodes (`_take`): the loop carries it until `_decode_end`."""
    return _take(cache, pending, rows, window, compact)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("run",))
def _decode_loop(graphdef, params, weights, run, until, knobs, max_steps, limit_code, eos_ids, stops, row_keys):
    """Continues a turn's single-token steps (one `lax.while_loop`) until step `until` or every row is done.

    run: the turn's progress, carried from call to call (`_new_run`): step, done [R], code [R],
    n [R], tokens / logprobs [R, steps], tail [R, M], and the window's cache and pending tokens;
    a turn takes one call, or several when streaming hands finished rows over between them.
    Sampling folds the global step into each row's key, so the tokens do not depend on how the turn
    is split. knobs: dict of [R] arrays (temperature, top_k, top_p, greedy); limit_code [R]: the
    finish code when max_steps runs out (LENGTH or CONTEXT_FULL); eos_ids [E] (-1 padded); stops
    [N, M] (see `stop_matched`); row_keys [R] PRNG keys.
    """
    model = nnx.merge(graphdef, params)

    def cond(s):
        return (s["step"] < until) & ~jnp.all(s["done"])

    def body(s):
        active = ~s["done"]
        h, new_cache = model.decode(s["pending"][:, None], active.astype(jnp.int32), s["cache"], weights)
        logits = model.unembed(h[:, 0], decode_layout=weights is not None)
        # a row's randomness depends only on (its key, step): not on which other rows run
        tok = sample_tokens(logits, lambda: jax.vmap(lambda k: jax.random.fold_in(k, s["step"]))(row_keys), **knobs)
        lp = token_logprobs(logits, tok)
        n = s["n"] + active
        tail = jnp.where(active[:, None], jnp.concatenate([s["tail"][:, 1:], tok[:, None]], 1), s["tail"])
        now = jnp.select([jnp.isin(tok, eos_ids), stop_matched(tail, stops), n >= max_steps],
                         [EOS, STOP, limit_code], 0)
        finished = active & (now > 0)
        col = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], s["step"], axis=1)
        return dict(step=s["step"] + 1, cache=new_cache, pending=jnp.where(active, tok, s["pending"]),
                    done=s["done"] | finished, code=jnp.where(finished, now, s["code"]), n=n,
                    tokens=col(s["tokens"], tok), logprobs=col(s["logprobs"], lp), tail=tail)

    return jax.lax.while_loop(cond, body, run)


@functools.partial(jax.jit, static_argnames=("window", "compact", "shardings"), donate_argnames=("cache", "pending"))
def _decode_end(cache, pending, sub, sub_pending, rows, *, window: int, compact: bool, shardings):
    """Writes the decoded window back into the (donated) cache."""
    return _constrain(_put(cache, pending, sub, sub_pending, rows, window, compact), shardings)


def _abstract_window(cache: KVCache, pending, rows, *, window: int, compact: bool):
    """`_decode_start`'s result as abstract arrays in the cache's layout (for lowering)."""
    sub, sub_pending = _decode_start.eval_shape(cache, pending, rows, window=window, compact=compact)
    like = lambda a, ref: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=ref.sharding)
    return (KVCache(k=like(sub.k, cache.k), v=like(sub.v, cache.v), lengths=like(sub.lengths, cache.lengths)),
            like(sub_pending, pending))


def _new_run(cache: KVCache, pending, max_steps: np.ndarray, limit_code: np.ndarray, steps: int, tail: int) -> dict:
    """A turn before its first step (see `_decode_loop`): the window's cache and pending tokens
    (`_decode_start`) and host arrays for the rest."""
    R = len(max_steps)
    done = max_steps <= 0
    return dict(step=np.int32(0), cache=cache, pending=pending, done=done,
                code=np.where(done, limit_code, 0).astype(np.int32), n=np.zeros(R, np.int32),
                tokens=np.zeros((R, steps), np.int32), logprobs=np.zeros((R, steps), np.float32),
                tail=np.full((R, tail), -1, np.int32))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _unrolled_weights(graphdef, params):
    """Per-layer weight dicts in the decode layout (`Qwen.layer_weights`)."""
    return nnx.merge(graphdef, params).layer_weights()


@jax.jit
def _fold_in_each(key, values):
    """[n] keys fold_in(key, values[i])."""
    return jax.vmap(lambda v: jax.random.fold_in(key, v))(values)


def _constrain(state, shardings):
    """Keeps (cache, pending) on the state's shardings, so donated buffers are reused in place and
    the next call sees the same input shardings (no recompile)."""
    return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


# -- host side -------------------------------------------------------------------------------------
class Sampler:
    """Generation over `model` (a `models.Qwen`) for a fixed batch of rows of `max_len` tokens.

    eos_ids: token ids that end a turn (default: the model config's eos_token_id).
    min_window / prefill_chunk: smallest cache window compiled, longest append done in one call
    (longer ones are prefilled in chunks). The model's parameters are read at every call, so an
    optimizer updating the model in place is seen by the next turn without re-building anything.

    unroll_layers (default: on CPU) runs the layers unrolled on per-layer copies of the weights in
    the decode layout (`Qwen.layer_weights`), kept until the model's parameters change: XLA:CPU
    would otherwise copy each layer's weights out of the stacked arrays at every step, and
    multiplies few rows faster by [out, in] matrices. It costs a second copy of the layer weights,
    so it is off on accelerators.
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
        self.unroll = jax.default_backend() == "cpu" if unroll_layers is None else bool(unroll_layers)
        self._weights_for: list[weakref.ref] = []  # the parameter arrays the unrolled copy was made from
        self._weights = None
        self._unused_key = None
        # under a multi-device mesh rows stay in place (moving caches across devices costs more
        # than computing idle rows); on one device the participating rows are gathered
        self.compact = self.mesh is None or self.mesh.size == 1
        self.row_buckets = power_buckets(1, self.batch_size) if self.compact else (self.batch_size,)
        self.windows = power_buckets(min(min_window, self.max_len), self.max_len)
        self.chunks = power_buckets(min(16, prefill_chunk), min(prefill_chunk, self.max_len))
        self._shardings = self._state_shardings()

    def _state_shardings(self):
        if self.mesh is None:
            return None
        cfg, B = self.cfg, self.batch_size
        shape = (cfg.num_layers, B, self.max_len, cfg.num_kv_heads, cfg.head_dim)
        kv = shd.named_sharding(CACHE_AXES, shape, self.mesh)
        batch = shd.named_sharding(("batch",), (B,), self.mesh)
        return KVCache(k=kv, v=kv, lengths=batch), batch

    # -- rows --------------------------------------------------------------------------------------
    def init_state(self) -> SamplerState:
        """All rows free, cache zeroed (placed on the mesh when the model has one)."""
        B = self.batch_size
        cache = KVCache.zeros(self.cfg, B, self.max_len, dtype=self.cache_dtype, mesh=self.mesh)
        pending = shd.shard_batch(np.zeros(B, np.int32), self.mesh)
        return SamplerState(cache=cache, pending=pending, cached=np.zeros(B, np.int64),
                            live=np.zeros(B, bool), full=np.zeros(B, bool))

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
        ok = [i for i in range(len(rows)) if fits[i]]
        self._append(state, [rows[i] for i in ok], [prompts[i][:-1] for i in ok],
                     [prompts[i][-1] for i in ok], prepend=False, reset=True)
        return state

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
        # row tokens to append: [pending, ids[:-1]] (the leading 0 is replaced on device)
        self._append(state, [rows[i] for i in keep], [[0] + ids[i][:-1] for i in keep], [ids[i][-1] for i in keep],
                     prepend=True, reset=False)
        return fits

    def free(self, state: SamplerState, rows: Sequence[int]) -> None:
        """Releases rows; their slots can `start` a new episode."""
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
        max_new = _per_row(max_new_tokens, n, np.int64, "max_new_tokens")
        knobs = dict(temperature=_per_row(temperature, n, np.float32, "temperature"),
                     top_k=_per_row(top_k, n, np.int32, "top_k"), top_p=_per_row(top_p, n, np.float32, "top_p"),
                     greedy=_per_row(greedy, n, bool, "greedy"))
        _check_knobs(max_new, **knobs)
        knobs["greedy"] = knobs["greedy"] | (knobs["temperature"] == 0)
        keys = self._row_keys(key, rows, needed=not knobs["greedy"].all())
        stops = self._stop_array(stop_sequences)
        eos = self._eos_array(self.eos_ids if eos_ids is None else self._as_ids(eos_ids, "eos_ids"))

        room = np.where(state.full[rows], 0, self.max_len - state.num_tokens()[rows])
        max_steps = np.minimum(max_new, room)
        limit_code = np.where(max_new <= room, LENGTH, CONTEXT_FULL)
        lay = self._layout(rows)
        steps = _bucket(max(1, int(max_steps.max())), power_buckets(16, self.max_len))
        window = _bucket(max(1, int((state.cached[rows] + max_steps).max())), self.windows)
        knobs = {k: lay(v, _IDLE_ROW_KNOBS[k]) for k, v in knobs.items()}
        reported = max_steps <= 0  # rows with no room left end at once
        if on_finish is not None:
            for i in np.flatnonzero(reported):
                on_finish(int(i), np.zeros(0, np.int32), np.zeros(0, np.float32), FINISH_REASONS[limit_code[i]])
        if reported.all():
            toks, lps = np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32)
            counts, codes = np.zeros(n, np.int64), limit_code
        else:
            graphdef, params, weights, run, args = self._turn_inputs(state, lay, knobs, max_steps, limit_code, eos,
                                                                     stops, keys, window=window, steps=steps)
            chunk, until = (stream_every if on_finish is not None else steps), 0
            try:
                while not reported.all():
                    if until >= steps:
                        raise RuntimeError("decode loop ended with rows still running")  # max_steps <= steps
                    until = min(until + chunk, steps)
                    run = _decode_loop(graphdef, params, weights, run, np.int32(until), *args)
                    done, now = (np.asarray(run[k])[lay.index] for k in ("done", "n"))
                    new = np.flatnonzero(done & ~reported)
                    reported |= done
                    if on_finish is not None and len(new):
                        toks, lps, codes = (np.asarray(run[k])[lay.index] for k in ("tokens", "logprobs", "code"))
                        for i in new:
                            on_finish(int(i), toks[i, :now[i]].astype(np.int32),
                                      lps[i, :now[i]].astype(np.float32), FINISH_REASONS[codes[i]])
            finally:  # the cache holds what was decoded, even if a callback raised
                state.cache, state.pending = _decode_end(state.cache, state.pending, run["cache"], run["pending"],
                                                         lay.rows, window=window, compact=self.compact,
                                                         shardings=self._shardings)
                counts = np.asarray(run["n"])[lay.index].astype(np.int64)
                state.cached[rows] += np.where(state.live[rows], counts, 0)  # a callback may free its row
            toks, lps, codes = (np.asarray(run[k])[lay.index] for k in ("tokens", "logprobs", "code"))
        return Generation(rows=[int(r) for r in rows],
                          tokens=[toks[i, :counts[i]].astype(np.int32) for i in range(n)],
                          logprobs=[lps[i, :counts[i]].astype(np.float32) for i in range(n)],
                          finish_reasons=[FINISH_REASONS[c] for c in codes])

    # -- internals ---------------------------------------------------------------------------------
    def _append(self, state: SamplerState, rows: list[int], appends: list[list[int]], new_pending: list[int],
                *, prepend: bool, reset: bool) -> None:
        """Prefills appends[i] into rows[i] in chunks of at most prefill_chunk tokens, then sets the
        rows' pending tokens. With `prepend`, appends[i][0] stands for the row's pending token."""
        if not rows:
            return
        lengths = np.array([len(a) for a in appends], np.int64)
        lay = self._layout(np.array(rows))
        chunk = self.chunks[-1]
        n_chunks = max(1, -(-int(lengths.max()) // chunk))
        n = len(rows)
        for c in range(n_chunks):
            part = [a[c * chunk:(c + 1) * chunk] for a in appends]
            counts = np.array([len(p) for p in part], np.int64)
            T = _bucket(max(1, int(counts.max())), self.chunks)
            tokens = np.zeros((n, T), np.int32)
            for i, p in enumerate(part):
                tokens[i, :len(p)] = p
            last = c == n_chunks - 1
            after = (0 if reset and c == 0 else state.cached[rows]) + counts
            window = _bucket(max(1, int(after.max())), self.windows)
            args, static = self._prefill_inputs(state, lay, tokens, counts, np.full(n, prepend and c == 0),
                                                np.array(new_pending) if last else np.full(n, -1),
                                                np.full(n, reset and c == 0), window=window)
            state.cache, state.pending = _prefill(*args, **static)
            state.cached[rows] = after

    def _prefill_inputs(self, state, lay, tokens, counts, prepend, new_pending, reset, *, window: int):
        """`_prefill`'s (arguments, static arguments) for one chunk of appends ([n] arrays per row)."""
        graphdef, params, weights = self._params()
        args = (graphdef, params, weights, state.cache, state.pending, lay.rows, lay(tokens, 0), lay(counts, 0),
                lay(prepend, False), lay(new_pending, -1), lay(reset, False))
        return args, dict(window=window, compact=self.compact, shardings=self._shardings)

    def _turn_inputs(self, state, lay, knobs, max_steps, limit_code, eos, stops, keys, *, window: int, steps: int,
                     start=None):
        """`_decode_loop`'s inputs for one turn: (graphdef, params, weights, run, per-call arguments).
        `start` takes the turn's cache window (default `_decode_start`)."""
        graphdef, params, weights = self._params()
        args = (knobs, lay(max_steps, 0), lay(limit_code, 0), eos, stops, keys[lay(np.arange(len(max_steps)), 0)])
        cache, pending = (start or _decode_start)(state.cache, state.pending, lay.rows, window=window,
                                                  compact=self.compact)
        run = _new_run(cache, pending, lay(max_steps, 0), lay(limit_code, 0), steps, stops.shape[1])
        return graphdef, params, weights, run, args

    # -- ahead-of-time compilation -------------------------------------------------------------------
    def abstract_state(self) -> SamplerState:
        """Every row live, the cache as abstract arrays laid out as `init_state` lays them out."""
        B, cfg = self.batch_size, self.cfg
        kv_sharding, row_sharding = (None, None) if self._shardings is None else (self._shardings[0].k,
                                                                                 self._shardings[1])
        kv = jax.ShapeDtypeStruct((cfg.num_layers, B, self.max_len, cfg.num_kv_heads, cfg.head_dim),
                                  self.cache_dtype, sharding=kv_sharding)
        rows = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=row_sharding)
        return SamplerState(cache=KVCache(k=kv, v=kv, lengths=rows), pending=rows, cached=np.zeros(B, np.int64),
                            live=np.ones(B, bool), full=np.zeros(B, bool))

    def lower(self, max_new_tokens: int) -> dict[str, "jax.stages.Lowered"]:
        """The prefill and decode programs at the largest shapes a run gives them, on abstract
        inputs (nothing allocated): every row, the whole cache window, a full prefill chunk, and a
        turn of `max_new_tokens` decode steps. `launch.plan` compiles them for a target."""
        state, n = self.abstract_state(), self.batch_size
        rows = np.arange(n)
        lay, window = self._layout(rows), self.windows[-1]
        chunk = self.chunks[-1]
        args, static = self._prefill_inputs(state, lay, np.zeros((n, chunk), np.int32), np.full(n, chunk),
                                            np.zeros(n, bool), np.full(n, -1), np.zeros(n, bool), window=window)
        steps = _bucket(min(max_new_tokens, self.max_len), power_buckets(16, self.max_len))
        knobs = dict(temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                     top_p=np.ones(n, np.float32), greedy=np.zeros(n, bool))
        graphdef, params, weights, run, call_args = self._turn_inputs(
            state, lay, {k: lay(v, _IDLE_ROW_KNOBS[k]) for k, v in knobs.items()}, np.full(n, steps),
            np.full(n, LENGTH), self._eos_array(self.eos_ids), self._stop_array(()),
            self._row_keys(0, rows, needed=True), window=window, steps=steps, start=_abstract_window)
        return {"prefill": _prefill.lower(*args, **static),
                "decode": _decode_loop.lower(graphdef, params, weights, run, np.int32(steps), *call_args)}

    def _params(self):
        """(graphdef, params, unrolled weights or None), re-making the unrolled copy only when the
        model's parameter arrays changed (an optimizer step replaces them)."""
        graphdef, params = nnx.split(self.model)
        if not self.unroll:
            return graphdef, params, None
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(self._weights_for) or any(r() is not a for r, a in zip(self._weights_for, leaves)):
            self._weights = None  # drop the stale copy before making the new one
            self._weights = _unrolled_weights(graphdef, params)
            self._weights_for = [weakref.ref(a) for a in leaves]
        return graphdef, params, self._weights

    def _layout(self, rows: np.ndarray) -> "_Layout":
        return _Layout(rows, self.batch_size, self.row_buckets, self.compact)

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

    @staticmethod
    def _eos_array(ids: Sequence[int]) -> np.ndarray:
        out = np.full(_bucket(max(len(ids), 1), power_buckets(1, 1 << 20)), -1, np.int32)
        out[:len(ids)] = ids
        return out

    def _stop_array(self, stop_sequences) -> np.ndarray:
        seqs = [self._as_ids(s, "stop sequence") for s in stop_sequences]
        if any(not s for s in seqs):
            raise ValueError("empty stop sequence")
        width = _bucket(max([len(s) for s in seqs], default=1), power_buckets(1, 1 << 16))
        count = _bucket(max(len(seqs), 1), power_buckets(1, 1 << 16))
        out = np.full((count, width), -1, np.int32)
        for i, s in enumerate(seqs):
            out[i, width - len(s):] = s
        return out

    def _row_keys(self, key, rows: np.ndarray, *, needed: bool) -> jax.Array:
        """[n] typed PRNG keys, one per requested row (see `generate`)."""
        if key is None:
            if needed:
                raise ValueError("sampling (temperature > 0 and not greedy) needs a PRNG key: pass key=")
            if self._unused_key is None:
                self._unused_key = jax.random.key(0)  # greedy calls: any key, made once
            key = self._unused_key
        if isinstance(key, (int, np.integer)):
            key = jax.random.key(int(key))
        elif not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)  # legacy uint32 PRNGKey(s)
        if key.ndim == 0:
            return _fold_in_each(key, np.asarray(rows, np.int32))
        if key.shape != (len(rows),):
            raise ValueError(f"key: one PRNG key or one per requested row ({len(rows)}), got shape {key.shape}")
        return key


class _Layout:
    """Maps per-request arrays onto the rows a device call runs: a power-of-two bucket of gathered
    rows (compact; padding rows point at index B and are dropped on write) or the whole batch."""

    def __init__(self, rows: np.ndarray, batch_size: int, buckets: Sequence[int], compact: bool):
        if compact:
            size = _bucket(len(rows), buckets)
            self.rows = np.full(size, batch_size, np.int32)
            self.rows[:len(rows)] = rows
            self.index = np.arange(len(rows))
        else:
            size = batch_size
            self.rows = np.arange(batch_size, dtype=np.int32)
            self.index = np.asarray(rows)
        self._size, self._place = size, self.index

    def __call__(self, x: np.ndarray, fill) -> np.ndarray:
        x = np.asarray(x)
        out = np.full((self._size,) + x.shape[1:], fill, x.dtype)
        out[self._place] = x
        return out


def _per_row(value, n: int, dtype, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full(n, arr, dtype)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or one value per row ({n}), got shape {arr.shape}")
    return arr


def _check_knobs(max_new, temperature, top_k, top_p, greedy) -> None:
    checks = [(max_new >= 1, "max_new_tokens must be >= 1"),
              (np.isfinite(temperature) & (temperature >= 0), "temperature must be finite and >= 0"),
              (top_k >= 0, "top_k must be >= 0 (0 = off)"),
              ((top_p > 0) & (top_p <= 1), "top_p must be in (0, 1]")]
    for ok, msg in checks:
        if not np.all(ok):
            raise ValueError(msg)
