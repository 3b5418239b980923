"""Per-token logprobs and entropies from final hidden states, without the [tokens, vocab] logits.

Alignment (next-token prediction inside packed rows): the token at position t is predicted by the
hidden state at t - 1 of the same segment. `token_logprobs` returns values in *token coordinates*:

    logp[b, t] = log softmax(h[b, t-1] @ W^T / temperature)[tokens[b, t]]
    entropy[b, t] = entropy of that same distribution

where segment_ids[b, t] == segment_ids[b, t-1] != 0 (and, with `branch_ids`, the two tokens are
in the same branch: see `models.attention.packed_ids`), and 0 elsewhere (the first token of every
segment or branch and padding have no prediction). Masks such as `action_mask` (1 on sampled
tokens) therefore index `logp` directly.

Memory: the chunked path scans over chunks of positions. Forward keeps, per token, only logp,
entropy and the logsumexp; a custom VJP recomputes each chunk's logits in the backward pass and
applies the analytic gradient, so one [rows, chunk, V] float32 block (plus its softmax) is live at a
time and the lm_head gradient accumulates in float32.

Sharding: under a mesh the loop runs per device (`jax.shard_map`) on its rows (split over the batch
axes) and its vocabulary shard (split over `tp`, Megatron-style): the softmax needs only per-token
max / sum collectives over `tp`, the hidden-state gradient one [rows, chunk, E] sum over `tp` per
chunk, and the lm_head gradient is accumulated locally and summed over the batch axes once per
call. (Left to GSPMD, the [V, E] gradient would be all-reduced in every chunk.) The lm_head enters
gathered over `fsdp`, once per call. `full_predictor_logprobs` is the plain materialize-everything
variant, kept as the benchmark reference.

Chunk size trade-off: the live set is ~3 [chunk_tokens, V] float32 blocks plus the [V, E] float32
gradient accumulator, which is read and written once per chunk. 512 tokens keeps the logits path
of a 16k-token step of Qwen2.5-0.5B (V = 151,936) under 1.5 GB (launch/bench/loss.py); on
accelerators with memory to spare, larger chunks cut the accumulator traffic.

Gradients of the two outputs:  d logp / dz = onehot(target) - p;  d H / dz = -p (z - E_p[z]),
with z = logits / temperature and E_p[z] = logsumexp(z) - H.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import loops
from models import sharding as shd


def _logits(h, w, temperature):
    """h [B, C, E], w [V, E] -> float32 logits / temperature [B, C, V]."""
    z = jnp.einsum("bce,ve->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return z / temperature


def _target_logit(z, targets, offset=0):
    """z [B, C, V], targets [B, C] -> z[..., target - offset] (0 where the target is outside this
    vocabulary shard); a masked sum, no gather."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) + offset
    return jnp.sum(jnp.where(vocab == targets[..., None], z, 0.0), axis=-1)


