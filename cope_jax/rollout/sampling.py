"""Choosing the next token from logits, row by row: greedy, temperature, top-k, top-p.

Every knob is a per-row array, so one compiled decode loop serves any mix of settings; what the
mix needs (greedy only, sampling, filtering: `draw_of`) is read on the host and compiled in. Pure
functions on arrays; the sampler calls them once per decode step.

Semantics (transformers' `generate` order): logits / temperature, then top-k (keep the k highest,
ties with the k-th kept), then top-p (keep the smallest most-likely set whose probability reaches
top_p, computed after top-k), then one categorical draw (`categorical`: inverse CDF, one uniform
number per row). `greedy` or temperature 0 takes the argmax of the raw logits. The logprob returned
for a token is the sampling policy's: log-softmax of logits / temperature (1 for a greedy row),
before top-k / top-p. It is the distribution the trainer scores the same token under
(`train/logprobs.py` at `rollout.temperature`), so their difference is numeric drift only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -jnp.inf
_BLOCK = 128  # `categorical` sums the probabilities in blocks of this many tokens


def argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum over the last axis, int32 (jnp.argmax's result).

    A max and a min reduction: XLA:CPU runs these vectorised, while its variadic argmax reduction
    is several times slower, which shows at every decode step over a 150k vocabulary.
    """
    n = x.shape[-1]
    first = jnp.min(jnp.where(x == x.max(-1, keepdims=True), jnp.arange(n, dtype=jnp.int32), n), -1)
    return jnp.minimum(first, n - 1)  # a NaN row has no maximum: clamp rather than index past V


def categorical(scaled: jax.Array, keys) -> jax.Array:
    """One draw per row from softmax(scaled): scaled [R, V] float (-inf: excluded), keys [R] -> [R] int32.

    Inverse CDF on one uniform number per row, in two levels: the cumulative mass of blocks of
    `_BLOCK` tokens picks a block, the cumulative mass inside it picks the token. Gumbel-max needs
    V random numbers per row instead, which dominated a sampled decode step over Qwen's 152k
    vocabulary (12.6 ms for 8 rows on this 2-core CPU, against 0.5 ms for this).
    """
    R, V = scaled.shape
    nb = -(-V // _BLOCK)
    p = jnp.exp(scaled - scaled.max(-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, nb * _BLOCK - V))).reshape(R, nb, _BLOCK)
    mass = p.sum(-1)  # [R, nb]
    upto = jnp.cumsum(mass, -1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), scaled.dtype))(keys)
    target = u * upto[:, -1]
    pick = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=-1)[:, 0]  # noqa: E731
    blk = jnp.minimum(jnp.sum(upto <= target[:, None], -1), nb - 1)
    # float rounding can step onto a block or token of no mass: take the likeliest one instead
    blk = jnp.where(pick(mass, blk) > 0, blk, argmax(mass))
    inside = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [R, _BLOCK]
    rest = target - (pick(upto, blk) - pick(mass, blk))
    j = jnp.minimum(jnp.sum(jnp.cumsum(inside, -1) <= rest[:, None], -1), _BLOCK - 1)
    j = jnp.where(pick(inside, j) > 0, j, argmax(inside))
    return (blk * _BLOCK + j).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array, greedy: jax.Array) -> jax.Array:
    """log softmax(logits / t)[token], t the row's temperature (1 where greedy or t <= 0): logits
    [R, V] float32, tokens and knobs [R] -> [R] float32."""
    t = jnp.where(greedy | (temperature <= 0), 1.0, temperature)
    scaled = logits / t[:, None]
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def filter_cutoff(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest logit each row keeps under top-k then top-p: scaled [R, V] -> [R].

    top_k [R] int (0 or >= V: off), top_p [R] float in (0, 1] (1: off). Sorting is the expensive
    part, so callers run this only when some row filters.
    """
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [R, 1]
    desc = jnp.where(desc >= kth, desc, _NEG_INF)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= desc > _NEG_INF
    n_keep = jnp.maximum(keep.sum(-1), 1)  # the most likely token is always kept
    return jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]


DRAWS = ("greedy", "sample", "filter")  # what a call's rows need of `sample_tokens`, fixed per call


def draw_of(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, greedy: np.ndarray) -> str:
    """The draw a call's knobs ([n] host arrays) need: 'greedy' (every row), 'sample' (no row
    filters) or 'filter' (some row's top-k / top-p is on). The host knows the knobs before the call,
    so the choice is a static argument of the program rather than a branch on the device (a GPU
    reads a branch's predicate back to the host at every step)."""
    greedy = np.asarray(greedy) | (np.asarray(temperature) <= 0)
    if greedy.all():
        return "greedy"
    filtering = ~greedy & ((np.asarray(top_k) > 0) | (np.asarray(top_p) < 1.0))
    return "filter" if filtering.any() else "sample"


def sample_tokens(logits: jax.Array, keys, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, greedy: jax.Array, draw: str = "filter") -> jax.Array:
    """Next token per row: logits [R, V] float32, knobs [R] -> [R] int32.

    keys: [R] typed PRNG keys, or a function returning them (derived only when some row samples).
    draw: one of DRAWS (`draw_of` the knobs); 'filter' serves any knobs, the others skip the random
    draw ('greedy') or the sort over the vocabulary ('sample') that their knobs do not need.
    """
    if draw not in DRAWS:
        raise ValueError(f"unknown draw {draw!r}; expected one of {DRAWS}")
    greedy = greedy | (temperature <= 0)
    best = argmax(logits)
    if draw == "greedy":
        return best
    row_keys = keys() if callable(keys) else keys
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    if draw == "filter":
        filtering = ~greedy & (((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0))
        cutoff = jnp.where(filtering, filter_cutoff(scaled, top_k, top_p), _NEG_INF)
        scaled = jnp.where(scaled >= cutoff[:, None], scaled, _NEG_INF)
    return jnp.where(greedy, best, categorical(scaled, row_keys))


def stop_matched(tail: jax.Array, stops: jax.Array) -> jax.Array:
    """Whether each row's generated tokens end with one of the stop sequences.

    tail [R, M]: the row's last M generated tokens, right-aligned, -1 before the first one;
    stops [N, M]: stop sequences right-aligned, padded on the left with -1 (an all -1 row is no
    sequence). -> [R] bool.
    """
    care = stops >= 0  # [N, M]
    hit = jnp.all((tail[:, None, :] == stops[None]) | ~care[None], axis=-1)  # [R, N]
    return jnp.any(hit & jnp.any(care, axis=-1)[None], axis=-1)
