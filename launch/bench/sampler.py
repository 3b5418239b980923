"""python -m launch.bench --suite=sampler: our sampler against transformers `generate()`, same run.

For each Qwen2-shaped config the weights are drawn once in torch (transformers' own init), saved
with `save_pretrained` and loaded into the NNX model, so both implementations run identical fp32
weights. Both decode greedily without an EOS stop from the same random prompts, batch 1 and 8.

Measured per implementation, best of --sampler_repeats rounds that alternate between the two
implementations (a first round, which compiles, is discarded):
- prefill_s: prompt in, first new token out (our `start` + a 1-token `generate`; transformers
  `generate(max_new_tokens=1)`).
- decode_tok_s: batch * (N - 1) / (time for N new tokens - time for 1); null where the difference
  is not positive (too few tokens for this machine's timing noise: raise --sampler_new_tokens).
Lines are JSON; each config/batch ends with a `ratio` line: ours / transformers for tokens/s and
transformers / ours for prefill time; this host's decode bound, `bound_tok_s` = batch / max(weight
bytes / read bandwidth, 2 x parameters x batch / matmul FLOP/s) (every step reads every weight once,
the tied embedding as the head), from the best of the limits measured right before and right after
the timed rounds (`read_gb_s`: a jitted float32 sum over an array of the weights' size, 256 MiB at
least so it reads memory, not the caches; `matmul_gflops`: bench_loss's square matmul), and our
share of it (`of_bound`); the fraction of greedy tokens on which both agree, torch's intra-op
thread count and the CPUs XLA's thread pool spans (both use every core by default), and the
1-minute load average (the machine may be shared).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
from absl import flags
from models.config import ConfigError

CONFIGS = {
    # name: (Qwen2 config kwargs, new tokens)
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), 128),
    "small": (dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True), 64),
    # Qwen2.5-0.5B's shape
    "0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True), 32),
}

flags.DEFINE_list("sampler_configs", list(CONFIGS), f"Configs to run, from {sorted(CONFIGS)}.")
flags.DEFINE_list("sampler_batches", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("sampler_prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_integer("sampler_new_tokens", 0, "New tokens per row (0: the config's default).")
flags.DEFINE_integer("sampler_repeats", 3, "Timed repeats; the best is reported.")
FLAGS = flags.FLAGS


def _best_interleaved(runs: dict, repeats: int) -> dict:
    """Best wall time of each closure; one round runs every closure once, so a noisy stretch of a
    shared machine hits both implementations alike. The first round (compiles) is discarded."""
    best = {name: float("inf") for name in runs}
    for r in range(repeats + 1):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            if r:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def _ours(directory: str, prompts: np.ndarray, new_tokens: int, out: dict) -> dict:
    """Closures running our sampler for 1 and for `new_tokens` tokens (output ids kept in `out`)."""
    import models
    from cope_jax.rollout.sampler import Sampler

    model, _ = models.load_hf_model(directory)
    B, P = prompts.shape
    sampler = Sampler(model, batch_size=B, max_len=P + new_tokens, eos_ids=[])
    state = sampler.init_state()

    def run(n):
        def once():
            sampler.start(prompts, state=state, rows=range(B))
            # returns host arrays, so the device work is finished when it returns
            out[n] = np.stack(sampler.generate(state, max_new_tokens=n, greedy=True).tokens)
        return once
    return {n: run(n) for n in (1, new_tokens)}


def _transformers(torch_model, prompts: np.ndarray, new_tokens: int, out: dict) -> dict:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(n):
        def once():
            with torch.no_grad():
                gen = torch_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                           eos_token_id=None, pad_token_id=0)
            out[n] = gen[:, prompts.shape[1]:].numpy()
        return once
    return {n: run(n) for n in (1, new_tokens)}


def _limits(weight_bytes: int) -> tuple[float, float]:
    """(read bytes/s, float32 matmul FLOP/s) of this host now, each the best of 5."""
    from launch import timing

    nbytes = max(weight_bytes, 1 << 28)  # memory's bandwidth, not the caches' (tiny weights fit those)
    return timing.read_bandwidth(nbytes), timing.matmul_peak("float32")


def _bound(limits: list[tuple[float, float]], weight_bytes: int, params: int, batch: int) -> dict:
    """This host's decode bound for one step at `batch` rows (module docstring) from the best of
    the limits measured before and after the timed rounds (a busy moment only lowers them)."""
    bandwidth, flops = max(b for b, _ in limits), max(f for _, f in limits)
    step = max(weight_bytes / bandwidth, 2 * params * batch / flops)
    return dict(bound_tok_s=batch / step, read_gb_s=round(bandwidth / 1e9, 1), matmul_gflops=round(flops / 1e9, 1))


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _ratio(a: float | None, b: float | None, digits: int) -> float | None:
    return None if a is None or b is None else round(a / b, digits)


def _line(**kw) -> None:
    print(json.dumps({"suite": "sampler", **kw}), flush=True)


def run(argv: list[str]) -> None:
    del argv
    import torch
    import transformers

    for name in FLAGS.sampler_configs:
        if name not in CONFIGS:
            raise ConfigError(f"unknown sampler config {name!r}; known: {sorted(CONFIGS)}")
    for name in FLAGS.sampler_configs:
        kw, default_new = CONFIGS[name]
        new_tokens = FLAGS.sampler_new_tokens or default_new
        hf_cfg = transformers.Qwen2Config(**kw, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                                          eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        torch_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
        with tempfile.TemporaryDirectory() as directory:
            torch_model.save_pretrained(directory)
            for batch in (int(b) for b in FLAGS.sampler_batches):
                prompts = np.random.RandomState(batch).randint(0, kw["vocab_size"], (batch, FLAGS.sampler_prompt_len))
                outs = {"cope_jax": {}, "transformers": {}}
                runs = {"cope_jax": _ours(directory, prompts, new_tokens, outs["cope_jax"]),
                        "transformers": _transformers(torch_model, prompts, new_tokens, outs["transformers"])}
                params = sum(p.numel() for p in torch_model.parameters())  # tied: the embedding once
                before = _limits(4 * params)
                best = _best_interleaved({(impl, n): fn for impl, fns in runs.items() for n, fn in fns.items()},
                                         FLAGS.sampler_repeats)
                bound = _bound([before, _limits(4 * params)], 4 * params, params, batch)
                stats = {}
                for impl in runs:
                    t1, tn = best[impl, 1], best[impl, new_tokens]
                    stats[impl] = dict(prefill_s=t1, decode_tok_s=batch * (new_tokens - 1) / (tn - t1) if tn > t1 else None)
                    _line(config=name, batch=batch, impl=impl, prompt_len=FLAGS.sampler_prompt_len,
                          new_tokens=new_tokens, dtype="float32", **{k: _round(v, 4) for k, v in stats[impl].items()})
                ours, ref = stats["cope_jax"], stats["transformers"]
                _line(config=name, batch=batch, impl="ratio",
                      decode_speedup=_ratio(ours["decode_tok_s"], ref["decode_tok_s"], 2),
                      prefill_speedup=round(ref["prefill_s"] / ours["prefill_s"], 2),
                      bound_tok_s=round(bound["bound_tok_s"], 1),
                      of_bound=_ratio(ours["decode_tok_s"], bound["bound_tok_s"], 3),
                      read_gb_s=bound["read_gb_s"], matmul_gflops=bound["matmul_gflops"],
                      greedy_tokens_agree=round(float(np.mean(outs["cope_jax"][new_tokens] ==
                                                               outs["transformers"][new_tokens])), 3),
                      torch_threads=torch.get_num_threads(), cpus=os.cpu_count(), load=round(os.getloadavg()[0], 2))
