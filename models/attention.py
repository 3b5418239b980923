"""Grouped-query attention: one entry point, the implementation chosen by `QwenConfig.attention`.

Which key a query may see is computed from per-token ids (`MaskIds`), never passed in as a
`[T, S]` array, so an implementation can evaluate the mask one block at a time:
- `dense`: scores `[B, K, G, T, S]` in float32 and one softmax (transformers' arithmetic); on
  packed rows one query block of `block` at a time (at most `DENSE_BLOCKS` of them), over the keys
  up to the block's end. The
  reference, and the fastest choice for a decode step's single query per row.
- `blockwise`: flash-style online softmax over (query block, key block) pairs with a custom VJP that
  recomputes each block's probabilities, so memory grows with T·block, not T·S. In packed rows
  keys come after queries in the same order, so pairs above the diagonal are never visited (half
  the FLOPs of dense at long T). Any backend: it is plain XLA (matmuls per block).
- `pallas`: blockwise with its forward as one Pallas kernel, `models/attention_tpu.py` (Mosaic) on
  TPU, `models/attention_gpu.py` (Triton) on GPU: a pair's scores never reach HBM. On GPU the
  backward is kernels too (a dK / dV pass and a dQ pass); on TPU it is blockwise's XLA loop. On CPU
  the TPU kernel runs in Pallas interpret mode (exact, slow: for tests).
- `auto`: dense where one block holds every score (short rows); otherwise pallas on TPU and GPU where
  the kernel takes the blocks, blockwise elsewhere. Logged once per shape.

Over the sampler's KV cache (`cached`) the mask is only "slot <= position", and a row's filled
slots end at its length, so attention is bounded by the rows' lengths: key blocks past the longest
row's are never read. On GPU a decode step (one query per row) runs the decode kernel
(`attention_gpu.decode`: each row reads its own filled tiles, and a loop whose trip count the host
had to read at every layer is gone); elsewhere a decode step and, off the kernels, a prefill chunk
run one online-softmax loop over the filled key blocks, its trip count known only at run time; a
prefill chunk on TPU / GPU runs the kernel. XLA has no ragged loop, so within a call a row shorter
than the longest reads the blocks up to the longest (masked): the sampler gathers the rows of a call
where it can, so idle rows are not among them (`cope_jax/rollout/decode.py`).

The pair loop is a `models.loops.fori` of kind "attention" and the cache loop one of kind "cache"
(while loops: see there), so `launch.plan` counts their cost.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from models import attention_gpu, attention_tpu, loops, mask_rule
from models import sharding as shd

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "pallas")
KERNELS = {"tpu": attention_tpu, "gpu": attention_gpu}  # platform -> its Pallas forward kernel
NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free
DENSE_BLOCKS = 8  # at most this many query blocks in `dense`
CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")  # the KV cache's logical axes
_PAD_Q, _PAD_K = -1, -2  # segment ids of the block padding: they match nothing


@flax.struct.dataclass
class MaskIds:
    """The ids the mask is computed from. Query t of row b may attend key s when

        q_segment == k_segment  and  q_index >= k_index  and
        (q_branch == k_branch  or  (k_branch == 0 and k_position < q_first))

    q_* [B, T], k_* [B, S], int32. `packed`: queries and keys are the same tokens in the same order
    (q_index == k_index == 0..T-1), so a key block after a query block is masked whole.
    """

    q_segment: jax.Array
    q_index: jax.Array
    q_branch: jax.Array
    q_first: jax.Array  # first position of the query's (segment, branch) run: the trunk it sees
    k_segment: jax.Array
    k_index: jax.Array
    k_branch: jax.Array
    k_position: jax.Array
    packed: bool = flax.struct.field(pytree_node=False, default=False)

    def queries(self):
        return self.q_segment, self.q_index, self.q_branch, self.q_first

    def keys(self):
        return self.k_segment, self.k_index, self.k_branch, self.k_position


def packed_ids(segment_ids, positions, branch_ids=None) -> MaskIds:
    """Ids of packed rows ([B, T] each): causal within a segment (0 = padding).

    With `branch_ids`, a segment is a *trunk* (branch 0) followed by branches 1, 2, ...: each branch
    continues a prefix of the trunk, its positions going on from the prefix length, and attends to
    the trunk tokens before its first position and to its own earlier tokens, never to other
    branches. So sequences sharing a prefix (forecasting examples of one trajectory) compute exactly
    what they would alone, with the prefix packed once.
    """
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    B, T = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if branch_ids is None:
        branch_ids = jnp.zeros_like(segment_ids)
    branch_ids = jnp.asarray(branch_ids, jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              (segment_ids[:, 1:] != segment_ids[:, :-1]) | (branch_ids[:, 1:] != branch_ids[:, :-1])],
                             axis=1)
    run_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    first = jnp.take_along_axis(positions, run_start, axis=1)
    return MaskIds(segment_ids, index, branch_ids, first, segment_ids, index, branch_ids, positions, packed=True)


@flax.struct.dataclass
class CacheIds:
    """Queries at `positions` [B, T] over a KV cache (slot == position): slot s is visible to the
    query at position p when s <= p. filled [B]: the slots row b's queries read at most, its length
    after the call (0 for a row that appends nothing: its outputs are unused). Attention reads no
    key block past the longest row's `filled`."""

    positions: jax.Array
    filled: jax.Array

    def mask_ids(self, max_len: int) -> MaskIds:
        """The same rule as `MaskIds` over `max_len` slots (for the blockwise kernels and tests)."""
        positions = jnp.asarray(self.positions, jnp.int32)
        B, T = positions.shape
        zq = jnp.zeros((B, T), jnp.int32)
        slots = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (B, max_len))
        zk = jnp.zeros((B, max_len), jnp.int32)
        return MaskIds(zq, positions, zq, zq, zk, slots, zk, slots)


