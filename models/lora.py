"""Low-rank adapters (LoRA) on the decoder's projections: the table, the math, nothing stateful.

A targeted projection `W` (stored layout, `models/qwen.py: _PROJECTIONS`) gains two adapter
parameters, stacked over layers like every decoder weight:

    y = x W + (alpha / rank) * (x A) B        A: [layers, *in, rank]   B: [layers, rank, *out]

A starts random (PEFT's kaiming-uniform bound 1/sqrt(fan_in)), B at zero, so a fresh adapter leaves
the model exactly as it was. With adapters the base weights are stored in the compute dtype and
frozen; A, B (and their AdamW state) are float32 `nnx.LoRAParam`s, the only trained parameters.

Why our own module and not `qwix` (on the package index): qwix attaches adapters by intercepting
`einsum` / `dot_general` calls on a module's weight attributes, one adapter per call site. Here the
projections are stacked `[layers, ...]` arrays sliced inside `lax.scan` by a plain function, so
qwix would see no weight (the slice drops its tag), and at best one adapter shared by all layers;
it also draws dropout from a fixed key. Stacked adapters with logical axes
(`param_axes`) shard by the same `LOGICAL_RULES` as the weights they adapt.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# projection -> (logical axes of its inputs, of its outputs), in the stored layout's order
PROJECTION_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "q_proj": (("embed",), ("q_heads", "head_dim")),
    "k_proj": (("embed",), ("kv_heads", "head_dim")),
    "v_proj": (("embed",), ("kv_heads", "head_dim")),
    "o_proj": (("q_heads", "head_dim"), ("embed",)),
    "gate_proj": (("embed",), ("mlp",)),
    "up_proj": (("embed",), ("mlp",)),
    "down_proj": (("mlp",), ("embed",)),
}
PROJECTIONS = tuple(PROJECTION_AXES)
RANK_AXIS = "lora_rank"  # replicated: rank is small and both products contract or produce it
SUFFIXES = ("_lora_a", "_lora_b")


class LoraConfigError(ValueError):
    """A LoRA setting that cannot describe adapters."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank >= 1; alpha: the update is scaled by alpha / rank (alpha 0: alpha = rank, scale 1);
    targets: the projections that get adapters (default all seven)."""

    rank: int
    alpha: float = 0.0
    targets: tuple[str, ...] = PROJECTIONS

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraConfigError(f"train.lora.rank={self.rank!r}: expected a whole number >= 1 (unset: full fine-tuning)")
        if self.alpha < 0:
            raise LoraConfigError(f"train.lora.alpha={self.alpha}: expected >= 0 (0: alpha = rank)")
        unknown = [t for t in self.targets if t not in PROJECTION_AXES]
        if unknown or not self.targets:
            raise LoraConfigError(f"train.lora.targets={tuple(self.targets)}: "
                                  + (f"unknown projection {unknown[0]!r}" if unknown else "empty")
                                  + f"; choose from {PROJECTIONS}")
        if len(set(self.targets)) != len(self.targets):
            raise LoraConfigError(f"train.lora.targets={tuple(self.targets)} names a projection twice")
        object.__setattr__(self, "targets", tuple(t for t in PROJECTIONS if t in self.targets))

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank


def adapter_names(projection: str) -> tuple[str, str]:
    return projection + SUFFIXES[0], projection + SUFFIXES[1]


def is_adapter(name: str) -> bool:
    """Whether a parameter path ('layers/q_proj_lora_a') names an adapter."""
    return name.endswith(SUFFIXES)


def param_axes() -> dict[str, tuple[str, ...]]:
    """Logical axes of every possible adapter, keyed like `qwen.PARAM_AXES`."""
    out = {}
    for proj, (ins, outs) in PROJECTION_AXES.items():
        a, b = adapter_names(proj)
        out[f"layers/{a}"] = ("layers", *ins, RANK_AXIS)
        out[f"layers/{b}"] = ("layers", RANK_AXIS, *outs)
    return out


def adapter_shapes(weight_shapes: dict[str, tuple[int, ...]], cfg: LoraConfig) -> dict[str, tuple[int, ...]]:
    """{'layers/q_proj_lora_a': (L, E, r), ...} of cfg's targets, from the weights' shapes
    ('layers/q_proj': (L, E, H, D), ...)."""
    out = {}
    for proj in cfg.targets:
        shape = weight_shapes[f"layers/{proj}"]
        n_in = len(PROJECTION_AXES[proj][0])
        a, b = adapter_names(proj)
        out[f"layers/{a}"] = (shape[0], *shape[1:1 + n_in], cfg.rank)
        out[f"layers/{b}"] = (shape[0], cfg.rank, *shape[1 + n_in:])
    return out


def init_value(name: str, shape, dtype, key) -> jax.Array:
    """A: uniform in +-1/sqrt(fan_in) (PEFT's default); B: zeros."""
    if name.endswith(SUFFIXES[1]):
        return jnp.zeros(shape, dtype)
    fan_in = math.prod(shape[1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _letters(n: int, start: str) -> str:
    return "".join(chr(ord(start) + i) for i in range(n))


def delta(projection: str, x, a, b, scale: float) -> jax.Array:
    """scale * (x A) B for one layer: x [B, T, *in] in the compute dtype, a [*in, r], b [r, *out]
    -> [B, T, *out] in x's dtype (the products accumulate in float32)."""
    ins, outs = (len(s) for s in PROJECTION_AXES[projection])
    i, o = _letters(ins, "i"), _letters(outs, "o")
    low = jnp.einsum(f"bt{i},{i}r->btr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum(f"btr,r{o}->bt{o}", low.astype(x.dtype), b.astype(x.dtype), preferred_element_type=jnp.float32)
    return (scale * up).astype(x.dtype)


def merged_weight(projection: str, w, a, b, scale: float) -> jax.Array:
    """W + scale * A B in W's dtype (summed in float32), for any leading batch dims (layers):
    w [..., *in, *out], a [..., *in, r], b [..., r, *out]."""
    ins, outs = (len(s) for s in PROJECTION_AXES[projection])
    i, o = _letters(ins, "i"), _letters(outs, "o")
    ab = jnp.einsum(f"...{i}r,...r{o}->...{i}{o}", a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)


def merged(params: dict[str, jax.Array], scale: float) -> dict[str, jax.Array]:
    """A flat parameter dict ({'layers/q_proj': ..., 'layers/q_proj_lora_a': ...}, or one layer's
    {'q_proj': ..., 'q_proj_lora_a': ...}) -> the same without adapter keys, each adapter merged
    into the weight it adapts."""
    out = {k: v for k, v in params.items() if not is_adapter(k)}
    for key in params:
        if key.endswith(SUFFIXES[0]):
            base = key[:-len(SUFFIXES[0])]
            proj = base.rsplit("/", 1)[-1]
            out[base] = merged_weight(proj, params[base], params[key], params[base + SUFFIXES[1]], scale)
    return out
