"""Qwen2 / Qwen2.5 / Qwen3 dense decoder in Flax NNX.

Layout decisions:
- Decoder-layer weights are stored *stacked* with a leading `layers` axis, always. `scan_layers`
  only chooses how they are executed (`lax.scan` or an unrolled Python loop over slices), so both
  run the same parameters and checkpoints never depend on the execution mode.
- Projections keep their head structure (`q_proj: [layers, embed, q_heads, head_dim]`) so every
  dimension has a logical axis name for sharding (`PARAM_AXES`).
- One forward serves three callers:
  `__call__(tokens, positions, segment_ids)` for padded or packed rows (segment id 0 = padding; no
  attention across segments), `hidden_states` + `unembed` for the chunked-vocab train step (which
  also takes `branch_ids`: sequences sharing a prefix packed once, see `attention.packed_ids`), and
  `decode(tokens, num_new, cache)` for the sampler's KV cache (prefill, decode and multi-turn
  extension are all "append `num_new[b]` tokens to row b").
"""
from __future__ import annotations

import dataclasses
import functools
import math
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import attention as attn
from models import linear
from models import lora as lora_lib
from models import loops
from models import sharding as shd
from models.config import QwenConfig

# NNX parameter path -> logical axes. The single source of truth for parameter sharding.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("norm",),
    "layers/attn_norm": ("layers", "norm"),
    "layers/q_proj": ("layers", "embed", "q_heads", "head_dim"),
    "layers/k_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/v_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/q_bias": ("layers", "q_heads", "head_dim"),
    "layers/k_bias": ("layers", "kv_heads", "head_dim"),
    "layers/v_bias": ("layers", "kv_heads", "head_dim"),
    "layers/q_norm": ("layers", "head_dim"),
    "layers/k_norm": ("layers", "head_dim"),
    "layers/o_proj": ("layers", "q_heads", "head_dim", "embed"),
    "layers/mlp_norm": ("layers", "norm"),
    "layers/gate_proj": ("layers", "embed", "mlp"),
    "layers/up_proj": ("layers", "embed", "mlp"),
    "layers/down_proj": ("layers", "mlp", "embed"),
    **lora_lib.param_axes(),  # present only for a config's LoRA targets
}
CACHE_AXES = attn.CACHE_AXES

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def param_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter present in this config (absent ones are omitted)."""
    L, E, H, K, D, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    shapes = {
        "embed": (V, E),
        "final_norm": (E,),
        "layers/attn_norm": (L, E),
        "layers/q_proj": (L, E, H, D),
        "layers/k_proj": (L, E, K, D),
        "layers/v_proj": (L, E, K, D),
        "layers/o_proj": (L, H, D, E),
        "layers/mlp_norm": (L, E),
        "layers/gate_proj": (L, E, F),
        "layers/up_proj": (L, E, F),
        "layers/down_proj": (L, F, E),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, E)
    if cfg.qkv_bias:
        shapes.update({"layers/q_bias": (L, H, D), "layers/k_bias": (L, K, D), "layers/v_bias": (L, K, D)})
    if cfg.qk_norm:
        shapes.update({"layers/q_norm": (L, D), "layers/k_norm": (L, D)})
    if cfg.lora is not None:
        shapes.update(lora_lib.adapter_shapes(shapes, cfg.lora))
    return shapes


def _param(name: str, shape, cfg: QwenConfig, key) -> nnx.Param:
    """A new parameter: with LoRA the adapters are `nnx.LoRAParam`s in `param_dtype` and the base
    weights are stored in the compute dtype; otherwise every weight is in `param_dtype`."""
    if cfg.lora is None:
        return nnx.Param(_init_value(name, shape, jnp.dtype(cfg.param_dtype), key))
    if lora_lib.is_adapter(name):
        return nnx.LoRAParam(lora_lib.init_value(name, shape, jnp.dtype(cfg.param_dtype), key))
    return nnx.Param(_init_value(name, shape, jnp.dtype(cfg.dtype), key))


def _init_value(name: str, shape, dtype, key) -> jax.Array:
    leaf = name.rsplit("/", 1)[-1]
    if leaf.endswith("norm"):
        return jnp.ones(shape, dtype)
    if leaf.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class DecoderStack(nnx.Module):
    """All decoder layers' weights, stacked on a leading `layers` axis."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, p in params.items():
            setattr(self, name, p)

    def arrays(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


@flax.struct.dataclass
class KVCache:
    """Per-row KV cache. Row b holds one sequence in slots [0, lengths[b]); slot == position."""

    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array
    lengths: jax.Array  # [batch] int32

    @classmethod
    def zeros(cls, cfg: QwenConfig, batch: int, max_len: int, dtype=None, mesh=None) -> "KVCache":
        dtype = jnp.dtype(dtype or cfg.dtype)
        shape = cache_shape(cfg, batch, max_len)
        # made on their shardings (no whole cache on one device first); k and v are distinct
        # buffers so a jitted update can donate both
        shardings = cache_shardings(cfg, batch, max_len, mesh)
        kv, rows = (None, None) if shardings is None else (shardings[0].k, shardings[1])
        return cls(k=jnp.zeros(shape, dtype, device=kv), v=jnp.zeros(shape, dtype, device=kv),
                   lengths=jnp.zeros((batch,), jnp.int32, device=rows))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class Qwen(nnx.Module):
    """Qwen decoder-only LM. Build with `create_model` (sharded init) or `models.load_hf_model`."""

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh
        values = {name: _param(name, shape, cfg, rngs.params()) for name, shape in param_shapes(cfg).items()}
        self.embed = values.pop("embed")
        self.final_norm = values.pop("final_norm")
        self.lm_head = values.pop("lm_head", None)
        self.layers = DecoderStack({k.split("/", 1)[1]: v for k, v in values.items()})

    # -- public forwards ---------------------------------------------------------------------------
    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """tokens [B, T] -> float32 logits [B, T, V]."""
        return self.unembed(self.hidden_states(tokens, positions, segment_ids))

    def hidden_states(self, tokens, positions=None, segment_ids=None, branch_ids=None) -> jax.Array:
        """Final-norm hidden states [B, T, E] of padded or packed rows.

        segment_ids [B, T]: tokens attend only to earlier tokens of the same segment; 0 marks
        padding. positions [B, T]: RoPE positions; default restarts at 0 in every segment run.
        branch_ids [B, T]: optional prefix sharing inside segments (`attention.packed_ids`).
        """
        tokens = jnp.asarray(tokens)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        if positions is None:
            positions = positions_from_segments(segment_ids)
        ids = attn.packed_ids(segment_ids, positions, branch_ids)
        x, _ = self._run_layers(tokens, positions, ids, cache=None)
        return x

    def decode(self, tokens, num_new, cache: KVCache, layer_params=None) -> tuple[jax.Array, KVCache]:
        """Appends tokens[b, :num_new[b]] to row b of `cache`; returns hidden [B, T, E], new cache.

        Positions are the cache slots (lengths[b] + t). Entries t >= num_new[b] are padding: their
        outputs are garbage and they are not written. Tokens that would land past the cache end are
        dropped; callers must check `lengths + num_new <= max_len` (the sampler finishes such a row
        with `context_full`). `layer_params` (from `layer_params()`, computed once outside a decode
        loop) runs the layers unrolled on per-layer matrices in the decode layout instead of slicing
        the stacked weights at every step, which XLA:CPU does by copying them.

        Each layer writes its new K/V into the cache and then attends over the cache: the next
        layer's write depends on this layer's reads, so XLA updates the cache in place (a write
        after all layers could be ordered before the last layer's reads and forces a copy).
        """
        tokens = jnp.asarray(tokens)
        T = tokens.shape[1]
        num_new = jnp.asarray(num_new, jnp.int32)
        t = jnp.arange(T)
        positions = cache.lengths[:, None] + t[None, :]
        slots = jnp.where(t[None, :] < num_new[:, None], positions, cache.max_len)  # OOB -> dropped
        filled = jnp.where(num_new > 0, jnp.minimum(cache.lengths + num_new, cache.max_len), 0)
        ids = attn.CacheIds(positions, filled)
        x, (k, v) = self._run_layers(tokens, positions, ids, cache=(cache.k, cache.v, slots),
                                     layer_params=layer_params)
        lengths = jnp.minimum(cache.lengths + num_new, cache.max_len)
        return x, KVCache(k=k, v=v, lengths=lengths)

    def unembed(self, hidden, decode_layout: bool = False) -> jax.Array:
        """hidden [..., E] -> float32 logits [..., V]. decode_layout: multiply as [V, E] @ [E, rows]
        (see `layer_params`), for a decode step's few rows."""
        head = self.lm_head_weight().astype(hidden.dtype)
        if decode_layout:
            return _matmul_out_in(hidden, head).astype(jnp.float32)
        return jnp.einsum("...e,ve->...v", hidden, head, preferred_element_type=jnp.float32)

    def layer_params(self) -> list[dict[str, jax.Array]]:
        """One dict of weights per decoder layer in the *decode layout*: the projections of each
        `_FUSED` group as one 2-D [sum of outs, in] matrix keyed "q_proj+k_proj+v_proj", norms and
        biases as stored.

        At a decode step's few rows XLA:CPU multiplies [out, in] @ [in, rows] 1.2-2x faster than
        [rows, in] @ [in, out] (it is kernel-bound there, not memory-bound), and one product per
        group saves per-op overhead; the sampler makes this copy once per parameter update. LoRA
        adapters are merged into it (in the compute dtype).
        """
        params = self.layers.arrays()
        out = []
        for i in range(self.cfg.num_layers):
            w = {k: v[i] for k, v in params.items()}
            if self.cfg.lora is not None:  # a copy anyway: the adapters are merged into it
                w = lora_lib.merged(w, self.cfg.lora.scale)
            for group in _FUSED:
                mats = [w.pop(name) for name in group]
                n_in = _PROJECTIONS[group[0]][1]
                w["+".join(group)] = jnp.concatenate(
                    [m.reshape(math.prod(m.shape[:n_in]), -1) for m in mats], axis=1).T
            out.append(w)
        return out

    def lm_head_weight(self) -> jax.Array:
        """[V, E]: the untied head, or the embedding when tied."""
        return (self.embed if self.lm_head is None else self.lm_head)[...]

    # -- internals ---------------------------------------------------------------------------------
    def _run_layers(self, tokens, positions, ids, cache=None, layer_params=None):
        """-> (final-normed hidden, cache). cache: None, or (k, v [L,B,S,K,D], slots [B,T]) to write
        the new tokens' K/V at and attend over (slots past the end are dropped)."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        # between layers the residual stream is kept in the compute dtype (remat saves one per layer);
        # each layer adds to it in float32 (see _decoder_layer)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dtype)
        # the residual stream of whole rows is split over tokens (act_seq); a sampler's chunk of a
        # few tokens per row is not (and the TPU compiler fails on that split on some host meshes)
        residual = ("batch", "act_seq" if cache is None else None, "act_embed")
        x = shd.constrain(x, residual, self.mesh)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        layer = functools.partial(_decoder_layer, cfg=cfg, cos=cos, sin=sin, ids=ids, mesh=self.mesh,
                                  residual=residual, decode_layout=layer_params is not None)
        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat])
        params = self.layers.arrays()
        kv, slots = (None, None) if cache is None else (cache[:2], cache[2])

        def body(carry, xs):
            h, kv = carry
            p, i = xs
            return layer(p, h, kv, i, slots), None

        if layer_params is None and cfg.scan_layers:
            (x, kv), _ = loops.scan("layers", body, (x, kv), (params, jnp.arange(cfg.num_layers)))
        else:
            for i in range(cfg.num_layers):
                p = layer_params[i] if layer_params is not None else jax.tree.map(lambda a: a[i], params)
                (x, kv), _ = body((x, kv), (p, i))
        x = rms_norm(x, self.final_norm[...].astype(dtype), cfg.rms_norm_eps).astype(dtype)
        return x, kv


# projection -> (einsum in the stored layout, number of leading weight dims that are inputs)
_PROJECTIONS = {
    "q_proj": ("bte,ehd->bthd", 1),
    "k_proj": ("bte,ehd->bthd", 1),
    "v_proj": ("bte,ehd->bthd", 1),
    "o_proj": ("bthd,hde->bte", 2),
    "gate_proj": ("bte,ef->btf", 1),
    "up_proj": ("bte,ef->btf", 1),
    "down_proj": ("btf,fe->bte", 1),
}


# projections multiplied together in the decode layout (they read the same input)
_FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def _matmul_out_in(x, w) -> jax.Array:
    """x [..., in] times w [out, in] -> [..., out], computed as w @ x^T.

    The barrier keeps XLA from folding the transpose of the [out, rows] product into the dot, which
    would bring back the slow [rows, in] @ [in, out] kernel.
    """
    rows = x.reshape(-1, x.shape[-1])
    return jax.lax.optimization_barrier(w @ rows.T).T.reshape(*x.shape[:-1], w.shape[0])


def _project(names: tuple[str, ...], x, w: dict, out_shapes, decode_layout: bool, platform: str,
             lora_scale: float = 0.0) -> tuple[jax.Array, ...]:
    """x times each projection of a `_FUSED` group: one product each in the stored layout
    (`linear.project`, plus its LoRA adapter's low-rank product where it has one), one product with
    the group's [out, in] matrix in the decode layout (adapters already merged into it)."""
    if not decode_layout:
        def one(n):
            equation, n_in = _PROJECTIONS[n]
            y = linear.project(equation, x, w[n], n_in, platform)
            a, b = lora_lib.adapter_names(n)
            return y if a not in w else y + lora_lib.delta(n, x, w[a], w[b], lora_scale)
        return tuple(one(n) for n in names)
    x = x.reshape(*x.shape[:2], -1)  # [B, T, in]: o_proj's input is per head
    y = _matmul_out_in(x, w["+".join(names)])
    sizes = [math.prod(s) for s in out_shapes]
    parts = jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    return tuple(p.reshape(*x.shape[:2], *s) for p, s in zip(parts, out_shapes))


def _decoder_layer(p: dict[str, jax.Array], x, kv, layer, slots, *, cfg: QwenConfig, cos, sin, ids, mesh,
                   residual, decode_layout: bool = False):
    """One pre-norm decoder layer -> (x, kv). p: one layer's weights, stored layout or (with
    decode_layout) `Qwen.layer_params`'.

    kv: None (attend over the T tokens themselves, ids a `MaskIds`), or the stacked cache
    (k, v [L,B,S,K,D]): this layer's K/V are written at [layer, b, slots[b, t]] and attention reads
    cache row `layer` as far as it is filled (ids a `CacheIds`).
    residual: the logical axes the residual stream is kept on.
    x arrives and leaves in the compute dtype and is summed in float32 within the layer: one rounding
    per layer (transformers rounds after each add), and half the bytes a float32 stream would take in
    what remat saves per layer.
    """
    dtype = jnp.dtype(cfg.dtype)
    x = x.astype(jnp.float32)
    w = {k: v.astype(dtype) for k, v in p.items()}
    H, K, D, E, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    proj = functools.partial(_project, w=w, decode_layout=decode_layout, platform=attn.platform_of(mesh),
                             lora_scale=0.0 if cfg.lora is None else cfg.lora.scale)
    with jax.named_scope("attention"):  # profiles name what a layer spends (docs/benchmarks.md)
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps).astype(dtype)
        q, k, v = proj(("q_proj", "k_proj", "v_proj"), h, out_shapes=((H, D), (K, D), (K, D)))
        if cfg.qkv_bias:
            q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = shd.constrain(q, ("batch", "seq", "q_heads", "head_dim"), mesh)
        knobs = dict(implementation=cfg.attention, block=cfg.attention_block, mesh=mesh)
        if kv is None:
            o = attn.attention(q, k, v, ids, **knobs)
        else:
            rows = jnp.arange(k.shape[0])[:, None]
            kv = tuple(c.at[layer, rows, slots].set(new.astype(c.dtype), mode="drop") for c, new in zip(kv, (k, v)))
            o, kv = attn.cached(q, kv, layer, ids, **knobs)
        x = x + proj(("o_proj",), o, out_shapes=((E,),))[0]
    x = shd.constrain(x, residual, mesh)
    with jax.named_scope("mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps).astype(dtype)
        gate, up = proj(("gate_proj", "up_proj"), h, out_shapes=((F,), (F,)))
        x = x + proj(("down_proj",), jax.nn.silu(gate) * up, out_shapes=((E,),))[0]
    return shd.constrain(x.astype(dtype), residual, mesh), kv


def rms_norm(x, weight, eps: float) -> jax.Array:
    """RMSNorm in float32, scaled in the input dtype (transformers' Qwen2RMSNorm order)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def rope_tables(positions, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim] in float32 for the half-rotation RoPE layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin) -> jax.Array:
    """x [B, T, H, D] -> rotate-half RoPE, computed in float32 and cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = x32 * cos[:, :, None, :] + jnp.concatenate([-x2, x1], axis=-1) * sin[:, :, None, :]
    return rotated.astype(x.dtype)


def positions_from_segments(segment_ids) -> jax.Array:
    """Position of each token within its run of equal segment ids: [B, T] int32."""
    seg = jnp.asarray(segment_ids)
    T = seg.shape[-1]
    t = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]], -1)
    run_start = jax.lax.cummax(jnp.where(starts, t, 0), axis=seg.ndim - 1)
    return t - run_start


