"""HF safetensors <-> NNX parameters: one table of names and layout transforms, reader and writer.

`HF_KEYS` maps each NNX parameter path to its HF tensor name (with `{i}` for the layer index of the
stacked layer weights) and a layout transform. Loading is lazy and sharded: every parameter is
built with `jax.make_array_from_callback`, which asks only for the slices a device needs; the
callback reads one layer of the memory-mapped file at a time and casts it to the target dtype, so
a host never holds the whole model (nor a float32 copy of a bf16 model).

Writing streams too: the safetensors header is computed from shapes alone, then each HF tensor
(one layer of one parameter) is gathered to the host, laid out and written, so the host holds one
tensor at a time beyond the model itself. Output is split into `model-0000i-of-0000N.safetensors`
files plus an index above `max_shard_size`, and appears atomically (see `models/model_dir.py`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import model_dir, qwen
from models.config import QwenConfig
from models.safetensors_io import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, CheckpointError, TensorSource
from models.config import ConfigError


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
    """Every expected tensor present with the right shape, and nothing unexplained left over.

    Raises one CheckpointError listing all mismatches; missing and unused tensors together usually
    mean the config is for another family (e.g. a Qwen3 checkpoint with a Qwen2 config.json).
    """
    expected, missing, wrong = set(), [], []
    for path, shape in qwen.param_shapes(cfg).items():
        want = hf_shape(path, shape)
        for name in hf_names(path, cfg):
            expected.add(name)
            if name not in source:
                missing.append(name)
            elif tuple(source.shape(name)) != tuple(want):
                wrong.append(f"{name!r} has shape {tuple(source.shape(name))}, config expects {tuple(want)}")
    if cfg.tie_word_embeddings:
        expected.add(HF_KEYS["lm_head"][0])  # tolerated: some exporters store the tied head
    extra = sorted(k for k in source.keys() if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_some(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of the wrong shape: {_some(wrong)}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) not used by the config: {_some(extra)}")
    if problems:
        hint = " (is config.json for another model family?)" if missing and extra else ""
        raise CheckpointError(f"{source.directory}: checkpoint does not match its {cfg.architecture} "
                              f"config: {'; '.join(problems)}{hint}")


def _some(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def stored_dtype(directory: str) -> str:
    """Dtype name of the embedding in an HF directory ('bfloat16', 'float32', ...)."""
    source = TensorSource(directory)
    name = HF_KEYS["embed"][0]
    if name not in source:
        raise CheckpointError(f"{directory}: tensor {name!r} is missing")
    return source.dtype(name).name


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
        out = None
        for j, i in enumerate(layers):  # filled in place: no list of per-layer copies to stack
            part = layout.to_ours(source.get(names[i]), shape[1:])[rest]
            if out is None:
                out = np.empty((len(layers), *part.shape), dtype)
            out[j] = part
        return out
    return read_stacked


def load_params(directory: str, cfg: QwenConfig, mesh=None) -> qwen.Qwen:
    """A `Qwen` whose parameters are read from HF safetensors in `directory`, placed sharded."""
    source = TensorSource(directory)
    check_source(source, cfg)
    graphdef, abstract = nnx.split(qwen.abstract_model(cfg, mesh))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def build(keypath, leaf):
        path = qwen.param_path(keypath)
        sharding = single if mesh is None else qwen.param_sharding(path, leaf.shape, mesh)
        read = _reader(source, path, cfg, leaf.shape, np.dtype(leaf.dtype))
        return jax.make_array_from_callback(leaf.shape, sharding, read)

    state = jax.tree_util.tree_map_with_path(build, abstract)
    return nnx.merge(graphdef, state)


# -- writing ------------------------------------------------------------------------------------------
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One HF tensor to write: name, shape and dtype up front, the values on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def export_tensors(model: qwen.Qwen, dtype=None) -> list[ExportTensor]:
    """The HF tensors of `model` in file order: embedding, layer by layer, final norm, head."""
    cfg = model.cfg
    dtype = jnp.dtype(dtype or qwen.stored_dtype(cfg))
    arrays = qwen.merged_params(model)  # LoRA adapters merged

    def tensor(path: str, layer: int | None) -> ExportTensor:
        arr, layout = arrays[path], HF_KEYS[path][1]

        def read() -> np.ndarray:
            host = np.asarray(jax.device_get(arr if layer is None else _take_layer(arr, layer)))
            return np.ascontiguousarray(layout.to_hf(host.astype(dtype, copy=False)))

        name = HF_KEYS[path][0].format(i=layer)
        return ExportTensor(name, hf_shape(path, arr.shape), dtype, read)

    stacked = [p for p in HF_KEYS if is_stacked(p) and p in arrays]
    return ([tensor("embed", None)]
            + [tensor(p, i) for i in range(cfg.num_layers) for p in stacked]
            + [tensor(p, None) for p in ("final_norm", "lm_head") if p in arrays])


@jax.jit
def _take_layer(stacked: jax.Array, layer) -> jax.Array:
    """stacked[layer] with a traced index: one compile per parameter shape, not per layer."""
    return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False)


def parse_size(size: int | str) -> int:
    """Bytes from 123, "500MB", "5GB" (powers of 10) or "2GiB" (powers of 2)."""
    if isinstance(size, int):
        value, unit = size, ""
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if not m or m.group(2).upper() not in _SIZE_UNITS:
            raise ConfigError(f"cannot read size {size!r}; use e.g. 500MB, 5GB or 2GiB")
        value, unit = float(m.group(1)), m.group(2).upper()
    n = int(value * _SIZE_UNITS[unit])
    if n <= 0:
        raise ConfigError(f"size {size!r} must be positive")
    return n


def plan_shards(tensors: list[ExportTensor], max_bytes: int) -> list[list[ExportTensor]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards, current, size = [], [], 0
    for t in tensors:
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    return shards + [current] if current else shards


def write_safetensors(path: str, tensors: list[ExportTensor], metadata: dict[str, str]) -> None:
    """Writes one safetensors file, reading each tensor only when its bytes are due."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            arr = t.read()
            if arr.shape != t.shape or arr.dtype != t.dtype:
                raise CheckpointError(f"{t.name}: produced {arr.dtype}{list(arr.shape)}, header says "
                                      f"{t.dtype}{list(t.shape)}")
            f.write(arr.reshape(-1).view(np.uint8).data)


