"""Named architectures: the `config.json` fields of the public Qwen checkpoints the project trains.

`launch.plan --model=<name>` and `model.preset` (random init at a real shape) use them, so planning
and benchmarking need no downloaded weights. Only architecture fields are listed; the rest of a
config.json (dtype, token ids) does not change a program's shapes.
"""
from __future__ import annotations

from models.config import ConfigError, QwenConfig

_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6,
               max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6, head_dim=128,
              attention_bias=False, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, dict] = {
    "Qwen2.5-0.5B-Instruct": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                  tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                  tie_word_embeddings=True),
    "Qwen2.5-3B-Instruct": dict(_QWEN25, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                                num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                tie_word_embeddings=False),
    "Qwen2.5-14B-Instruct": dict(_QWEN25, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                                 num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                                 tie_word_embeddings=False),
    "Qwen3-8B": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=False),
}


def preset_config(name: str, **execution) -> QwenConfig:
    """The QwenConfig of a named architecture (execution fields as for `QwenConfig.from_hf_dict`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return QwenConfig.from_hf_dict(PRESETS[name], **execution)