# -- construction -----------------------------------------------------------------------------------
def param_path(keypath) -> str:
    """'layers/q_proj' from a jax key path into an nnx.State (the trailing `.value` is dropped)."""
    parts = []
    for k in keypath:
        name = getattr(k, "key", getattr(k, "name", None))
        if name == "value" and isinstance(k, jax.tree_util.GetAttrKey):
            continue
        parts.append(str(name))
    return "/".join(parts)


def param_sharding(name: str, shape, mesh: jax.sharding.Mesh):
    """NamedSharding of parameter `name` ('layers/q_proj') of `shape`: PARAM_AXES through the
    logical-axis rules. Every parameter placement in the code base comes from here."""
    return shd.named_sharding(PARAM_AXES[name], shape, mesh)


def state_shardings(state, mesh: jax.sharding.Mesh):
    """NamedSharding per leaf of a state that holds parameters (a model's, or a (model, optimizer)'s):
    each leaf is laid out as the parameter its path ends with, if it has that parameter's rank
    (AdamW's moments). An optimizer leaf shaped otherwise (a step count, a factored optimizer's row or
    column statistics) is replicated: any optax transform runs. A model's own parameter always
    matches (`PARAM_AXES` covers `param_shapes`)."""
    def one(path, leaf):
        name = param_path(path)
        for param in PARAM_AXES:
            if (name == param or name.endswith("/" + param)) and len(PARAM_AXES[param]) == len(leaf.shape):
                return param_sharding(param, leaf.shape, mesh)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree_util.tree_map_with_path(one, state)


