"""Tiny random Qwen checkpoints saved with transformers' own `save_pretrained`.

The weights are redrawn at a larger scale than HF's init (std 0.02 makes logits nearly uniform, so
a parity test would pass on a broken model); norms get random gains so a wrong norm layout shows.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import transformers

# name -> (family, config kwargs); covers both families, tied/untied, GQA 1 and 4, head_dim != E/H
TINY_CONFIGS = {
    "qwen2_tied_mha": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2_untied_gqa4": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_untied_gqa4_hd": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                           tie_word_embeddings=False)),
    "qwen3_tied_mha_hd": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                        tie_word_embeddings=True)),
}


def hf_config(family: str, **kw) -> transformers.PretrainedConfig:
    base = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6)
    base.update(kw)
    cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    return cls(**base)


def make_tiny_hf(directory: str, family: str, seed: int = 0, dtype=torch.float32, **kw):
    """Saves a random model to `directory`; returns the torch model (eval mode, float32)."""
    cfg = hf_config(family, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    os.makedirs(directory, exist_ok=True)
    model.to(dtype).save_pretrained(directory)
    return model.float()


def hf_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """transformers' logits with explicit position ids (left padding counts from the first real token)."""
    tokens = torch.tensor(np.asarray(tokens))
    if attention_mask is None:
        attention_mask = np.ones(tokens.shape, np.int64)
    mask = torch.tensor(np.asarray(attention_mask))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=mask, position_ids=pos).logits.float().numpy()