def allowed(queries, keys) -> jax.Array:
    """(segment, index, branch, first) [B, t] and (segment, index, branch, position) [B, s]
    -> bool [B, t, s]: the rule of `MaskIds`."""
    return mask_rule.allowed(tuple(a[:, :, None] for a in queries), tuple(a[:, None, :] for a in keys))


def dense_mask(ids: MaskIds) -> jax.Array:
    """bool [B, T, S]: the whole mask (the dense implementation and tests)."""
    return allowed(ids.queries(), ids.keys())


def attention(q, k, v, ids: MaskIds, *, implementation: str = "auto", block: int = 512,
              mesh: Mesh | None = None) -> jax.Array:
    """q [B, T, H, D], k/v [B, S, K, D] (H a multiple of K) -> [B, T, H, D].

    mesh: the devices the program is compiled for (default: the default backend's): it names the
    platform (a program compiled ahead of time for a TPU topology on a CPU host is a TPU program) and
    how the kernel's rows and heads are split."""
    platform = platform_of(mesh)
    chosen = choose(implementation, q.shape[1], k.shape[1], q.shape[-1], block, ids.packed, platform)
    if chosen == "dense":
        return dense(q, k, v, ids, block=block)
    return blockwise(q, k, v, ids, block=block, kernel=None if chosen == "blockwise" else _kernel(platform, mesh))


def cached(q, kv, layer: int, ids: CacheIds, *, implementation: str = "auto", block: int = 512,
           mesh: Mesh | None = None):
    """q [B, T, H, D] over cache row `layer` of the stacked cache window kv = (k, v [L, B, S, K, D])
    -> (out [B, T, H, D], kv: the same cache, threaded through the loop that read it).

    The kernel where `choose` takes it for a prefill chunk (T > 1: its blocks of queries fill the
    TPU's tiles); otherwise `cache_loop`, whatever `implementation` says: it computes what dense
    would, reading only the filled key blocks."""
    platform = platform_of(mesh)
    T, S = q.shape[1], kv[0].shape[2]
    if T == 1 and platform == "gpu" and attention_gpu.decode_supports(S, q.shape[-1]):
        return gpu_decode(q, kv, layer, ids, mesh=mesh), kv
    if T > 1 and choose(implementation, T, S, q.shape[-1], block, False, platform) == "pallas":
        k, v = (a[layer].astype(q.dtype) for a in kv)
        return blockwise(q, k, v, ids.mask_ids(S), block=block, kernel=_kernel(platform, mesh)), kv
    return cache_loop(q, kv, layer, ids, block=block)