def _to_chunks(a, chunk):
    """[B, T, ...] -> [T // chunk, B, chunk, ...]."""
    B, T = a.shape[:2]
    return a.reshape(B, T // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)


def _from_chunks(a):
    """[n, B, chunk, ...] -> [B, n * chunk, ...]."""
    a = a.swapaxes(0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


# -- the per-device computation ---------------------------------------------------------------------
# Local shards: rows split over `row_axes`, vocabulary over `vocab_axes` (mesh axis names; empty
# without a mesh). The softmax over a split vocabulary needs only per-token collectives (max, sums);
# the lm_head gradient accumulates over this device's tokens and is reduced once, after the loop.
def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _vocab_offset(w_local, vocab_axes):
    return jax.lax.axis_index(vocab_axes) * w_local.shape[0] if vocab_axes else 0


def _local_fwd(h, w, targets, *, chunk, temperature, with_entropy, vocab_axes):
    offset = _vocab_offset(w, vocab_axes)

    @jax.named_scope("logits_chunk")
    def body(_, xs):
        hc, tc = xs
        z = _logits(hc, w, temperature)
        m = jnp.max(z, axis=-1)
        m = jax.lax.pmax(m, vocab_axes) if vocab_axes else m
        e = jnp.exp(z - m[..., None])
        total = _psum(jnp.sum(e, axis=-1), vocab_axes)
        lse = m + jnp.log(total)
        logp = _psum(_target_logit(z, tc, offset), vocab_axes) - lse
        if with_entropy:
            ent = lse - _psum(jnp.sum(e * z, axis=-1), vocab_axes) / total
        else:
            ent = jnp.zeros_like(lse)
        return None, (logp, ent, lse)

    _, out = loops.scan("chunks", body, None, (_to_chunks(h, chunk), _to_chunks(targets, chunk)))
    return tuple(_from_chunks(a) for a in out)


def _local_bwd(h, w, targets, lse, ent, g_logp, g_ent, *, chunk, temperature, with_entropy, row_axes,
               vocab_axes):
    offset = _vocab_offset(w, vocab_axes)

    @jax.named_scope("logits_chunk_grad")
    def body(dw, xs):
        hc, tc, lse_c, ent_c, gl_c, ge_c = xs
        z = _logits(hc, w, temperature)
        # one elementwise expression of z, so it fuses into a single pass producing dlogits:
        # dz = g_logp (onehot - p) - g_ent p (z - E_p[z])
        p = jnp.exp(z - lse_c[..., None])
        scale = gl_c[..., None]
        if with_entropy:
            scale = scale + ge_c[..., None] * (z - (lse_c - ent_c)[..., None])
        vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) + offset
        dz = jnp.where(vocab == tc[..., None], gl_c[..., None], 0.0) - p * scale
        dlogits = (dz / temperature).astype(hc.dtype)
        dh = jnp.einsum("bcv,ve->bce", dlogits, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("bcv,bce->ve", dlogits, hc, preferred_element_type=jnp.float32)
        return dw, _psum(dh, vocab_axes).astype(hc.dtype)

    xs = tuple(_to_chunks(a, chunk) for a in (h, targets, lse, ent, g_logp, g_ent))
    dw, dh = loops.scan("chunks", body, jnp.zeros(w.shape, jnp.float32), xs)
    return _from_chunks(dh), _psum(dw, row_axes).astype(w.dtype)


def _mesh_axes(mesh, rows: int, vocab: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Mesh axes that split the rows and the vocabulary (from the logical sharding rules)."""
    if mesh is None or mesh.size == 1:
        return (), ()

    def axes(logical, dim):
        spec = shd.logical_to_spec((logical,), (dim,), mesh)[0]
        return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)

    return axes("batch", rows), axes("vocab", vocab)


def _sharded(fn, mesh, in_specs, out_specs):
    """fn itself without a mesh; under one, fn per device on its shards (collectives explicit)."""
    if mesh is None or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(h, w, targets, chunk, temperature, with_entropy, mesh):
    return _chunked_fwd(h, w, targets, chunk, temperature, with_entropy, mesh)[0]


def _chunked_fwd(h, w, targets, chunk, temperature, with_entropy, mesh):
    row_axes, vocab_axes = _mesh_axes(mesh, h.shape[0], w.shape[0])
    rows, vocab = P(row_axes or None, None), P(vocab_axes or None, None)
    fwd = functools.partial(_local_fwd, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
                            vocab_axes=vocab_axes)
    # the lm_head enters replicated over fsdp: gathered once per call, not once per chunk
    logp, ent, lse = _sharded(fwd, mesh, (P(row_axes or None, None, None), vocab, rows),
                              (rows, rows, rows))(h, w, targets)
    return (logp, ent), (h, w, targets, lse, ent)


def _chunked_bwd(chunk, temperature, with_entropy, mesh, residuals, cotangents):
    h, w, targets, lse, ent = residuals
    g_logp, g_ent = cotangents
    row_axes, vocab_axes = _mesh_axes(mesh, h.shape[0], w.shape[0])
    rows, vocab = P(row_axes or None, None), P(vocab_axes or None, None)
    hidden = P(row_axes or None, None, None)
    bwd = functools.partial(_local_bwd, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
                            row_axes=row_axes, vocab_axes=vocab_axes)
    dh, dw = _sharded(bwd, mesh, (hidden, vocab, rows, rows, rows, rows, rows), (hidden, vocab))(
        h, w, targets, lse, ent, g_logp, g_ent)
    return dh, shd.constrain(dw, ("vocab", "embed"), mesh), None


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
    z = shd.constrain(_logits(hidden, lm_head, temperature), ("batch", None, "act_vocab"), mesh)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = _target_logit(logp_all, next_tokens)
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1) if with_entropy else jnp.zeros_like(logp)
    return logp, ent


def token_logprobs(hidden, lm_head, tokens, segment_ids, *, branch_ids=None, temperature: float = 1.0,
                   chunk_tokens: int | None = 512, with_entropy: bool = True, mesh=None):
    """hidden [B, T, E] (final-normed), lm_head [V, E], tokens/segment_ids/branch_ids [B, T] ->
    (logp [B, T], entropy [B, T]) in token coordinates (module docstring). `chunk_tokens=None`
    materializes the full logits instead of chunking."""
    tokens = jnp.asarray(tokens)
    segment_ids = jnp.asarray(segment_ids)
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logp, ent = _predictor_logprobs(hidden, lm_head, next_tokens, temperature=temperature,
                                    chunk_tokens=chunk_tokens, with_entropy=with_entropy, mesh=mesh)
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    if branch_ids is not None:
        branch_ids = jnp.asarray(branch_ids)
        valid &= branch_ids[:, 1:] == branch_ids[:, :-1]
    shift = lambda a: jnp.concatenate([jnp.zeros_like(a[:, :1]), jnp.where(valid, a[:, :-1], 0.0)], axis=1)
    return shift(logp), shift(ent)
