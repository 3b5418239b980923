"""End-to-end smoke run of what exists so far (the quickstart until the CoPE demo lands).

Builds a tiny random Qwen3 (real Qwen vocabulary), saves it as an HF checkpoint, loads it back
with `models.load_hf_model`, renders a chat prompt on token ids with the built-in Qwen tokenizer and
decodes greedily with the KV cache. Prints one JSON line per stage.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from absl import app, flags
from flax import nnx

import models
from cope_jax.chat import ChatFormat
from cope_jax.tokenizer import load_tokenizer
from models import hf_io

flags.DEFINE_string("workdir", None, "Where to write the tiny checkpoint (default: a temp dir).")
flags.DEFINE_integer("new_tokens", 16, "Greedy tokens to decode.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    t0 = time.time()
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="cope_smoke_")
    ckpt = os.path.join(workdir, "tiny-qwen3")
    os.makedirs(ckpt, exist_ok=True)
    cfg = models.QwenConfig(family="qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    model = models.create_model(cfg, seed=0)
    safetensors.numpy.save_file(hf_io.hf_state_dict(model), os.path.join(ckpt, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    print(json.dumps({"stage": "saved_hf", "dir": ckpt, "params": models.qwen.count_params(cfg)}))

    model, cfg = models.load_hf_model(ckpt)
    tok = load_tokenizer("qwen3")
    chat = ChatFormat(tok, "qwen3")
    prompt = chat.render([{"role": "user", "content": "Go north, take the key, open the door."}],
                         add_generation_prompt=True)
    print(json.dumps({"stage": "prompt", "tokens": len(prompt), "text": tok.decode(prompt)}))

    decode = nnx.jit(lambda m, t, n, c: m.decode(t, n, c))
    cache = models.KVCache.zeros(cfg, batch=1, max_len=len(prompt) + FLAGS.new_tokens)
    h, cache = decode(model, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), cache)
    nxt = int(jnp.argmax(model.unembed(h[:, -1])))
    out = [nxt]
    for _ in range(FLAGS.new_tokens - 1):
        h, cache = decode(model, jnp.asarray([[nxt]]), jnp.ones(1, jnp.int32), cache)
        nxt = int(jnp.argmax(model.unembed(h[:, -1])))
        out.append(nxt)
    print(json.dumps({"stage": "greedy_decode", "ids": out, "text": tok.decode(out),
                      "backend": jax.default_backend(), "seconds": round(time.time() - t0, 2)}))


if __name__ == "__main__":
    app.run(main)