def cache_shardings(cfg: QwenConfig, rows: int, slots: int, mesh) -> tuple[KVCache, object] | None:
    """(KVCache of shardings, the rows' sharding) of a cache of `rows` rows of `slots` positions on
    `mesh` (None without one): CACHE_AXES through the logical-axis rules, rows like the batch."""
    if mesh is None:
        return None
    kv = shd.named_sharding(CACHE_AXES, cache_shape(cfg, rows, slots), mesh)
    row = shd.named_sharding(("batch",), (rows,), mesh)
    return KVCache(k=kv, v=kv, lengths=row), row


def cache_shape(cfg: QwenConfig, rows: int, slots: int) -> tuple[int, ...]:
    """[layers, rows, slots, kv_heads, head_dim]: one of the cache's k and v."""
    return (cfg.num_layers, rows, slots, cfg.num_kv_heads, cfg.head_dim)


def frozen_config(cfg: QwenConfig) -> QwenConfig:
    """The config of a copy that only runs forward passes (the reference policy, a host's sampler
    replica): parameters stored in the compute dtype, adapters merged. Every weight is cast to the
    compute dtype where it is used, so such a copy computes exactly what the model does, in half the
    memory of float32 parameters (Qwen2.5-7B on a 4-chip host: 3.6 instead of 7.1 GiB per chip)."""
    return dataclasses.replace(cfg, param_dtype=cfg.dtype, lora=None)