def gpu_decode(q, kv, layer, ids: CacheIds, *, mesh: Mesh | None = None, interpret: bool = False):
    """A decode step's attention (q [B, 1, H, D]) as the GPU decode kernel (`attention_gpu.decode`):
    what `cache_loop` computes for the rows that append a token, with no loop whose trip count the
    host reads. Under a mesh each device runs it on its rows and KV heads, the cache where it lies."""
    run = functools.partial(attention_gpu.decode, interpret=interpret)
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None or mesh.size == 1:
        return run(q[:, 0], *kv, layer, ids.filled)[:, None]
    cache = shd.logical_to_spec(CACHE_AXES, kv[0].shape, mesh)
    rows, heads = cache[1], cache[3]
    out = jax.shard_map(run, mesh=mesh, in_specs=(P(rows, heads, None), cache, cache, P(), P(rows)),
                        out_specs=P(rows, heads, None), check_vma=False)(q[:, 0], *kv, layer, ids.filled)
    return out[:, None]


def platform_of(mesh: Mesh | None) -> str:
    """The platform a program for `mesh` runs on (the default backend's without one)."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _kernel(platform: str, mesh: Mesh | None) -> "Kernel":
    """The platform's kernel; off TPU and GPU the TPU kernel in interpret mode."""
    return Kernel(platform if platform in KERNELS else "tpu", platform not in KERNELS, mesh)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """How the `pallas` forward runs: which platform's kernel, compiled or in interpret mode, under
    which mesh (a kernel is one custom call per device, so it runs inside `shard_map`)."""

    platform: str  # a key of KERNELS
    interpret: bool = False
    mesh: Mesh | None = None


