"""Qwen2 / Qwen2.5 / Qwen3 decoders in Flax NNX, with HF checkpoint interop and mesh sharding."""
from __future__ import annotations

from models.config import ConfigError, QwenConfig
from models.qwen import KVCache, Qwen, create_model
from models.safetensors_io import CheckpointError
from models.sharding import make_mesh

__all__ = ["CheckpointError", "ConfigError", "KVCache", "Qwen", "QwenConfig", "create_model",
           "load_hf_model", "make_mesh"]


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
