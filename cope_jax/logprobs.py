"""Per-token logprobs and entropies from final hidden states, without the [tokens, vocab] logits.

Alignment (next-token prediction inside packed rows): the token at position t is predicted by the
hidden state at t - 1 of the same segment. `token_logprobs` returns values in *token coordinates*:

    logp[b, t] = log softmax(h[b, t-1] @ W^T / temperature)[tokens[b, t]]
    entropy[b, t] = entropy of that same distribution

where segment_ids[b, t] == segment_ids[b, t-1] != 0, and 0 elsewhere (the first token of every
segment and padding have no prediction). Masks such as `action_mask` (1 on sampled tokens) therefore
index `logp` directly.

Memory: the chunked path scans over chunks of positions. Forward keeps, per token, only logp,
entropy and the logsumexp; a custom VJP recomputes each chunk's logits in the backward pass and
applies the analytic gradient, so one [rows, chunk, V] float32 block (plus its softmax) is live at a
time and the lm_head gradient accumulates in float32. The lm_head is gathered over `fsdp` once
outside the loop (not once per chunk). `full_token_logprobs` is the plain materialize-everything
variant, kept as the benchmark reference.

Gradients of the two outputs:  d logp / dz = onehot(target) - p;  d H / dz = -p (z - E_p[z]),
with z = logits / temperature and E_p[z] = logsumexp(z) - H.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import sharding as shd


def _logits(h, w, temperature):
    """h [B, C, E], w [V, E] -> float32 logits / temperature [B, C, V]."""
    z = jnp.einsum("bce,ve->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return z / temperature


def _target_logit(z, targets):
    """z [B, C, V], targets [B, C] -> z[..., target] (a masked sum: stays sharded over vocab)."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    return jnp.sum(jnp.where(vocab == targets[..., None], z, 0.0), axis=-1)


def _chunk_stats(h, w, targets, temperature, with_entropy, mesh):
    z = shd.constrain(_logits(h, w, temperature), ("batch", None, "act_vocab"), mesh)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = _target_logit(z, targets) - lse
    if with_entropy:
        p = jnp.exp(z - lse[..., None])
        ent = lse - jnp.sum(p * z, axis=-1)
    else:
        ent = jnp.zeros_like(lse)
    return logp, ent, lse


def _to_chunks(a, chunk):
    """[B, T, ...] -> [T // chunk, B, chunk, ...]."""
    B, T = a.shape[:2]
    return a.reshape(B, T // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)


def _from_chunks(a):
    """[n, B, chunk, ...] -> [B, n * chunk, ...]."""
    a = a.swapaxes(0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(h, w, targets, chunk, temperature, with_entropy, mesh):
    return _chunked_fwd(h, w, targets, chunk, temperature, with_entropy, mesh)[0]


def _chunked_fwd(h, w, targets, chunk, temperature, with_entropy, mesh):
    w_all = shd.constrain(w, ("vocab", None), mesh)  # gather fsdp shards once, outside the loop

    def body(_, xs):
        hc, tc = xs
        hc = shd.constrain(hc, ("batch", None, "act_embed"), mesh)
        return None, _chunk_stats(hc, w_all, tc, temperature, with_entropy, mesh)

    _, (logp, ent, lse) = jax.lax.scan(body, None, (_to_chunks(h, chunk), _to_chunks(targets, chunk)))
    logp, ent, lse = _from_chunks(logp), _from_chunks(ent), _from_chunks(lse)
    return (logp, ent), (h, w, targets, lse, ent)


def _chunked_bwd(chunk, temperature, with_entropy, mesh, residuals, cotangents):
    h, w, targets, lse, ent = residuals
    g_logp, g_ent = cotangents
    w_all = shd.constrain(w, ("vocab", None), mesh)

    def body(dw, xs):
        hc, tc, lse_c, ent_c, gl_c, ge_c = xs
        hc = shd.constrain(hc, ("batch", None, "act_embed"), mesh)
        z = shd.constrain(_logits(hc, w_all, temperature), ("batch", None, "act_vocab"), mesh)
        p = jnp.exp(z - lse_c[..., None])
        vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
        dz = gl_c[..., None] * (jnp.where(vocab == tc[..., None], 1.0, 0.0) - p)
        if with_entropy:
            mean_z = lse_c - ent_c
            dz = dz - ge_c[..., None] * p * (z - mean_z[..., None])
        dlogits = (dz / temperature).astype(hc.dtype)
        dh = jnp.einsum("bcv,ve->bce", dlogits, w_all.astype(hc.dtype), preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("bcv,bce->ve", dlogits, hc, preferred_element_type=jnp.float32)
        return dw, dh.astype(hc.dtype)

    xs = tuple(_to_chunks(a, chunk) for a in (h, targets, lse, ent, g_logp, g_ent))
    dw0 = shd.constrain(jnp.zeros(w.shape, jnp.float32), ("vocab", None), mesh)
    dw, dh = jax.lax.scan(body, dw0, xs)
    dw = shd.constrain(dw.astype(w.dtype), ("vocab", "embed"), mesh)
    return _from_chunks(dh), dw, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunk_positions(rows: int, length: int, chunk_tokens: int) -> int:
    """Positions per row in one chunk: about `chunk_tokens` tokens over all rows, at most L."""
    return max(1, min(length, chunk_tokens // max(rows, 1)))


def _predictor_logprobs(hidden, lm_head, next_tokens, *, temperature, chunk_tokens, with_entropy, mesh):
    """Logprob (and entropy) of next_tokens[b, t] from hidden[b, t]: [B, T] each."""
    B, T, _ = hidden.shape
    if chunk_tokens is None:
        return full_predictor_logprobs(hidden, lm_head, next_tokens, temperature=temperature,
                                       with_entropy=with_entropy, mesh=mesh)
    chunk = chunk_positions(B, T, chunk_tokens)
    pad = -T % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        next_tokens = jnp.pad(next_tokens, ((0, 0), (0, pad)))
    logp, ent = _chunked(hidden, lm_head, next_tokens, chunk, float(temperature), bool(with_entropy), mesh)
    return logp[:, :T], ent[:, :T]


def full_predictor_logprobs(hidden, lm_head, next_tokens, *, temperature, with_entropy, mesh=None):
    """Reference variant: the whole [B, T, V] logits at once, plain autodiff."""
    z = shd.constrain(_logits(hidden, lm_head, temperature), ("batch", "seq", "act_vocab"), mesh)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = _target_logit(logp_all, next_tokens)
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1) if with_entropy else jnp.zeros_like(logp)
    return logp, ent


def token_logprobs(hidden, lm_head, tokens, segment_ids, *, temperature: float = 1.0,
                   chunk_tokens: int | None = 1024, with_entropy: bool = True, mesh=None):
    """hidden [B, T, E] (final-normed), lm_head [V, E], tokens/segment_ids [B, T] ->
    (logp [B, T], entropy [B, T]) in token coordinates (module docstring). `chunk_tokens=None`
    materializes the full logits instead of chunking."""
    tokens = jnp.asarray(tokens)
    segment_ids = jnp.asarray(segment_ids)
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logp, ent = _predictor_logprobs(hidden, lm_head, next_tokens, temperature=temperature,
                                    chunk_tokens=chunk_tokens, with_entropy=with_entropy, mesh=mesh)
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    shift = lambda a: jnp.concatenate([jnp.zeros_like(a[:, :1]), jnp.where(valid, a[:, :-1], 0.0)], axis=1)
    return shift(logp), shift(ent)
