"""Attention's Pallas GPU (Triton) kernels: the blockwise forward (one program per (row, head,
query tile)), its backward (`backward`: a dK / dV pass and a dQ pass) and a decode step over the KV
cache (`decode`: flash-decoding, the keys split so few rows still fill the GPU).

The GPU twin of `models/attention_tpu.py`: the same online softmax and the same mask, evaluated per
tile from the ids (`MaskIds`), so packed rows and forecasting branches run in the kernel. Triton has
no tiling constraints, so the kernel reads q, k, v and writes the output in the model's own layouts
([B, T, H, D], [B, S, K, D]: no transposes) and the ids as plain [4, B, T] rows. Each program keeps
its query tile in registers and loops over key tiles up to its last query's (for packed rows the
diagonal, over a cache the row's filled slots).
`models/attention.py` owns the padding and the custom VJP that calls `backward`.

Off GPU it runs in Pallas interpret mode: exact and slow, for the tests.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from models import mask_rule

TILE = 64  # queries and keys per tile: fits a 128-wide head in registers at 4-8 warps
NEG_INF = -1e30  # as models.attention: finite, so fully masked rows stay NaN-free


def supports(bq: int, bk: int, head_dim: int) -> bool:
    """Whether the kernel takes these blocks: whole tiles, a power-of-two head (Triton's shapes)."""
    return bq % TILE == 0 and bk % TILE == 0 and head_dim in (32, 64, 128, 256)


def forward(bq: int, bk: int, packed: bool, q, k, v, queries, keys, *, interpret: bool):
    """q [B, Tp, K, G, D], k/v [B, Sp, K, D], ids as `models.attention` pads them -> (out like q,
    log-sum-exp [B, Tp, K, G] float32; +inf where a query sees no key). bq / bk only need to be
    whole tiles: the kernel tiles by TILE."""
    del bq, bk
    B, Tp, K, G, D = q.shape
    Sp, H = k.shape[1], K * G
    nq, nk = Tp // TILE, Sp // TILE
    out, lse = pl.pallas_call(
        functools.partial(_kernel, scale=D ** -0.5, nk=nk),
        grid=(B, H, nq),
        in_specs=[pl.BlockSpec((4, None, TILE), lambda b, h, i: (0, b, i)),
                  pl.BlockSpec((4, None, Sp), lambda b, h, i: (0, b, 0)),
                  pl.BlockSpec((None, TILE, None, D), lambda b, h, i: (b, i, h, 0)),
                  pl.BlockSpec((None, Sp, None, D), lambda b, h, i: (b, 0, h // G, 0)),
                  pl.BlockSpec((None, Sp, None, D), lambda b, h, i: (b, 0, h // G, 0))],
        out_specs=[pl.BlockSpec((None, TILE, None, D), lambda b, h, i: (b, i, h, 0)),
                   pl.BlockSpec((None, None, TILE), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4 if D <= 64 else 8, num_stages=2),
        interpret=interpret,
        cost_estimate=_cost(B, H, nq, nk, D, packed, q.dtype.itemsize),
    )(jnp.stack(queries), jnp.stack(keys), q.reshape(B, Tp, H, D), k, v)
    return out.reshape(B, Tp, K, G, D), lse.transpose(0, 2, 1).reshape(B, Tp, K, G)


def _cost(B, H, nq, nk, D, packed, itemsize) -> pl.CostEstimate:
    """What the kernel computes and moves, for the compiler's cost analysis (it cannot see inside)."""
    pairs = nq * (nq + 1) // 2 if packed else nq * nk
    scores = B * H * pairs * TILE * TILE
    moved = B * H * (2 * nq * TILE * D + 2 * pairs * TILE * D)  # q and out once, k / v per pair
    return pl.CostEstimate(flops=4 * scores * D, transcendentals=scores, bytes_accessed=moved * itemsize)


def _kernel(q_ids, k_ids, q_ref, k_ref, v_ref, out_ref, lse_ref, *, scale, nk):
    i = pl.program_id(2)
    q = q_ref[...]  # [TILE, D]
    queries = tuple(q_ids[c, :][:, None] for c in range(4))  # [TILE, 1] each

    def body(j, carry):
        acc, m, l = carry
        tile = pl.ds(j * TILE, TILE)
        s = plt.dot(q, k_ref[tile, :], trans_b=True).astype(jnp.float32) * scale  # [TILE, TILE]
        mask = mask_rule.allowed(queries, tuple(k_ids[c, tile][None, :] for c in range(4)))
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = plt.dot(p.astype(v_ref.dtype), v_ref[tile, :]).astype(jnp.float32)
        return acc * correction[:, None] + pv, m_new, l * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((q.shape[0],), NEG_INF, jnp.float32),
            jnp.zeros((q.shape[0],), jnp.float32))
    # keys are in index order (0.. in packed rows, slot == index over a cache) and a query sees no key
    # of a higher index: tiles after the tile's last query are masked whole (packed rows: the
    # diagonal; a cache: the row's filled slots), so the loop stops there
    acc, m, l = jax.lax.fori_loop(0, jnp.minimum(jnp.max(q_ids[1, :]) // TILE + 1, nk), body, init)
    seen = l > 0
    out_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


# -- backward: FlashAttention-2's two passes ---------------------------------------------------------
def backward(q, k, v, queries, keys, d_out, lse, delta, *, packed: bool, interpret: bool):
    """The gradients of `forward`: q / d_out [B, Tp, K, G, D], k / v [B, Sp, K, D], ids as `forward`
    takes them, lse and delta (rowsum(d_out * out)) [B, Tp, K, G] float32 -> (dq, dk, dv) in the
    dtypes of q, k, v.

    Two kernels, so neither accumulates across programs: one per (row, KV head, key tile) holds its
    K / V tile and sums dK / dV over the query tiles that see it and the group's query heads; one
    per (row, head, query tile) holds its queries and sums dQ over the key tiles they see. Packed
    rows visit only the tiles on and below the diagonal. Each pair's probabilities are recomputed
    from the saved log-sum-exp."""
    B, Tp, K, G, D = q.shape
    Sp, H = k.shape[1], K * G
    nq, nk = Tp // TILE, Sp // TILE
    rows = lambda x: x.reshape(B, Tp, H, D)  # noqa: E731
    per_head = lambda x: x.reshape(B, Tp, H).transpose(0, 2, 1)  # [B, H, Tp]: a tile's rows contiguous  # noqa: E731
    q_ids, k_ids = jnp.stack(queries), jnp.stack(keys)
    params = plt.CompilerParams(num_warps=4 if D <= 64 else 8, num_stages=2)
    kv_tile = pl.BlockSpec((None, TILE, None, D), lambda b, h, j: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=D ** -0.5, groups=G, nq=nq, packed=packed),
        grid=(B, K, nk),
        in_specs=[pl.BlockSpec((4, None, Tp), lambda b, h, j: (0, b, 0)),
                  pl.BlockSpec((4, None, TILE), lambda b, h, j: (0, b, j)),
                  pl.BlockSpec((None, Tp, H, D), lambda b, h, j: (b, 0, 0, 0)), kv_tile, kv_tile,
                  pl.BlockSpec((None, Tp, H, D), lambda b, h, j: (b, 0, 0, 0)),
                  pl.BlockSpec((None, H, Tp), lambda b, h, j: (b, 0, 0)),
                  pl.BlockSpec((None, H, Tp), lambda b, h, j: (b, 0, 0))],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=interpret,
    )(q_ids, k_ids, rows(q), k, v, rows(d_out), per_head(lse), per_head(delta))
    q_tile = pl.BlockSpec((None, TILE, None, D), lambda b, h, i: (b, i, h, 0))
    kv_row = pl.BlockSpec((None, Sp, None, D), lambda b, h, i: (b, 0, h // G, 0))
    stat = pl.BlockSpec((None, None, TILE), lambda b, h, i: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=D ** -0.5, nk=nk, packed=packed),
        grid=(B, H, nq),
        in_specs=[pl.BlockSpec((4, None, TILE), lambda b, h, i: (0, b, i)),
                  pl.BlockSpec((4, None, Sp), lambda b, h, i: (0, b, 0)),
                  q_tile, kv_row, kv_row, q_tile, stat, stat],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype),
        compiler_params=params, interpret=interpret,
    )(q_ids, k_ids, rows(q), k, v, rows(d_out), per_head(lse), per_head(delta))
    return dq.reshape(q.shape), dk, dv


def _probabilities(q, kt, q_ids, k_ids, lse, scale):
    """A pair's probabilities [tq, tk] float32 from the saved log-sum-exp (0 where masked)."""
    s = plt.dot(q, kt, trans_b=True).astype(jnp.float32) * scale
    mask = mask_rule.allowed(q_ids, k_ids)
    return jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)


def _dkdv_kernel(q_ids, k_ids, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 scale, groups, nq, packed):
    h, j = pl.program_id(1), pl.program_id(2)
    kt, vt = k_ref[...], v_ref[...]  # [TILE, D]
    keys = tuple(k_ids[c, :][None, :] for c in range(4))
    first = j if packed else 0  # packed: the query tiles before the key tile see none of it

    def body(n, carry):
        dk, dv = carry
        # truncating division (n >= 0): Triton's lowering of the floor forms mixes types
        i, head = first + jax.lax.div(n, groups), h * groups + jax.lax.rem(n, groups)
        tile = pl.ds(i * TILE, TILE)
        q, do = q_ref[tile, head, :], do_ref[tile, head, :]
        p = _probabilities(q, kt, tuple(q_ids[c, tile][:, None] for c in range(4)), keys, lse_ref[head, tile], scale)
        dv += plt.dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
        dp = plt.dot(do, vt, trans_b=True).astype(jnp.float32)
        ds = (p * (dp - delta_ref[head, tile][:, None]) * scale).astype(q.dtype)
        dk += plt.dot(ds, q, trans_a=True).astype(jnp.float32)
        return dk, dv

    zeros = jnp.zeros(kt.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, (nq - first) * groups, body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _dq_kernel(q_ids, k_ids, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, nk, packed):
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    queries = tuple(q_ids[c, :][:, None] for c in range(4))

    def body(j, dq):
        tile = pl.ds(j * TILE, TILE)
        kt = k_ref[tile, :]
        p = _probabilities(q, kt, queries, tuple(k_ids[c, tile][None, :] for c in range(4)), lse, scale)
        dp = plt.dot(do, v_ref[tile, :], trans_b=True).astype(jnp.float32)
        ds = (p * (dp - delta[:, None]) * scale).astype(q.dtype)
        return dq + plt.dot(ds, kt).astype(jnp.float32)

    # as the forward: no key tile after the tile's last query is seen (packed: the diagonal)
    last = i + 1 if packed else jnp.minimum(jnp.max(q_ids[1, :]) // TILE + 1, nk)
    dq = jax.lax.fori_loop(0, last, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


# -- decode: one query per row over the KV cache ------------------------------------------------------
DECODE_TILE = 64  # cache slots per key tile
DECODE_PROGRAMS = 128  # programs a call aims at (an H100 has 132 SMs): rows x KV heads x key splits


def decode_supports(max_len: int, head_dim: int) -> bool:
    """Whether `decode` takes a cache window of `max_len` slots: whole key tiles, a Triton head."""
    return max_len % DECODE_TILE == 0 and head_dim in (32, 64, 128, 256)


def decode_splits(rows: int, kv_heads: int, max_len: int) -> int:
    """Key splits per (row, KV head): a power of two, so few rows still fill the GPU
    (flash-decoding), each split at least one tile."""
    splits = 1
    while rows * kv_heads * splits * 2 <= DECODE_PROGRAMS and max_len // (splits * 2) >= DECODE_TILE:
        splits *= 2
    return splits


def decode(q, k, v, layer, filled, *, interpret: bool):
    """q [B, H, D] (a decode step's one query per row) over cache row `layer` of the stacked window
    k / v [L, B, S, K, D]; row b reads slots [0, filled[b]) -> [B, H, D].

    One program per (row, KV head, key split) loads its group's G queries once and loops over the
    split's filled tiles only (a loop inside the kernel: no trip count for the host to read); the
    splits' partial softmaxes are combined here. The cache is read in place at a traced `layer`
    (a slice of it outside the kernel would be a copy of the layer's window)."""
    B, H, D = q.shape
    S, K = k.shape[2], k.shape[3]
    G = H // K
    Gp = max(16, pl.next_power_of_2(G))  # Triton's dot takes 16 rows or more
    splits = decode_splits(B, K, S)
    qg = jnp.pad(q.reshape(B, K, G, D), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    scalar = pl.BlockSpec((None,), lambda b, h, s: (b,))
    cache = pl.BlockSpec(k.shape, lambda b, h, s: (0, 0, 0, 0, 0))
    part = lambda *tail: pl.BlockSpec((None, None, None, *tail), lambda b, h, s: (b, h, s) + (0,) * len(tail))
    acc, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, scale=D ** -0.5, chunk=S // splits),
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec((None,), lambda b, h, s: (0,)), scalar,
                  pl.BlockSpec((None, None, Gp, D), lambda b, h, s: (b, h, 0, 0)), cache, cache],
        out_specs=[part(Gp, D), part(Gp), part(Gp)],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, Gp, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=4 * B * K * Gp * S * D, transcendentals=B * K * Gp * S,
                                      bytes_accessed=2 * B * S * K * D * k.dtype.itemsize),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), jnp.asarray(filled, jnp.int32), qg, k, v)
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)  # a split that saw nothing has l = acc = 0
    total = jnp.sum(l * w, axis=2)
    out = jnp.sum(acc * w[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :G].reshape(B, H, D).astype(q.dtype)


def _decode_kernel(layer_ref, filled_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, scale, chunk):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, filled = layer_ref[()], filled_ref[()]
    start = split * chunk
    q = q_ref[...]  # [Gp, D]

    def body(j, carry):
        acc, m, l = carry
        lo = start + j * DECODE_TILE
        tile = pl.ds(lo, DECODE_TILE)
        kt = k_ref[layer, b, tile, h, :].astype(q.dtype)  # [TILE, D]
        s = plt.dot(q, kt, trans_b=True).astype(jnp.float32) * scale  # [Gp, TILE]
        mask = (lo + jnp.arange(DECODE_TILE) < filled)[None, :]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        vt = v_ref[layer, b, tile, h, :].astype(q.dtype)
        pv = plt.dot(p.astype(q.dtype), vt).astype(jnp.float32)
        return acc * correction[:, None] + pv, m_new, l * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((q.shape[0],), NEG_INF, jnp.float32),
            jnp.zeros((q.shape[0],), jnp.float32))
    trips = jnp.clip((filled - start + DECODE_TILE - 1) // DECODE_TILE, 0, chunk // DECODE_TILE)
    acc, m, l = jax.lax.fori_loop(0, trips, body, init)
    acc_ref[...], m_ref[...], l_ref[...] = acc, m, l
