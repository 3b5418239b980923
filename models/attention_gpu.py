"""The blockwise forward as a Pallas GPU (Triton) kernel: one program per (row, head, query tile).

The GPU twin of `models/attention_tpu.py`: the same online softmax and the same mask, evaluated per
tile from the ids (`MaskIds`), so packed rows and forecasting branches run in the kernel. Triton has
no tiling constraints, so the kernel reads q, k, v and writes the output in the model's own layouts
([B, T, H, D], [B, S, K, D]: no transposes) and the ids as plain [4, B, T] rows. Each program keeps
its query tile in registers and loops over key tiles up to its last query's (for packed rows the
diagonal, over a cache the row's filled slots).
`models/attention.py` owns the padding and the backward.

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