def hf_config_dict(cfg: QwenConfig, dtype) -> dict:
    """config.json contents for weights stored in `dtype`."""
    return cfg.replace(param_dtype=jnp.dtype(dtype).name).to_hf_dict()


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_hf(model: qwen.Qwen, directory: str, *, dtype=None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
            carry_from: str | None = None, overwrite: bool = False) -> list[str]:
    """Writes `model` as an HF directory loadable by `transformers.AutoModelForCausalLM`.

    Files: config.json, generation_config.json (carried over from `carry_from` when it has one,
    else bos/eos only), the tokenizer files of `carry_from`, and `model.safetensors`, or
    `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` when the weights exceed
    `max_shard_size`. Tied embeddings store no `lm_head`; LoRA adapters are merged into their weights.
    `dtype` defaults to the stored dtype of the weights (`qwen.stored_dtype`).
    The directory appears atomically; returns the names of the files written.
    """
    cfg = model.cfg
    dtype = jnp.dtype(dtype or qwen.stored_dtype(cfg))
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"cannot store weights as {dtype} in safetensors")
    shards = plan_shards(export_tensors(model, dtype), parse_size(max_shard_size))
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with model_dir.atomic_output_dir(directory, overwrite=overwrite) as tmp:
        for name, shard in zip(names, shards):
            write_safetensors(os.path.join(tmp, name), shard, {"format": "pt"})
        if n > 1:
            weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
            total = sum(t.nbytes for shard in shards for t in shard)
            write_json(os.path.join(tmp, INDEX_FILE),
                       {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        write_json(os.path.join(tmp, model_dir.CONFIG_FILE), hf_config_dict(cfg, dtype))
        carried = model_dir.carry_files(carry_from, tmp) if carry_from else []
        if model_dir.GENERATION_CONFIG_FILE not in carried:
            write_json(os.path.join(tmp, model_dir.GENERATION_CONFIG_FILE), minimal_generation_config(cfg))
        return sorted(os.listdir(tmp))


def minimal_generation_config(cfg: QwenConfig) -> dict:
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    return {k: v for k, v in ids.items() if v is not None}
