"""Tiny random Qwen checkpoints saved with transformers' own `save_pretrained`.

The weights are redrawn at a larger scale than HF's init (std 0.02 makes logits nearly uniform, so
a parity test would pass on a broken model); norms get random gains so a wrong norm layout shows.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

from cope_jax.rollout.tokenizer import ENDOFTEXT, IM_END, QWEN_PATTERN, QWEN_SPECIALS, qwen_ranks

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


# tokens that are added but not "special" in HF terms (they survive skip_special_tokens decoding)
_QWEN_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                     "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                     "<|repo_name|>", "<|file_sep|>"}


def write_hf_tokenizer_dir(directory: str, variant: str = "qwen2.5", chat_template: str | None = None) -> None:
    """Writes an HF tokenizer directory (tokenizer.json + tokenizer_config.json) for the built-in
    Qwen BPE, offline: vocab and merges are derived from the ranks (a merge exists wherever both
    halves and the joined token are in the vocabulary, ordered by rank)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ranks = qwen_ranks()
    byte_map = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], to_str(left), to_str(right)))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=False,
                     ignore_merges=True)
    tok = HFTokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = QWEN_SPECIALS[variant]
    tok.add_tokens([AddedToken(t, special=t not in _QWEN_NON_SPECIAL, normalized=False) for t in specials])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)



def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))

