"""Qwen model configuration, read from a Hugging Face `config.json`.

One dataclass covers Qwen2, Qwen2.5 (same architecture as Qwen2) and Qwen3 dense decoders. The
differences between the families are data, not code paths: Qwen2 has q/k/v biases, Qwen3 has
per-head RMSNorm on q and k (and an explicit `head_dim` that may differ from hidden/heads).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.attention import IMPLEMENTATIONS
from models.lora import LoraConfig

# architecture name in config.json -> (family, qkv_bias, qk_norm)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
)


class ConfigError(ValueError):
    """A config.json that cannot describe a supported Qwen model."""


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture plus execution options of a Qwen dense decoder.

    Architecture fields mirror the HF names; `lora` adds adapters (which `to_hf_dict` does not
    describe: an exported model has them merged). Execution fields (`dtype`, `param_dtype`,
    `scan_layers`, `remat`, `attention`) do not change the math: scanned and looped layers give the
    same numbers, remat only trades memory for recompute, and every attention implementation
    computes the same softmax (to float rounding).
    """

    family: str  # "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # execution
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"  # storage dtype of the weights
    scan_layers: bool = True
    remat: str = "none"  # "none" | "full" | "dots" (see models/qwen.py REMAT_POLICIES)
    attention: str = "auto"  # "auto" | "dense" | "blockwise" (models/attention.py)
    attention_block: int = 512  # tokens per query / key block of blockwise attention
    # low-rank adapters (models/lora.py): the base weights frozen in the compute dtype, the
    # adapters stored in `param_dtype` and the only parameters trained
    lora: LoraConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(f"attention must be one of {IMPLEMENTATIONS}, got {self.attention!r}")
        if self.attention_block < 8 or self.attention_block % 8:
            raise ConfigError(f"attention_block must be a positive multiple of 8, got {self.attention_block}")

    @property
    def architecture(self) -> str:
        return _MODEL_TYPES[self.family]

    def replace(self, **changes) -> "QwenConfig":
        return dataclasses.replace(self, **changes)

    # -- HF interop ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **execution) -> "QwenConfig":
        """Builds a config from a parsed HF config.json; raises ConfigError naming the field."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(hf.get("model_type", ""))
        if arch not in _ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch or hf.get('model_type')!r} (field 'architectures' / "
                f"'model_type'); supported: {sorted(_ARCHITECTURES)}"
            )
        family, qkv_bias, qk_norm = _ARCHITECTURES[arch]
        for field in _REQUIRED:
            if hf.get(field) is None:
                raise ConfigError(f"config.json is missing required field {field!r} for {arch}")
        if hf.get("use_sliding_window"):
            raise ConfigError("field 'use_sliding_window' is true: sliding-window attention is not supported")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        if "attention_bias" in hf and family == "qwen3":
            qkv_bias = bool(hf["attention_bias"])
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=_rope_theta(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(hf.get("max_position_embeddings") or 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            **execution,
        )

    @classmethod
    def from_hf_dir(cls, path: str, **execution) -> "QwenConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"no config.json in {path!r}")
        try:
            with open(cfg_path) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(hf, **execution)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json of this architecture (transformers 5 layout, `rope_parameters`)."""
        out = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": self.param_dtype,
        }
        if self.family == "qwen3":
            out["attention_bias"] = self.qkv_bias
        return out


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope theta from `rope_parameters` (transformers >= 5) or legacy top-level `rope_theta`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"field 'rope_parameters.rope_type' = {rope_type!r}: only 'default' RoPE is supported")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json is missing field 'rope_parameters.rope_theta' (or legacy 'rope_theta')")
    return float(theta)
