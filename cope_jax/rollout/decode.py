"""The sampler's device programs: prefill and the decode loop, on a window of the KV cache.

Every call works on a *window* of the cache: the participating rows (gathered into a power-of-two
bucket on a single device; all rows, in place, under a multi-device mesh so caches never move
between devices) and the first W slots (W a power-of-two bucket covering the longest row), so the
cost of a step follows the rows' real lengths, not `max_len`. `prefill` appends tokens (a
new episode's prompt is prefilled once per distinct prompt, in a cache of its own, and `share`
copies it into every row that starts with it: a group's episodes share one prefill); a turn is
`decode_start` (take the window), `decode_loop` (a `lax.while_loop` over single-token steps,
resumable, so a streamed turn hands finished rows to the host every few steps while the window
stays on the device) and `decode_end` (write it back). The cache and the rows' next inputs are
donated, so they are updated in place; only token ids, logprobs and finish codes cross to the host.

A row's *next input* is its last token, not yet in the cache: a step feeds it and samples the next.
Besides the programs: the shapes they compile at (`power_buckets`, `row_buckets`, `RowLayout`), their array inputs
(`eos_array`, `stop_array`, `row_keys`; `abstract_cache` for lowering) and the reading of a turn's
progress (`report_finished`). The host side (rows, validation, streaming) is `cope_jax/rollout/sampler.py`.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cope_jax.rollout.sampling import sample_tokens, stop_matched, token_logprobs
from models import qwen
from models.qwen import KVCache

# finish code -> reason; 0 means "still running" and never leaves the device loop
FINISH_REASONS = ("running", "eos", "stop", "length", "context_full")
EOS, STOP, LENGTH, CONTEXT_FULL = 1, 2, 3, 4
# knobs of rows a call does not run (bucket padding, other rows under a mesh): greedy and unfiltered,
# so they never send a step down the sorting top-k / top-p path (a sort over the vocabulary)
IDLE_ROW_KNOBS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": True}


def power_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """(lo, 2lo, 4lo, ..., hi): the compiled sizes for a dimension that ranges up to hi."""
    out, v = [], max(1, lo)
    while v < hi:
        out.append(v)
        v *= 2
    return tuple(out) + (hi,)


def row_buckets(hi: int) -> tuple[int, ...]:
    """(1, 2, 3, 4, 6, 8, 12, ..., hi): the row counts a call of gathered rows compiles at. The
    three-halves steps keep the padding rows, which read the cache like the others, under a third
    of a call for twice the compiles of powers of two."""
    out = {hi}
    for p in power_buckets(1, hi):
        out.update(n for n in (p, 3 * p // 2) if 1 <= n < hi)
    return tuple(sorted(out))


def bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


class RowLayout:
    """Maps per-request arrays onto the rows a device call runs: a bucket of gathered rows
    (`compact`; padding rows point at index B and are dropped on write) or the whole batch in place.
    A call whose bucket is the whole batch runs in place: gathering every row would only copy the
    cache twice."""

    def __init__(self, rows: np.ndarray, batch_size: int, buckets: Sequence[int], gather: bool):
        size = bucket(len(rows), buckets)
        self.compact = gather and size < batch_size
        if self.compact:
            self.rows = np.full(size, batch_size, np.int32)
            self.rows[:len(rows)] = rows
            self.index = np.arange(len(rows))
        else:
            size = batch_size
            self.rows = np.arange(batch_size, dtype=np.int32)
            self.index = np.asarray(rows)
        self._size = size

    def __call__(self, x: np.ndarray, fill) -> np.ndarray:
        x = np.asarray(x)
        out = np.full((self._size,) + x.shape[1:], fill, x.dtype)
        out[self.index] = x
        return out


def eos_array(ids: Sequence[int]) -> np.ndarray:
    """[E] EOS ids, -1 padded to a power of two (one compile serves nearby counts)."""
    out = np.full(bucket(max(len(ids), 1), power_buckets(1, 1 << 20)), -1, np.int32)
    out[:len(ids)] = ids
    return out


def stop_array(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """[N, M] stop sequences, right-aligned and -1 padded to powers of two (see `stop_matched`)."""
    width = bucket(max([len(s) for s in seqs], default=1), power_buckets(1, 1 << 16))
    count = bucket(max(len(seqs), 1), power_buckets(1, 1 << 16))
    out = np.full((count, width), -1, np.int32)
    for i, s in enumerate(seqs):
        out[i, width - len(s):] = s
    return out


def _take(cache: KVCache, next_input, rows, window: int, compact: bool):
    """The window of the cache that a call works on: rows (compact) x slots [0, window)."""
    if not compact:
        return KVCache(k=cache.k[:, :, :window], v=cache.v[:, :, :window], lengths=cache.lengths), next_input
    idx = jnp.minimum(rows, cache.lengths.shape[0] - 1)  # padding rows (index B) read row B-1
    sub = KVCache(k=cache.k[:, idx, :window], v=cache.v[:, idx, :window], lengths=cache.lengths[idx])
    return sub, next_input[idx]


def _put(cache: KVCache, next_input, sub: KVCache, sub_next_input, rows, window: int, compact: bool):
    """Writes a window back in place; padding rows (index B) are dropped."""
    if not compact:
        k = jax.lax.dynamic_update_slice_in_dim(cache.k, sub.k, 0, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(cache.v, sub.v, 0, axis=2)
        return KVCache(k=k, v=v, lengths=sub.lengths), sub_next_input
    k = cache.k.at[:, rows, :window].set(sub.k, mode="drop")
    v = cache.v.at[:, rows, :window].set(sub.v, mode="drop")
    lengths = cache.lengths.at[rows].set(sub.lengths, mode="drop")
    return KVCache(k=k, v=v, lengths=lengths), next_input.at[rows].set(sub_next_input, mode="drop")


def _constrain(state, shardings):
    """Keeps (cache, next_input) on the state's shardings, so donated buffers are reused in place and
    the next call sees the same input shardings (no recompile)."""
    return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


@functools.partial(jax.jit, static_argnames=("graphdef", "window", "compact", "shardings"),
                   donate_argnames=("cache", "next_input"))
def prefill(graphdef, params, layer_params, cache, next_input, rows, tokens, num_new, prepend, set_next_input, *,
            window: int, compact: bool, shardings):
    """Appends tokens[r, :num_new[r]] to each row (R rows, T = tokens.shape[1]).

    rows [R] (compact: state rows, padding = B); tokens [R, T]; prepend [R] bool: tokens[r, 0] is
    replaced by the row's next input (extension); set_next_input [R] (-1: keep). layer_params:
    `unrolled_params` or None.
    """
    model = nnx.merge(graphdef, params)
    sub, sub_next_input = _take(cache, next_input, rows, window, compact)
    tokens = tokens.at[:, 0].set(jnp.where(prepend, sub_next_input, tokens[:, 0]))
    with jax.named_scope("prefill"):
        _, sub = model.decode(tokens, num_new, sub, layer_params)
    sub_next_input = jnp.where(set_next_input >= 0, set_next_input, sub_next_input)
    return _constrain(_put(cache, next_input, sub, sub_next_input, rows, window, compact), shardings)


@functools.partial(jax.jit, static_argnames=("window", "compact", "shardings"),
                   donate_argnames=("cache", "next_input"))
def share(cache, next_input, prompts: KVCache, rows, source, set_next_input, *, window: int, compact: bool,
          shardings):
    """Starts rows on prefilled prompts: row rows[r] takes slots [0, window) and the length of row
    source[r] of `prompts` (a cache of one row per distinct prompt, `window` slots), and next input
    set_next_input[r]; source -1 leaves a row as it is (the rows a call in place does not start)."""
    sub, sub_next_input = _take(cache, next_input, rows, window, compact)
    take = source >= 0
    picked = jnp.maximum(source, 0)
    pick = lambda own, new: jnp.where(take[None, :, None, None, None], new[:, picked], own)
    sub = KVCache(k=pick(sub.k, prompts.k), v=pick(sub.v, prompts.v),
                  lengths=jnp.where(take, prompts.lengths[picked], sub.lengths))
    sub_next_input = jnp.where(take, set_next_input, sub_next_input)
    return _constrain(_put(cache, next_input, sub, sub_next_input, rows, window, compact), shardings)


@functools.partial(jax.jit, static_argnames=("window", "compact"))
def decode_start(cache, next_input, rows, *, window: int, compact: bool):
    """The window of the cache a turn decodes (`_take`): the loop carries it until `decode_end`."""
    return _take(cache, next_input, rows, window, compact)


@functools.partial(jax.jit, static_argnames=("graphdef", "draw"), donate_argnames=("run",))
def decode_loop(graphdef, params, layer_params, run, until, knobs, step_limit, limit_code, eos_ids, stops, row_keys, *,
                draw: str):
    """Continues a turn's single-token steps (one `lax.while_loop`) until step `until` or every row is done.

    run: the turn's progress, carried from call to call (`new_run`): step, done [R], code [R],
    n [R], tokens / logprobs [R, steps], tail [R, M], and the window's cache and next inputs;
    a turn takes one call, or several when streaming hands finished rows over between them.
    Sampling folds the global step into each row's key, so the tokens do not depend on how the turn
    is split. knobs: dict of [R] arrays (temperature, top_k, top_p, greedy); step_limit [R]: the
    steps a row may take; limit_code [R]: the finish code when they run out (LENGTH or
    CONTEXT_FULL); eos_ids [E] (-1 padded); stops [N, M] (see `stop_matched`); row_keys [R] PRNG keys;
    draw: what the knobs need of `sample_tokens` (`sampling.draw_of`), so a step branches on nothing.
    """
    model = nnx.merge(graphdef, params)

    def cond(s):
        return (s["step"] < until) & ~jnp.all(s["done"])

    @jax.named_scope("decode_step")
    def body(s):
        active = ~s["done"]
        h, new_cache = model.decode(s["next_input"][:, None], active.astype(jnp.int32), s["cache"], layer_params)
        logits = model.unembed(h[:, 0], decode_layout=layer_params is not None)
        # a row's randomness depends only on (its key, step): not on which other rows run
        tok = sample_tokens(logits, lambda: jax.vmap(lambda k: jax.random.fold_in(k, s["step"]))(row_keys), **knobs,
                            draw=draw)
        lp = token_logprobs(logits, tok, knobs["temperature"], knobs["greedy"])
        n = s["n"] + active
        tail = jnp.where(active[:, None], jnp.concatenate([s["tail"][:, 1:], tok[:, None]], 1), s["tail"])
        now = jnp.select([jnp.isin(tok, eos_ids), stop_matched(tail, stops), n >= step_limit],
                         [EOS, STOP, limit_code], 0)
        finished = active & (now > 0)
        col = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], s["step"], axis=1)
        return dict(step=s["step"] + 1, cache=new_cache, next_input=jnp.where(active, tok, s["next_input"]),
                    done=s["done"] | finished, code=jnp.where(finished, now, s["code"]), n=n,
                    tokens=col(s["tokens"], tok), logprobs=col(s["logprobs"], lp), tail=tail)

    return jax.lax.while_loop(cond, body, run)


@functools.partial(jax.jit, static_argnames=("window", "compact", "shardings"),
                   donate_argnames=("cache", "next_input"))
def decode_end(cache, next_input, sub, sub_next_input, rows, *, window: int, compact: bool, shardings):
    """Writes the decoded window back into the (donated) cache."""
    return _constrain(_put(cache, next_input, sub, sub_next_input, rows, window, compact), shardings)


def report_finished(run: dict, index: np.ndarray, reported: np.ndarray, on_finish) -> None:
    """Marks the requests (`index`: their places in the run) whose turn has ended since the last
    check in `reported` (in place) and hands each one's turn to on_finish (see `Sampler.generate`)."""
    done, now = (np.asarray(run[k])[index] for k in ("done", "n"))
    new = np.flatnonzero(done & ~reported)
    reported |= done
    if on_finish is not None and len(new):
        toks, lps, codes = (np.asarray(run[k])[index] for k in ("tokens", "logprobs", "code"))
        for i in new:
            on_finish(int(i), toks[i, :now[i]].astype(np.int32), lps[i, :now[i]].astype(np.float32),
                      FINISH_REASONS[codes[i]])