def frozen_copy(model: Qwen) -> Qwen:
    """A copy of `model` on `frozen_config`: same shardings, parameters in the compute dtype, LoRA
    adapters merged into their weights."""
    cfg = frozen_config(model.cfg)
    graphdef, abstract = nnx.split(abstract_model(cfg, model.mesh))
    flat = merged_params(model)
    return nnx.merge(graphdef, with_arrays(abstract, lambda name: jnp.array(flat[name], dtype=cfg.param_dtype)))


# -- LoRA (models/lora.py) ----------------------------------------------------------------------------
def trainable(cfg: QwenConfig):
    """The nnx filter of the parameters an optimizer trains: the adapters with LoRA, else all."""
    return nnx.Param if cfg.lora is None else nnx.LoRAParam


def frozen(cfg: QwenConfig):
    """The nnx filter of the parameters no optimizer touches: the base weights under LoRA."""
    return nnx.Nothing if cfg.lora is None else nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def stored_dtype(cfg: QwenConfig) -> str:
    """The dtype the base weights are stored in: the compute dtype under LoRA, else `param_dtype`."""
    return cfg.param_dtype if cfg.lora is None else cfg.dtype


def merged_params(model: Qwen) -> dict[str, jax.Array]:
    """{'layers/q_proj': array, ...} of what `model` computes without adapters: each adapter
    merged into its weight (in the weight's dtype); the plain parameters without LoRA."""
    flat = flat_params(model)
    return flat if model.cfg.lora is None else lora_lib.merged(flat, model.cfg.lora.scale)


