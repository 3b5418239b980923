"""`launch.accept`'s sampler section: decode and prefill of a random bf16 model on one device (the
full size: Qwen2.5-7B's shape), beside the bounds measured in the same run.

- decode: seconds per step (greedy, every row decoding, rows half way through the window) against
  the bytes a step must read (the weights + the filled KV cache) over the HBM bandwidth a large
  on-device reduction reaches in this run; tokens/s in the note.
- prefill: seconds to prefill every row's half window against its FLOPs (the planner's analytical
  count) over the FLOP/s a large bf16 matmul reaches in this run.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from launch import timing
from launch.accept.report import Check

# size -> (model preset or the tiny shape, batches, window, decode steps, bound array bytes); tiny decodes
# 192 steps: its turn must outlast a 1-step turn by more than a loaded 2-core host's timing noise
SIZES = {"tiny": (dict(family="qwen2", vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True, qkv_bias=True, qk_norm=False), (1, 8), 512, 192, 1 << 26),
         "full": ("Qwen2.5-7B-Instruct", (1, 8, 64), 4096, 64, 1 << 32)}
SIZES["quick"] = SIZES["full"][:3] + (32,) + SIZES["full"][4:]  # half the decode steps
WITHIN = 2.0  # a decode step within twice the bytes bound, a prefill within twice the FLOPs bound


def run(*, size: str, repeats: int) -> Iterator[Check]:
    cfg = _model_config(size)
    shape, batches, window, steps, bound_bytes = SIZES[size]
    bandwidth, flops = timing.read_bandwidth(bound_bytes, repeats), timing.matmul_peak("bfloat16", 1024 if size == "tiny" else 8192, repeats)
    model = _model(cfg)
    name = shape if isinstance(shape, str) else f"{cfg.num_layers}-layer {cfg.hidden_size}-wide"
    yield Check("sampler", "HBM bandwidth bound (on-device reduction)", "B/s", bandwidth,
                note="measured in this run: the bounds below use it")
    yield Check("sampler", "FLOP/s bound (bf16 matmul)", "FLOP/s", flops, note="measured in this run")
    for batch in batches:
        yield from _batch(model, cfg, name, batch, window, steps, bandwidth, flops, repeats)


def _model_config(size: str):
    from models import presets
    from models.config import QwenConfig
    from models.qwen import frozen_config

    shape = SIZES[size][0]
    cfg = presets.preset_config(shape) if isinstance(shape, str) else QwenConfig(**shape)
    return frozen_config(cfg.replace(dtype="bfloat16", param_dtype="bfloat16", scan_layers=False))


def _model(cfg):
    from models import qwen

    return qwen.create_model(cfg)


def _batch(model, cfg, name, batch, window, steps, bandwidth, flops, repeats) -> list[Check]:
    import jax

    from flax import nnx

    from cope_jax.plan import programs
    from cope_jax.rollout.sampler import Sampler

    half = window // 2
    # the layers on the sampler's own copy wherever XLA would copy them out of the stack each step
    # (CPU, GPU: `Sampler`); a 7B and its copy fit one H100 with room for the cache
    sampler = Sampler(model, batch_size=batch, max_len=window, eos_ids=[],
                      unroll_layers=jax.default_backend() != "tpu")
    prompts = np.random.RandomState(batch).randint(0, cfg.vocab_size, (batch, half))
    state = sampler.init_state()

    def prefill():
        sampler.start(prompts, state=state, rows=range(batch))
        return state.cache.k

    def turn(n):
        return lambda: sampler.generate(state, max_new_tokens=n, greedy=True)

    prefill_s = timing.best_seconds(prefill, repeats)
    one, many = (timing.best_seconds(turn(n), repeats, setup=prefill) for n in (1, steps))
    step_s = (many - one) / (steps - 1) if many > one else None  # the turn's fixed costs cancel
    weights = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv = 2 * cfg.num_layers * batch * (half + steps // 2) * cfg.num_kv_heads * cfg.head_dim * 2
    prefill_flops = programs.forward_flops(cfg, half, half, jax.default_backend(), packed=True, logits=False)
    label = f"{name}, batch {batch}, window {window}"
    return [
        Check("sampler", f"decode step ({label})", "s", step_s, (weights + kv) / bandwidth, within=WITHIN,
              note=(f"{batch / step_s:,.0f} tokens/s" if step_s else "below the timing's resolution")
              + f"; bound: {(weights + kv) / 1e9:.3g} GB weights + filled KV"),
        Check("sampler", f"prefill of {batch} x {half} ({label})", "s", prefill_s,
              prefill_flops * batch * half / flops, within=WITHIN,
              note=f"{batch * half / prefill_s:,.0f} tokens/s; bound: analytical FLOPs over the measured FLOP/s"),
    ]
