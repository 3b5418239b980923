"""The blockwise forward as a Pallas TPU kernel: one (query block, key block) pair per grid step.

`models/attention.py` owns the algorithm and the backward; this module only runs its forward
(`_flash_forward`'s online softmax) in one kernel instead of an XLA loop, so the scores of a pair
live in VMEM and never reach HBM. The mask is evaluated per block from the same ids (`MaskIds`), so
the forecasting branches (data-dependent masks no shipped kernel takes) run here too.

Layouts follow the TPU's (8, 128) tiles: queries [B, H, Tp, D] in blocks [bq, D]; keys / values
[B, K, Sp, D] in blocks [bk, D] (query head h reads KV head h // G); query ids broadcast over 128
lanes [4, B, Tp, 128], key ids over 8 sublanes [4, B, 8, Sp]; running max / sum kept lane-broadcast
in scratch [bq, 128]. The grid is (B, H, query blocks, key blocks), the last axis sequential. A key
block after every query of a query block (the mask's index rule) is skipped and not even fetched: the
last key block each (row, query block) needs is prefetched into scalar memory, and past it the index
map repeats that block, which is already resident. So packed rows skip the pairs above the diagonal,
and a prefill chunk reads its row's cache only as far as the row is filled.

Off TPU the kernel runs in Pallas interpret mode: exact and slow, for the tests.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models import mask_rule

LANES, SUBLANES = 128, 8
NEG_INF = -1e30  # as models.attention: finite, so fully masked rows stay NaN-free


def supports(bq: int, bk: int, head_dim: int) -> bool:
    """Whether the kernel takes these blocks: whole (8, 128) tiles."""
    return bq % SUBLANES == 0 and bk % LANES == 0 and (head_dim % LANES == 0 or LANES % head_dim == 0)


def forward(bq: int, bk: int, packed: bool, q, k, v, queries, keys, *, interpret: bool):
    """q [B, Tp, K, G, D], k/v [B, Sp, K, D], ids as `models.attention` pads them (Tp, Sp whole
    blocks) -> (out like q, log-sum-exp [B, Tp, K, G] float32; +inf where a query sees no key)."""
    B, Tp, K, G, D = q.shape
    Sp, H = k.shape[1], K * G
    nq, nk = Tp // bq, Sp // bk
    qh = q.reshape(B, Tp, H, D).transpose(0, 2, 1, 3)
    kh, vh = (a.transpose(0, 2, 1, 3) for a in (k, v))
    q_ids = jnp.broadcast_to(jnp.stack(queries)[:, :, None, :], (4, B, SUBLANES, Tp))
    k_ids = jnp.broadcast_to(jnp.stack(keys)[:, :, None, :], (4, B, SUBLANES, Sp))
    # keys are in index order (slot == index over a cache, 0.. in packed rows): block j holds indices
    # from j * bk, and a query sees no key of a higher index than its own
    last = jnp.clip(jnp.max(queries[1].reshape(B, nq, bq), axis=2) // bk, 0, nk - 1).astype(jnp.int32)

    def key_block(b, h, i, j, last):
        return (b, h // G, jnp.minimum(j, last[b, i]), 0)

    def key_ids_block(b, h, i, j, last):
        return (0, b, 0, jnp.minimum(j, last[b, i]))

    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(B, H, nq, nk),
        in_specs=[pl.BlockSpec((4, None, SUBLANES, bq), lambda b, h, i, j, last: (0, b, 0, i)),
                  pl.BlockSpec((4, None, SUBLANES, bk), key_ids_block),
                  pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, last: (b, h, i, 0)),
                  pl.BlockSpec((None, None, bk, D), key_block),
                  pl.BlockSpec((None, None, bk, D), key_block)],
        out_specs=[pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, last: (b, h, i, 0)),
                   pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, last: (b, h, 0, i))],
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, D), jnp.float32)])
    out, lse = pl.pallas_call(
        functools.partial(_kernel, scale=D ** -0.5, nk=nk),
        grid_spec=grid,
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, D), q.dtype),
                   jax.ShapeDtypeStruct((B, H, 1, Tp), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=_cost(B, H, nq, nk, bq, bk, D, packed, q.dtype.itemsize),
    )(last, q_ids, k_ids, qh, kh, vh)
    out = out.transpose(0, 2, 1, 3).reshape(B, Tp, K, G, D)
    lse = lse[:, :, 0].transpose(0, 2, 1).reshape(B, Tp, K, G)
    return out, lse


def _cost(B, H, nq, nk, bq, bk, D, packed, itemsize) -> pl.CostEstimate:
    """What the kernel computes and moves, for the compiler's cost analysis (it cannot see inside):
    the pairs on and below the diagonal of packed rows, every pair over a cache (a bound: how far
    the rows are filled is known only at run time)."""
    pairs = nq * (nq + 1) // 2 if packed else nq * nk
    scores = B * H * pairs * bq * bk
    fetched = B * H * (nq * bq * D + 2 * (pairs if packed else nq * nk) * bk * D)  # q once, k/v per pair
    return pl.CostEstimate(flops=4 * scores * D, transcendentals=scores,
                           bytes_accessed=(fetched + B * H * nq * bq * D) * itemsize)


def _kernel(last_ref, q_ids, k_ids, q_ref, k_ref, v_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale, nk):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bk = k_ref.shape[0]

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j <= last_ref[b, i])
    def _pair():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [bq, bk]
        mask = _mask(q_ids, k_ids)
        s = jnp.where(mask, s, NEG_INF)
        m_old, l_old = m_ref[...], l_ref[...]  # [bq, 128], every lane equal
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - _lanes(m_new, bk)), 0.0)
        correction = jnp.exp(m_old - m_new)
        m_ref[...] = m_new
        l_ref[...] = l_old * correction + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(p.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [bq, D]
        acc_ref[...] = acc_ref[...] * _lanes(correction, pv.shape[1]) + pv

    @pl.when(j == nk - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0
        out_ref[...] = (acc_ref[...] / _lanes(jnp.where(seen, l, 1.0), acc_ref.shape[1])).astype(out_ref.dtype)
        lse = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)  # [bq, 128]
        lse_ref[...] = jnp.transpose(lse)[:1]  # a row [1, bq]: tokens on lanes, 1/16 of the HBM


def _mask(q_ids, k_ids) -> jax.Array:
    """bool [bq, bk]: the mask rule on this pair's ids."""
    queries = tuple(jnp.transpose(q_ids[c])[:, :1] for c in range(4))  # [bq, 1]
    keys = tuple(k_ids[c, :1, :] for c in range(4))  # [1, bk]
    return mask_rule.allowed(queries, keys)


def _lanes(x, width: int) -> jax.Array:
    """[rows, 128] with every lane equal -> [rows, width]."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    return jnp.tile(x, (1, width // LANES))