def base_view(model: Qwen) -> Qwen:
    """`model` with every adapter off: a model of `frozen_config` on the very base arrays (no copy).
    Under LoRA it is the reference policy of the KL term."""
    graphdef, _ = nnx.split(abstract_model(frozen_config(model.cfg), model.mesh))
    return nnx.merge(graphdef, nnx.state(model, frozen(model.cfg)))


def with_adapters(model: Qwen, lora: lora_lib.LoraConfig, *, param_dtype: str = "float32", seed: int = 0) -> Qwen:
    """`model` as the base of fresh adapters (A random, B zero: it computes what `model` does): its
    weights cast to the compute dtype, the adapters in `param_dtype`, created sharded."""
    cfg = model.cfg.replace(lora=lora, param_dtype=param_dtype)
    graphdef, abstract = nnx.split(abstract_model(cfg, model.mesh))
    adapters = nnx.state(abstract, nnx.LoRAParam)
    shardings = None if model.mesh is None else state_shardings(adapters, model.mesh)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():  # the base weights' initializers are dead code here, which XLA drops
        return nnx.state(Qwen(cfg, rngs=nnx.Rngs(seed), mesh=model.mesh), nnx.LoRAParam)

    base = jax.tree.map(lambda a: a.astype(cfg.dtype), nnx.state(model, nnx.Param))
    return nnx.merge(graphdef, base, init())