def choose(implementation: str, T: int, S: int, head_dim: int, block: int, packed: bool,
           platform: str) -> str:
    """The implementation that runs: `auto` resolves by shape and platform (the module docstring)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    if implementation in ("dense", "blockwise"):
        return implementation
    if implementation == "auto" and (T == 1 or (T <= block and S <= block)):
        return "dense"
    blocks = block_layout(T, S, block, packed, kernel=True)
    kernel = KERNELS.get(platform, attention_tpu).supports(blocks.bq, blocks.bk, head_dim) and (
        implementation == "pallas" or platform in KERNELS)
    chosen = "pallas" if kernel else "blockwise"
    _log_once(implementation, chosen, T, S, head_dim, block)
    return chosen


@functools.cache
def _log_once(implementation: str, chosen: str, T: int, S: int, head_dim: int, block: int) -> None:
    why = "" if chosen != "blockwise" or implementation == "auto" else (
        f": the kernel does not take blocks of {block} over head_dim {head_dim}")
    logging.info("attention: %s (%s, %d queries x %d keys)%s", chosen, implementation, T, S, why)


def dense(q, k, v, ids: MaskIds, *, block: int | None = None) -> jax.Array:
    """Scores and softmax in float32 (as transformers does), probabilities cast back for the value
    product. Packed rows with `block` < T: query block i scores only the keys up to its end (every
    later key is masked: causal), each block's softmax still exact over all the keys it may see."""
    B, T, H, D = q.shape
    K = k.shape[2]
    # heads before tokens, so each product is a batched matmul whose output is already
    # [B, K, G, T, S] (with t before g XLA:CPU transposed every score twice: 1.3-2.5x slower)
    qg = q.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    mask = dense_mask(ids)
    step = _query_block(T, block) if ids.packed and block else T
    outs = []
    for lo in range(0, T, step):
        hi = min(T, lo + step)
        end = hi if ids.packed else k.shape[1]  # in a packed row every key after the queries is masked
        outs.append(_dense_block(qg[:, :, :, lo:hi], kk[:, :, :end], vv[:, :, :end], mask[:, lo:hi, :end], D))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _query_block(T: int, block: int) -> int:
    """Queries per block of `dense` on packed rows: `block`, or more where T would need more than
    DENSE_BLOCKS of them (each is its own products in the program: long rows stay few)."""
    return max(block, _round_up(-(-T // DENSE_BLOCKS), 8))


def _dense_block(qg, kk, vv, mask, D: int) -> jax.Array:
    """qg [B, K, G, t, D], kk / vv [B, K, s, D], mask [B, t, s] -> [B, K, G, t, D]."""
    s = jnp.einsum("bkgtd,bksd->bkgts", qg, kk, preferred_element_type=jnp.float32) * (D ** -0.5)
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    probs = jax.nn.softmax(s, axis=-1).astype(vv.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, vv)


# -- blockwise -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Blocks:
    """Static layout of one blockwise call: block sizes and the (query block, key block) pairs
    it visits."""

    bq: int
    bk: int
    pairs: tuple[tuple[int, int], ...]

    @property
    def padded(self) -> tuple[int, int]:
        """(queries, keys) after padding to whole blocks."""
        return (1 + max(i for i, _ in self.pairs)) * self.bq, (1 + max(j for _, j in self.pairs)) * self.bk


def block_layout(T: int, S: int, block: int, packed: bool, kernel: bool = False) -> Blocks:
    """The blocks of T queries over S keys. Packed rows use one size for both, so the diagonal
    blocks line up, and skip the pairs above the diagonal. A kernel's blocks are multiples of 128
    (TPU lanes; whole GPU tiles)."""
    multiple = 128 if kernel else 8
    bq, bk = min(block, _round_up(T, multiple)), min(block, _round_up(S, multiple))
    if packed:
        bq = bk = max(bq, bk)
    nq, nk = -(-T // bq), -(-S // bk)
    return Blocks(bq, bk, tuple((i, j) for i in range(nq) for j in range(nk) if not packed or j <= i))


def blockwise(q, k, v, ids: MaskIds, *, block: int = 512, kernel: Kernel | None = None) -> jax.Array:
    """Online-softmax attention over (query block, key block) pairs; T and S need not be multiples
    of the block (both are padded with ids that match nothing). A query that may see no key gets 0.
    kernel: None (the forward as an XLA loop), or how the Pallas forward runs (`pallas`)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    blocks = block_layout(T, S, block, ids.packed, kernel is not None)
    Tp, Sp = blocks.padded
    qg = _pad(q.reshape(B, T, K, H // K, D), Tp)
    queries = tuple(_pad(a, Tp, fill) for a, fill in zip(ids.queries(), (_PAD_Q, 0, 0, 0)))
    keys = tuple(_pad(a, Sp, fill) for a, fill in zip(ids.keys(), (_PAD_K, 0, 0, 0)))
    out = _flash(blocks, kernel, ids.packed, qg, _pad(k, Sp), _pad(v, Sp), queries, keys)
    return out[:, :T].reshape(B, T, H, D)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(blocks: Blocks, kernel: Kernel | None, packed: bool, q, k, v, queries, keys):
    return _forward(blocks, kernel, packed, q, k, v, queries, keys)[0]


def _forward(blocks: Blocks, kernel: Kernel | None, packed: bool, q, k, v, queries, keys):
    """-> (out, log-sum-exp): the Pallas kernel or the XLA loop; both compute `_flash_forward`."""
    if kernel is None:
        return _flash_forward(blocks, q, k, v, queries, keys)
    forward = functools.partial(KERNELS[kernel.platform].forward, blocks.bq, blocks.bk, packed,
                                interpret=kernel.interpret)
    mesh = kernel.mesh
    if mesh is None or mesh.size == 1:
        return forward(q, k, v, queries, keys)
    qs, ks, ids = _kernel_specs(q.shape, mesh)
    return jax.shard_map(forward, mesh=mesh, in_specs=(qs, ks, ks, (ids,) * 4, (ids,) * 4),
                         out_specs=(qs, P(*qs[:4])), check_vma=False)(q, k, v, queries, keys)


def _kernel_specs(shape, mesh: Mesh) -> tuple[P, P, P]:
    """How a kernel's inputs split over devices: (q [B, Tp, K, G, D], k / v, ids). Rows over the
    batch axes, heads over tp by KV head where it divides them, else by query group (each device
    then holds every KV head)."""
    qs = shd.logical_to_spec(("batch", None, "kv_heads", "q_heads", None), shape, mesh)
    return qs, P(qs[0], None, qs[2], None), P(qs[0], None)


def _gpu_backward(kernel: Kernel, packed: bool, q, k, v, queries, keys, d_out, lse, delta):
    """`attention_gpu.backward`, per device under the kernel's mesh. Split by query group, a
    device's dK / dV are its groups' share: summed over the devices of that split."""
    backward = functools.partial(attention_gpu.backward, packed=packed, interpret=kernel.interpret)
    mesh = kernel.mesh
    if mesh is None or mesh.size == 1:
        return backward(q, k, v, queries, keys, d_out, lse, delta)
    qs, ks, ids = _kernel_specs(q.shape, mesh)
    stat = P(*qs[:4])

    def run(*args):
        dq, dk, dv = backward(*args)
        if qs[3] is not None:
            dk, dv = (jax.lax.psum(x.astype(jnp.float32), qs[3]).astype(x.dtype) for x in (dk, dv))
        return dq, dk, dv

    return jax.shard_map(run, mesh=mesh, in_specs=(qs, ks, ks, (ids,) * 4, (ids,) * 4, qs, stat, stat),
                         out_specs=(qs, ks, ks), check_vma=False)(q, k, v, queries, keys, d_out, lse, delta)


def _flash_forward(blocks: Blocks, q, k, v, queries, keys):
    """q [B, Tp, K, G, D], k/v [B, Sp, K, D] -> (out like q, log-sum-exp [B, Tp, K, G] float32)."""
    B, Tp, K, G, D = q.shape
    scale = D ** -0.5

    pairs = jnp.asarray(blocks.pairs, jnp.int32)

    def body(n, carry):
        i, j = pairs[n, 0] * blocks.bq, pairs[n, 1] * blocks.bk
        s, mask = _scores(blocks, q, k, queries, keys, i, j, scale)
        rows = _online_step(*(_rows(x, i, blocks.bq) for x in carry), s, mask, _rows(v, j, blocks.bk))
        return tuple(_put(x, r, i) for x, r in zip(carry, rows))

    acc, m, l = loops.fori("attention", len(blocks.pairs), body, _online_init(q.shape))
    return _online_result(acc, m, l, q.dtype)


def cache_loop(q, kv, layer: int, ids: CacheIds, *, block: int = 512):
    """`cached`'s XLA path: an online softmax over key blocks of `block` slots, as many as the
    longest row's `filled` needs (a `loops.fori` of kind "cache" with a run-time trip count), so the
    blocks past it are neither read nor computed. q [B, T, H, D], kv = (k, v [L, B, S, K, D])
    -> (out [B, T, H, D], kv).

    The cache goes through the loop's carry and comes out as its result: a loop that only captured
    it would need its own copy of it, because the next layer writes into it in place. Each block is
    sliced (and cast to q's dtype) inside the loop, for the same reason."""
    B, T, H, D = q.shape
    S, K = kv[0].shape[2], kv[0].shape[3]
    bk = min(block, S)
    qg = q.reshape(B, T, K, H // K, D)

    def body(j, carry):
        (k, v), online = carry
        start = jnp.minimum(j * bk, S - bk)  # where bk does not divide S the last block overlaps the one before
        slots = start + jnp.arange(bk, dtype=jnp.int32)
        kb, vb = (jax.lax.dynamic_slice(a, (layer, 0, start, 0, 0), (1, B, bk, K, D))[0].astype(q.dtype)
                  for a in (k, v))
        s = jnp.einsum("btkgd,bskd->btkgs", qg, kb, preferred_element_type=jnp.float32) * D ** -0.5
        # slots of an overlapped block were counted by the block before; a block past the end is all masked
        mask = ((slots >= j * bk) & (slots <= ids.positions[:, :, None]))[:, :, None, None, :]
        return (k, v), _online_step(*online, jnp.where(mask, s, NEG_INF), mask, vb)

    carry = (tuple(kv), _online_init(qg.shape))
    if bk == S:  # one block holds the window: no loop to run (XLA:CPU pays for each one per layer)
        kv, (acc, m, l) = body(0, carry)
    else:
        kv, (acc, m, l) = loops.fori("cache", (jnp.max(ids.filled) + bk - 1) // bk, body, carry)
    return _online_result(acc, m, l, q.dtype)[0].reshape(B, T, H, D), kv


def _online_init(shape):
    """(acc, running max, running sum) of queries of `shape` [..., D] before any key."""
    return (jnp.zeros(shape, jnp.float32), jnp.full(shape[:-1], NEG_INF, jnp.float32),
            jnp.zeros(shape[:-1], jnp.float32))


def _online_step(acc, m, l, s, mask, vb):
    """One key block of the online softmax: scores s [B, t, K, G, s] (masked to NEG_INF), its mask,
    values vb [B, s, K, D] -> the updated (acc, m, l). A fully masked block leaves them unchanged."""
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    pv = jnp.einsum("btkgs,bskd->btkgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return acc * correction[..., None] + pv, m_new, l * correction + p.sum(-1)


def _online_result(acc, m, l, dtype):
    """-> (out, log-sum-exp): a query that saw no key gets 0 and lse +inf (p = 0 in the backward)."""
    seen = l > 0
    out = (acc / jnp.where(seen, l, 1.0)[..., None]).astype(dtype)
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _flash_fwd(blocks, kernel, packed, q, k, v, queries, keys):
    out, lse = _forward(blocks, kernel, packed, q, k, v, queries, keys)
    return out, (q, k, v, queries, keys, out, lse)


def _flash_bwd(blocks: Blocks, kernel: Kernel | None, packed: bool, residuals, d_out):
    """FlashAttention-2's backward: each pair's probabilities recomputed from the saved log-sum-exp.
    The GPU kernel's two passes (`attention_gpu.backward`) under the GPU kernel, else an XLA loop
    over the pairs."""
    q, k, v, queries, keys, out, lse = residuals
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Tp, K, G]
    if kernel is not None and kernel.platform == "gpu":
        grads = _gpu_backward(kernel, packed, q, k, v, queries, keys, d_out, lse, delta)
    else:
        grads = _xla_backward(blocks, q, k, v, queries, keys, d_out, lse, delta)
    no_grad = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), (queries, keys))
    return (*grads, *no_grad)


def _xla_backward(blocks: Blocks, q, k, v, queries, keys, d_out, lse, delta):
    """-> (dq, dk, dv): one `loops.fori` over the pairs, every block's product an XLA matmul."""
    scale = q.shape[-1] ** -0.5
    pairs = jnp.asarray(blocks.pairs, jnp.int32)

    def body(n, carry):
        dq, dk, dv = carry
        i, j = pairs[n, 0] * blocks.bq, pairs[n, 1] * blocks.bk
        s, mask = _scores(blocks, q, k, queries, keys, i, j, scale)
        p = jnp.where(mask, jnp.exp(s - _rows(lse, i, blocks.bq)[..., None]), 0.0)
        do = _rows(d_out, i, blocks.bq)
        qb, kb, vb = _rows(q, i, blocks.bq), _rows(k, j, blocks.bk), _rows(v, j, blocks.bk)
        dv = _add(dv, jnp.einsum("btkgs,btkgd->bskd", p.astype(do.dtype), do, preferred_element_type=jnp.float32), j)
        dp = jnp.einsum("btkgd,bskd->btkgs", do, vb, preferred_element_type=jnp.float32)
        ds = (p * (dp - _rows(delta, i, blocks.bq)[..., None]) * scale).astype(q.dtype)
        dq = _add(dq, jnp.einsum("btkgs,bskd->btkgd", ds, kb, preferred_element_type=jnp.float32), i)
        dk = _add(dk, jnp.einsum("btkgs,btkgd->bskd", ds, qb, preferred_element_type=jnp.float32), j)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = loops.fori("attention", len(blocks.pairs), body, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _scores(blocks: Blocks, q, k, queries, keys, i, j, scale):
    """Block (i, j)'s scaled float32 scores [B, bq, K, G, bk] (masked to NEG_INF) and its mask
    [B, bq, 1, 1, bk]."""
    qb, kb = _rows(q, i, blocks.bq), _rows(k, j, blocks.bk)
    s = jnp.einsum("btkgd,bskd->btkgs", qb, kb, preferred_element_type=jnp.float32) * scale
    mask = allowed(tuple(_rows(a, i, blocks.bq) for a in queries),
                   tuple(_rows(a, j, blocks.bk) for a in keys))[:, :, None, None, :]
    return jnp.where(mask, s, NEG_INF), mask


def _rows(x, start, size):
    """x[:, start:start + size] (axis 1 is the token axis of every blockwise array)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _put(x, block, start):
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), start, axis=1)


def _add(x, block, start):
    return _put(x, _rows(x, start, block.shape[1]) + block, start)


def _pad(x, length: int, fill=0):
    extra = length - x.shape[1]
    if not extra:
        return x
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths, constant_values=fill)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
