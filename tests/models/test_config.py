"""HF config.json reading: both rope layouts, explicit head_dim, and clear errors naming the field."""
import json

import pytest

from models.config import ConfigError, QwenConfig
from tests.hf_fixtures import hf_config

BASE = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def test_transformers_saved_configs_round_trip():
    for family in ("qwen2", "qwen3"):
        hf = hf_config(family, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                       tie_word_embeddings=True).to_dict()
        cfg = QwenConfig.from_hf_dict(hf)
        assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_word_embeddings) == \
               (family, 24, 2, 1e6, True)
        assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
        assert QwenConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_legacy_rope_theta_and_default_head_dim():
    cfg = QwenConfig.from_hf_dict(BASE)
    assert cfg.rope_theta == 10000.0 and cfg.head_dim == 8 and not cfg.tie_word_embeddings
    new = dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del new["rope_theta"]
    assert QwenConfig.from_hf_dict(new).rope_theta == 5e5


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "rms_norm_eps", "rope_theta"])
def test_missing_field_is_named(field):
    bad = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        QwenConfig.from_hf_dict(bad)


@pytest.mark.parametrize("patch,needle", [
    ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture 'LlamaForCausalLM'"),
    ({"architectures": None, "model_type": "mistral"}, "unsupported architecture 'mistral'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_configs(patch, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        QwenConfig.from_hf_dict(dict(BASE, **patch))


def test_from_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        QwenConfig.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        QwenConfig.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert QwenConfig.from_hf_dir(str(tmp_path), dtype="bfloat16").dtype == "bfloat16"