def with_arrays(state, array_of):
    """`state` (an nnx.State of parameters) with each leaf replaced by array_of(its param path)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: array_of(param_path(path)), state)


def abstract_model(cfg: QwenConfig, mesh=None) -> Qwen:
    return nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0), mesh=mesh))


def abstract_placed_model(cfg: QwenConfig, mesh=None) -> Qwen:
    """The model with abstract parameters laid out as `create_model` places them: what an
    ahead-of-time compile (`launch.plan`) takes instead of weights."""
    graphdef, state = nnx.split(abstract_model(cfg, mesh))
    if mesh is not None:
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                             state_shardings(state, mesh))
    return nnx.merge(graphdef, state)


def create_model(cfg: QwenConfig, *, seed: int = 0, mesh=None) -> Qwen:
    """Random-init model; under a mesh every parameter is created already sharded."""
    graphdef, abstract_state = nnx.split(abstract_model(cfg, mesh))
    out_shardings = None if mesh is None else state_shardings(abstract_state, mesh)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def init():
        return nnx.state(Qwen(cfg, rngs=nnx.Rngs(seed), mesh=mesh))

    return nnx.merge(graphdef, init())


def flat_params(tree) -> dict[str, jax.Array]:
    """{'layers/q_proj': array, ...}: the parameters of a model, or the leaves of a state of
    parameters (a gradient, a restored tree), keyed by parameter path."""
    state = nnx.state(tree, nnx.Param) if isinstance(tree, nnx.Module) else tree
    return {param_path(p): a for p, a in jax.tree_util.tree_leaves_with_path(state)}


def count_params(cfg: QwenConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(cfg).values())