def abstract_cache(cfg, rows: int, slots: int, dtype, mesh) -> tuple[KVCache, jax.ShapeDtypeStruct]:
    """(cache, next inputs) of `rows` rows of `slots` positions as abstract arrays laid out on `mesh`
    as `KVCache.zeros` lays them out (None: unplaced): the inputs the programs are lowered on."""
    shardings = qwen.cache_shardings(cfg, rows, slots, mesh)
    kv_sharding, row_sharding = (None, None) if shardings is None else (shardings[0].k, shardings[1])
    kv = jax.ShapeDtypeStruct(qwen.cache_shape(cfg, rows, slots), dtype, sharding=kv_sharding)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sharding)
    return KVCache(k=kv, v=kv, lengths=lengths), lengths


def abstract_window(cache: KVCache, next_input, rows, *, window: int, compact: bool):
    """`decode_start`'s result as abstract arrays in the cache's layout (for lowering)."""
    sub, sub_next_input = decode_start.eval_shape(cache, next_input, rows, window=window, compact=compact)
    like = lambda a, ref: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=ref.sharding)
    return (KVCache(k=like(sub.k, cache.k), v=like(sub.v, cache.v), lengths=like(sub.lengths, cache.lengths)),
            like(sub_next_input, next_input))


def new_run(cache: KVCache, next_input, step_limit: np.ndarray, limit_code: np.ndarray, steps: int,
            tail: int) -> dict:
    """A turn before its first step (see `decode_loop`): the window's cache and next inputs
    (`decode_start`) and host arrays for the rest."""
    R = len(step_limit)
    done = step_limit <= 0
    return dict(step=np.int32(0), cache=cache, next_input=next_input, done=done,
                code=np.where(done, limit_code, 0).astype(np.int32), n=np.zeros(R, np.int32),
                tokens=np.zeros((R, steps), np.int32), logprobs=np.zeros((R, steps), np.float32),
                tail=np.full((R, tail), -1, np.int32))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def unrolled_params(graphdef, params):
    """Per-layer weight dicts in the decode layout (`Qwen.layer_params`)."""
    return nnx.merge(graphdef, params).layer_params()


def row_keys(key, rows: np.ndarray) -> jax.Array:
    """[n] typed PRNG keys for the requested rows from `key`: a PRNG key or int seed (row r draws from
    fold_in(key, r)), or already one key per row (typed or legacy uint32)."""
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(int(key))
    elif not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # legacy uint32 PRNGKey(s)
    if key.ndim == 0:
        return _fold_in_each(key, np.asarray(rows, np.int32))
    if key.shape != (len(rows),):
        raise ValueError(f"key: one PRNG key or one per requested row ({len(rows)}), got shape {key.shape}")
    return key


@jax.jit
def _fold_in_each(key, values):
    """[n] keys fold_in(key, values[i])."""
    return jax.vmap(lambda v: jax.random.fold_in(key, v))(values)
