"""Qwen2 / Qwen2.5 / Qwen3 decoders in Flax NNX, with HF checkpoint interop and mesh sharding."""
from __future__ import annotations

from models.config import ConfigError, QwenConfig
from models.qwen import KVCache, Qwen, create_model
from models.safetensors_io import CheckpointError
from models.sharding import make_mesh

__all__ = ["CheckpointError", "ConfigError", "KVCache", "Qwen", "QwenConfig", "create_model",
           "load_hf_model", "load_model", "make_mesh"]


def load_hf_model(path: str, *, dtype: str = "float32", mesh=None, **execution) -> tuple[Qwen, QwenConfig]:
    """Loads an HF Qwen2/Qwen2.5/Qwen3 directory (config.json + safetensors).

    `dtype` is both the storage and the compute dtype unless `param_dtype` is given in
    `execution` (which also takes `scan_layers` and `remat`). Under `mesh`, every parameter is
    placed directly on its sharding. Returns (model, config); `model(tokens, positions=None,
    segment_ids=None)` gives float32 logits [B, T, V].
    """
    from models import hf_io

    execution.setdefault("param_dtype", dtype)
    cfg = QwenConfig.from_hf_dir(path, dtype=dtype, **execution)
    return hf_io.load_params(path, cfg, mesh), cfg


def load_model(path: str, *, dtype: str | None = None, mesh=None, config_dir: str | None = None,
               **execution) -> tuple[Qwen, QwenConfig]:
    """Loads an HF directory (safetensors) or an Orbax one (`params/`, see models/orbax_io.py).

    `dtype=None` keeps the stored dtype (of the embedding) for storage and compute. `config_dir`
    supplies config.json when `path` has none (e.g. a training checkpoint step). Under `mesh`,
    every parameter is read straight into its shards. Returns (model, config).
    """
    from models import hf_io, model_dir, orbax_io

    io = {"hf": hf_io, "orbax": orbax_io}[model_dir.kind(path)]
    dtype = dtype or io.stored_dtype(path)
    execution.setdefault("param_dtype", dtype)
    cfg = QwenConfig.from_hf_dir(config_dir or path, dtype=dtype, **execution)
    return io.load_params(path, cfg, mesh), cfg
