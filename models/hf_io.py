"""HF safetensors <-> NNX parameters: one table of names and layout transforms.

`HF_KEYS` maps each NNX parameter path to its HF tensor name (with `{i}` for the layer index of the
stacked layer weights) and a layout transform. Loading is lazy and sharded: every parameter is
built with `jax.make_array_from_callback`, which asks only for the slices a device needs; the
callback reads one layer of the memory-mapped file at a time and casts it to the target dtype, so
a host never holds the whole model (nor a float32 copy of a bf16 model).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import nnx

from models import qwen
from models import sharding as shd
from models.config import QwenConfig
from models.safetensors_io import CheckpointError, TensorSource


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an HF tensor maps to ours. `to_ours(hf, shape)` / `to_hf(ours)` operate on numpy."""

    to_ours: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


IDENTITY = Layout(lambda a, s: a.reshape(s), lambda a: a)
# nn.Linear weight [out, in] -> kernel [in, out]
LINEAR = Layout(lambda a, s: a.T.reshape(s), lambda a: a.T)
# q/k/v: [heads*head_dim, embed] -> [embed, heads, head_dim]
HEADS_OUT = Layout(lambda a, s: a.T.reshape(s), lambda a: a.reshape(a.shape[0], -1).T)
# o_proj: [embed, heads*head_dim] -> [heads, head_dim, embed]
HEADS_IN = Layout(lambda a, s: a.T.reshape(s), lambda a: a.reshape(-1, a.shape[-1]).T)
# biases: [heads*head_dim] -> [heads, head_dim]
HEADS_BIAS = Layout(lambda a, s: a.reshape(s), lambda a: a.reshape(-1))

_L = "model.layers.{i}."
HF_KEYS: dict[str, tuple[str, Layout]] = {
    "embed": ("model.embed_tokens.weight", IDENTITY),
    "lm_head": ("lm_head.weight", IDENTITY),
    "final_norm": ("model.norm.weight", IDENTITY),
    "layers/attn_norm": (_L + "input_layernorm.weight", IDENTITY),
    "layers/mlp_norm": (_L + "post_attention_layernorm.weight", IDENTITY),
    "layers/q_proj": (_L + "self_attn.q_proj.weight", HEADS_OUT),
    "layers/k_proj": (_L + "self_attn.k_proj.weight", HEADS_OUT),
    "layers/v_proj": (_L + "self_attn.v_proj.weight", HEADS_OUT),
    "layers/q_bias": (_L + "self_attn.q_proj.bias", HEADS_BIAS),
    "layers/k_bias": (_L + "self_attn.k_proj.bias", HEADS_BIAS),
    "layers/v_bias": (_L + "self_attn.v_proj.bias", HEADS_BIAS),
    "layers/q_norm": (_L + "self_attn.q_norm.weight", IDENTITY),
    "layers/k_norm": (_L + "self_attn.k_norm.weight", IDENTITY),
    "layers/o_proj": (_L + "self_attn.o_proj.weight", HEADS_IN),
    "layers/gate_proj": (_L + "mlp.gate_proj.weight", LINEAR),
    "layers/up_proj": (_L + "mlp.up_proj.weight", LINEAR),
    "layers/down_proj": (_L + "mlp.down_proj.weight", LINEAR),
}
# tensors some exporters add that carry no weights
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_stacked(path: str) -> bool:
    return path.startswith("layers/")


def hf_names(path: str, cfg: QwenConfig) -> list[str]:
    """HF tensor names behind one NNX parameter (one per layer for stacked weights)."""
    template = HF_KEYS[path][0]
    return [template.format(i=i) for i in range(cfg.num_layers)] if is_stacked(path) else [template]


def hf_shape(path: str, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one HF tensor behind `path` (per layer for stacked weights)."""
    shape = our_shape[1:] if is_stacked(path) else our_shape
    return HF_KEYS[path][1].to_hf(np.empty(shape, np.bool_)).shape


def check_source(source: TensorSource, cfg: QwenConfig) -> None:
    """Every expected tensor present with the right shape, and nothing unexplained left over."""
    expected = set()
    for path, shape in qwen.param_shapes(cfg).items():
        want = hf_shape(path, shape)
        for name in hf_names(path, cfg):
            expected.add(name)
            if name not in source:
                raise CheckpointError(f"{source.directory}: tensor {name!r} is missing "
                                      f"(expected by the {cfg.architecture} config)")
            if tuple(source.shape(name)) != tuple(want):
                raise CheckpointError(f"{source.directory}: tensor {name!r} has shape "
                                      f"{tuple(source.shape(name))}, config expects {tuple(want)}")
    if cfg.tie_word_embeddings:
        expected.add(HF_KEYS["lm_head"][0])  # tolerated: some exporters store the tied head
    extra = sorted(k for k in source.keys() if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(f"{source.directory}: tensors not used by the {cfg.architecture} config "
                              f"(wrong config for this checkpoint?): {extra[:6]}")


def _reader(source: TensorSource, path: str, cfg: QwenConfig, shape, dtype) -> Callable:
    """Callback for make_array_from_callback: global index -> numpy slice in `dtype`."""
    layout = HF_KEYS[path][1]
    names = hf_names(path, cfg)

    if not is_stacked(path):
        def read(index):
            return layout.to_ours(source.get(names[0]), shape)[index].astype(dtype)
        return read

    def read_stacked(index):
        layers = range(cfg.num_layers)[index[0]]
        rest = tuple(index[1:])
        return np.stack([layout.to_ours(source.get(names[i]), shape[1:])[rest].astype(dtype)
                         for i in layers])
    return read_stacked


def load_params(directory: str, cfg: QwenConfig, mesh=None) -> qwen.Qwen:
    """A `Qwen` whose parameters are read from HF safetensors in `directory`, placed sharded."""
    source = TensorSource(directory)
    check_source(source, cfg)
    graphdef, abstract = nnx.split(qwen.abstract_model(cfg, mesh))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def build(keypath, leaf):
        path = qwen.param_path(keypath)
        sharding = single if mesh is None else shd.named_sharding(qwen.PARAM_AXES[path], leaf.shape, mesh)
        read = _reader(source, path, cfg, leaf.shape, np.dtype(leaf.dtype))
        return jax.make_array_from_callback(leaf.shape, sharding, read)

    state = jax.tree_util.tree_map_with_path(build, abstract)
    return nnx.merge(graphdef, state)



def hf_state_dict(model: qwen.Qwen, dtype=None) -> dict[str, np.ndarray]:
    """{HF tensor name: numpy array} of a model, in HF layout (gathered to host)."""
    cfg = model.cfg
    out = {}
    for path, arr in qwen.model_state_arrays(model).items():
        host = np.asarray(jax.device_get(arr))
        if dtype is not None:
            host = host.astype(dtype)
        layout = HF_KEYS[path][1]
        if is_stacked(path):
            for i, name in enumerate(hf_names(path, cfg)):
                out[name] = np.ascontiguousarray(layout.to_hf(host[i]))
        else:
            out[hf_names(path, cfg)[0]] = np.ascontiguousarray(layout.to_hf(host))
    return out
