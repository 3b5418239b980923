"""python -m launch.bench --suite=loss: the fused train step, chunked logits next to full logits.

Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
151,936, tied embeddings) with random weights. Each step packs --loss_tokens tokens into rows of
--loss_row_len (two GRPO trajectories per row, ~40% action tokens) as one micro-batch, with the
policy terms pg + kl + entropy (the heaviest logits path: logp and entropy per token).

JSON lines:
- matmul_peak: best-of-5 FLOP/s of a square matmul in --loss_dtype, measured in this run; it is
  measured again right before every timed line (`peak_tflops`), which is that line's MFU reference.
- logits: the logits path alone (final hidden states -> GRPO loss -> gradients of the hidden states
  and the lm_head), per variant. `temp_gb` is XLA's working set of the compiled path, `out_gb` its
  outputs (the two gradients, which any step has), `peak_gb` = arguments + outputs + temp - aliased.
- step: the whole train step (decoder forward and backward with full remat, loss, AdamW), per
  variant, with the same memory fields.
- grpo_step: one GRPO mini-batch as `Learner.train` runs it (reference pass + step), with the
  separate old-log-prob pass (`old_logp_pass`) and without it (`on_policy`: one mini-batch, old =
  current inside the step), then a `ratio` line (on_policy / old_logp_pass time); at the token
  counts of --loss_time_step_tokens.
- peer_step: the batch of the comparison with Tunix (issue 34): 8 sequences of 64 prompt + 128
  completion tokens, one per row, one micro-batch; pg (clip 0.2) + kl (0.04), seq-mean-token-mean;
  old and reference log-probs carried by the batch (computed outside the timed call); clipping 1.0
  + AdamW. Two lines, `grads` (loss and gradients) and `step` (+ clipping and AdamW), each with the
  FLOP bound of this host measured right before it (`bound_seconds` = model FLOPs / matmul peak,
  `of_bound` = bound / measured). No remat (the batch's activations fit), the config's chunked head.
- demo_train: the demo's RL train phase (`configs/demo.py`, what a step's `train_s` times): its
  random-init policy, the first step's 6 tasks x 8 episodes played by the demonstrator with the warm
  start's slips and idling (the demo's episode lengths; every other episode of a group marked failed,
  so advantages and forecasting examples are the step's mix), `loop.learn` on them (mini-batches,
  old / reference passes, one optimizer step each). `model_tflop` counts each pass's model FLOPs on
  the rows' tokens (forward 2 N T, step 6 N T, attention 4 H D per (query, key) pair the mask lets
  through, three times that in the step); `bound_seconds` is that over the matmul peak measured
  right before.
Time, tokens/s and MFU are measured (best of --loss_repeats, after a warm-up call unless
--noloss_warmup) where the compiled
peak fits in --loss_max_run_gb of host/device memory and, for the whole step, where the token count
is in --loss_time_step_tokens; otherwise the line says why not (`skipped`). MFU counts model FLOPs
(6 x matmul parameters x tokens, plus 12 x layers x heads x head_dim x row length x tokens for
attention); the chunked path's recompute of the logits in the backward pass is overhead, not
counted.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

from launch import timing

flags.DEFINE_list("loss_tokens", ["4096", "16384"], "Tokens per step.")
flags.DEFINE_integer("loss_row_len", 2048, "Packed row length (attention scores are [rows, H, L, L]).")
flags.DEFINE_integer("loss_layers", 24, "Decoder layers (24 = Qwen2.5-0.5B).")
flags.DEFINE_integer("loss_chunk_tokens", 512, "Tokens per logits chunk of the chunked variant.")
flags.DEFINE_enum("loss_dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
flags.DEFINE_integer("loss_repeats", 1, "Timed repeats; the best is reported.")
flags.DEFINE_bool("loss_warmup", True, "One untimed call before the timed ones (compiles are always "
                  "excluded: executables are compiled ahead of time).")
flags.DEFINE_list("loss_parts", ["logits", "step", "grpo", "peer", "demo"], "What to measure: logits, step, "
                  "grpo, peer, demo.")
flags.DEFINE_list("loss_variants", ["chunked", "full"], "Logits variants: chunked, full.")
flags.DEFINE_list("loss_time_step_tokens", ["4096"], "Token counts at which the whole step is timed "
                  "(memory is reported at all of them); 'all' for every --loss_tokens.")
flags.DEFINE_float("loss_max_run_gb", None, "Run only variants whose compiled peak is below this "
                   "(default: 75% of the available host memory on CPU, the device's memory otherwise).")
FLAGS = flags.FLAGS

GB = 1024 ** 3
VARIANTS = {"chunked": "chunk", "full": None}  # variant -> logits_chunk_tokens (None = full logits)
TERMS = ("pg", "kl", "entropy")


def _variants():
    """(name, logits_chunk_tokens) of the selected variants."""
    return [(v, FLAGS.loss_chunk_tokens if VARIANTS[v] == "chunk" else None) for v in FLAGS.loss_variants]


def _emit(**line):
    print(json.dumps(line), flush=True)


def _best(fn, repeats: int) -> float:
    if FLAGS.loss_warmup:
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    arg, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = getattr(m, "alias_size_in_bytes", 0)
    return {"peak_gb": round((arg + out + temp - alias) / GB, 3), "temp_gb": round(temp / GB, 3),
            "out_gb": round(out / GB, 3), "arg_gb": round(arg / GB, 3)}


def _max_run_bytes() -> float:
    import jax
    if FLAGS.loss_max_run_gb is not None:
        return FLAGS.loss_max_run_gb * GB
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return 0.9 * stats["bytes_limit"]
    return 0.75 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def matmul_peak(dtype: str, emit: bool = True) -> float:
    """`timing.matmul_peak`, printed as a bench line unless `emit` is False."""
    import jax

    flops = timing.matmul_peak(dtype)
    if emit:
        _emit(bench="loss", kind="matmul_peak", backend=jax.default_backend(), dtype=dtype,
              tflops=round(flops / 1e12, 4))
    return flops


def _timed(fn, flops: float, tokens: int) -> dict:
    """Best-of time of fn, and MFU against a matmul peak re-measured right before it (on a shared
    machine the peak drifts; the ratio is taken under the same conditions)."""
    peak = matmul_peak(FLAGS.loss_dtype, emit=False)
    seconds = _best(fn, FLAGS.loss_repeats)
    return {"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "mfu": round(flops / seconds / peak, 4), "peak_tflops": round(peak / 1e12, 4)}


def model_config(layers: int, dtype: str):
    import models
    return models.QwenConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=layers, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                             rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
                             dtype=dtype, param_dtype=dtype, scan_layers=True, remat="full")


def packed_batch(tokens: int, row_len: int, vocab: int, seed: int = 0):
    """[1 micro-batch, rows, row_len] of GRPO trajectories, two per row, with real loss weights
    (`batching.sequence_segments`) and old / reference log-probs near each other."""
    from cope_jax.batch import batching
    from cope_jax.objective import methods

    rng = np.random.RandomState(seed)
    row_len = min(row_len, tokens)
    rows = tokens // row_len
    n = row_len // 2
    ids = [rng.randint(0, vocab, n) for _ in range(2 * rows)]
    actions = [(np.arange(n) // 64) % 5 >= 3 for _ in ids]  # 64-token turns, 40% of them actions
    advantages = rng.choice([-1.0, 1.0], len(ids))
    segs = batching.sequence_segments(ids, actions, advantages, TERMS, methods.LossConfig(), row_len)
    for s in segs:
        s.old_logp = -np.abs(rng.randn(n)).astype(np.float32)
        s.ref_logp = s.old_logp + 0.1 * rng.randn(n).astype(np.float32)
    batch, _ = batching.pack_minibatch(segs, TERMS, row_len, rows_per_micro=rows)
    return batch


def model_flops(cfg, tokens: int, row_len: int) -> tuple[float, float]:
    """(whole step, logits path) model FLOPs: 6 N T plus attention; 6 V E T for the head."""
    E, H, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    per_layer = E * H * D * 2 + 2 * E * K * D + 3 * E * F
    head = 6.0 * V * E * tokens
    attention = 12.0 * cfg.num_layers * H * D * row_len * tokens
    return 6.0 * per_layer * cfg.num_layers * tokens + head + attention, head


def bench_logits(cfg, batch, tokens: int, max_bytes: float):
    import jax
    import jax.numpy as jnp
    from cope_jax.objective import losses
    from cope_jax.train import logprobs

    mb = jax.tree.map(lambda a: jnp.asarray(a[0]), batch)
    R, L = mb.tokens.shape
    E, V = cfg.hidden_size, cfg.vocab_size
    key = jax.random.key(1)
    h = (jax.random.normal(key, (R, L, E), jnp.float32)).astype(cfg.dtype)
    w = (0.02 * jax.random.normal(jax.random.key(2), (V, E), jnp.float32)).astype(cfg.param_dtype)
    _, flops = model_flops(cfg, tokens, L)
    for variant, chunk in _variants():

        def loss(h, w):
            logp, ent = logprobs.token_logprobs(h, w, mb.tokens, mb.segment_ids, chunk_tokens=chunk)
            w = mb.weights["pg"]  # the three policy terms weigh the same tokens
            pg, _ = losses.clipped_policy_loss(logp, mb.old_logp, mb.advantage, w)
            kl, _ = losses.low_var_kl(logp, mb.ref_logp, w)
            e, _ = losses.entropy_bonus(ent, w)
            return pg + 1e-3 * kl - 1e-3 * e

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = fn.lower(h, w).compile()
        mem = _memory(compiled)
        line = dict(bench="loss", kind="logits", variant=variant, tokens=tokens, rows=R, row_len=L,
                    chunk_tokens=chunk, **mem)
        if mem["peak_gb"] * GB > max_bytes:
            _emit(**line, skipped=f"compiled peak {mem['peak_gb']} GB exceeds {max_bytes / GB:.1f} GB")
            continue
        _emit(**line, **_timed(lambda: jax.block_until_ready(compiled(h, w)), flops, tokens))


def bench_step(cfg, batch, tokens: int, max_bytes: float, time_it: bool):
    import gc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models
    from cope_jax.objective import methods
    from cope_jax.train import train_step

    R, L = batch.tokens.shape[1:]
    flops, _ = model_flops(cfg, tokens, L)
    model = models.create_model(cfg, seed=0)
    for variant, chunk in _variants():
        loss_cfg = methods.LossConfig(logits_chunk_tokens=chunk)
        learner = train_step.Learner(model, loss_cfg)
        state = nnx.state((learner.model, learner.optimizer))
        coefs = {t: jnp.float32(c) for t, c in loss_cfg.coefficients(TERMS).items()}
        placed = train_step.place_batch(batch)
        compiled = learner.step_program().lower(state, placed, coefs).compile()
        mem = _memory(compiled)
        line = dict(bench="loss", kind="step", variant=variant, tokens=tokens, rows=R, row_len=L,
                    layers=cfg.num_layers, dtype=cfg.dtype, remat=cfg.remat, chunk_tokens=chunk, **mem)
        if not time_it:
            _emit(**line, skipped="not in --loss_time_step_tokens")
        elif mem["peak_gb"] * GB > max_bytes:
            _emit(**line, skipped=f"compiled peak {mem['peak_gb']} GB exceeds {max_bytes / GB:.1f} GB")
        else:
            def one_step():
                nonlocal state
                state, metrics = compiled(state, placed, coefs)  # donates and replaces the state
                jax.block_until_ready(metrics)

            _emit(**line, **_timed(one_step, flops, tokens))
            nnx.update((learner.model, learner.optimizer), state)  # the model's arrays were donated
        del learner, state, compiled
        gc.collect()


def bench_grpo(cfg, batch, tokens: int, max_bytes: float) -> None:
    """One GRPO mini-batch (pg + kl + entropy, a reference model) as `Learner.train` runs it: with
    the separate old-log-prob forward pass (several mini-batches per train batch) and without it
    (one mini-batch: old = current inside the step), then their time ratio."""
    import gc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models
    from cope_jax.objective import methods
    from cope_jax.train import train_step

    R, L = batch.tokens.shape[1:]
    flops, _ = model_flops(cfg, tokens, L)
    model = models.create_model(cfg, seed=0)
    ref_model = models.qwen.frozen_copy(model)
    learner = train_step.Learner(model, methods.LossConfig(logits_chunk_tokens=FLAGS.loss_chunk_tokens))
    state = nnx.state((learner.model, learner.optimizer))
    coefs = {t: jnp.float32(c) for t, c in learner.cfg.coefficients(batch.weights).items()}
    mem = _memory(learner.step_program().lower(state, train_step.place_batch(batch), coefs).compile())
    if mem["peak_gb"] * GB > max_bytes:
        _emit(bench="loss", kind="grpo_step", tokens=tokens, skipped=f"compiled peak {mem['peak_gb']} GB "
              f"exceeds {max_bytes / GB:.1f} GB")
        return
    seconds = {}
    for variant, on_policy in (("old_logp_pass", False), ("on_policy", True)):
        def one_step():
            filled = learner.fill_logprobs(batch, ref_model, on_policy=on_policy)
            jax.block_until_ready(learner.step(filled, on_policy=on_policy))

        line = _timed(one_step, flops, tokens)
        seconds[variant] = line["seconds"]
        _emit(bench="loss", kind="grpo_step", variant=variant, tokens=tokens, rows=R, row_len=L,
              layers=cfg.num_layers, dtype=cfg.dtype, **line)
    _emit(bench="loss", kind="ratio", compared="grpo_step on_policy / old_logp_pass", tokens=tokens,
          time_ratio=round(seconds["on_policy"] / seconds["old_logp_pass"], 3))
    del learner, ref_model, model, state
    gc.collect()


PEER = dict(sequences=8, prompt=64, completion=128, kl_coef=0.04)


def peer_batch(vocab: int, seed: int = 0):
    """The peer comparison's batch: one micro-batch [1, 8, 192], loss weights of pg and kl."""
    from cope_jax.batch import batching
    from cope_jax.objective import methods

    rng = np.random.RandomState(seed)
    n, length = PEER["sequences"], PEER["prompt"] + PEER["completion"]
    ids = [rng.randint(0, vocab, length) for _ in range(n)]
    actions = [np.arange(length) >= PEER["prompt"] for _ in ids]
    cfg = methods.LossConfig(kl_coef=PEER["kl_coef"])
    segs = batching.sequence_segments(ids, actions, rng.choice([-1.0, 1.0], n), ("pg", "kl"), cfg, length)
    for s in segs:
        s.old_logp = -np.abs(rng.randn(length)).astype(np.float32)
        s.ref_logp = s.old_logp + 0.1 * rng.randn(length).astype(np.float32)
    batch, _ = batching.pack_minibatch(segs, ("pg", "kl"), length, rows_per_micro=n)
    return batch, cfg


def bench_peer(cfg) -> None:
    """`peer_step` lines (module docstring): loss + gradients, then the whole step."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models
    from cope_jax.train import train_step

    cfg = dataclasses.replace(cfg, remat="none")
    batch, loss_cfg = peer_batch(cfg.vocab_size)
    placed = train_step.place_batch(batch)
    tokens = int(batch.tokens.size)
    flops, _ = model_flops(cfg, tokens, batch.tokens.shape[-1])
    learner = train_step.Learner(models.create_model(cfg, seed=0), loss_cfg)
    coefs = {t: jnp.float32(c) for t, c in loss_cfg.coefficients(batch.weights).items()}
    graphdef, params = nnx.split(learner.model, nnx.Param)

    @jax.jit
    def grads(params, batch, coefs):
        return train_step.loss_and_grads(nnx.merge(graphdef, params), batch, loss_cfg, coefs)[:2]

    state = nnx.state((learner.model, learner.optimizer))
    step = learner.step_program().lower(state, placed, coefs).compile()

    def one_step():
        nonlocal state
        state, metrics = step(state, placed, coefs)  # donates and replaces the state
        jax.block_until_ready(metrics)

    shape = dict(sequences=PEER["sequences"], prompt=PEER["prompt"], completion=PEER["completion"],
                 tokens=tokens, layers=cfg.num_layers, dtype=cfg.dtype, chunk_tokens=loss_cfg.logits_chunk_tokens)
    for part, fn in (("grads", lambda: jax.block_until_ready(grads(params, placed, coefs))), ("step", one_step)):
        line = _timed(fn, flops, tokens)
        bound = flops / (line["peak_tflops"] * 1e12)
        _emit(bench="loss", kind="peer_step", part=part, **shape, model_tflop=round(flops / 1e12, 4), **line,
              bound_seconds=round(bound, 3), of_bound=round(bound / line["seconds"], 4))


def demo_phase():
    """(the demo's run parts, the mini-batch trajectories and examples of its first RL step):
    module docstring, `demo_train`. Close the parts' pool after use."""
    import dataclasses
    import tempfile

    from configs.demo import get_config
    from cope_jax.batch.forecasting import build_examples
    from cope_jax.run.build import build
    from cope_jax.run.demos import expert_trajectories
    from cope_jax.stages.loop import rollout_runner

    c = get_config()
    parts = build(c, tempfile.mkdtemp(prefix="bench_demo_"))
    tasks = parts.family.task_ids(c.env.train_split)[:c.rollout.tasks_per_step]
    task_ids = [t for t in tasks for _ in range(c.rollout.group_size)]
    played = expert_trajectories(rollout_runner(parts, "train"), task_ids, max_rounds=c.env.max_rounds_train,
                                 mistakes=c.warmstart.mistakes, dawdle=c.warmstart.dawdle, seed=c.seed)
    trajs = [dataclasses.replace(t, group_id=i // c.rollout.group_size, success=i % 2 == 0,
                                 score=float(i % 2 == 0)) for i, t in enumerate(played)]
    return parts, trajs, build_examples(trajs, parts.chat, parts.forecast_cfg)


def demo_flops(cfg, mbs) -> float:
    """Model FLOPs of `loop.learn` on `mbs`: per mini-batch a forward pass per log-prob field its
    terms read (2 N T) and the step (6 N T), attention 4 H D per visible (query, key) pair forward."""
    from cope_jax.objective.methods import needing
    from models import attention as attn

    E, H, K, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    N = cfg.num_layers * (E * H * D * 2 + 2 * E * K * D + 3 * E * F) + cfg.vocab_size * E
    total = 0.0
    for mb in mbs:
        seg, pos, branch = (np.asarray(a).reshape(-1, a.shape[-1]) for a in
                            (mb.batch.segment_ids, mb.batch.positions, mb.batch.branch_ids))
        tokens = float((seg > 0).sum())
        pairs = float(np.asarray(attn.dense_mask(attn.packed_ids(seg, pos, branch))).sum())  # visible ones
        forward = 2 * N * tokens + 4 * cfg.num_layers * H * D * pairs
        passes = len([f for f in ("old_logp", "ref_logp") if needing(mb.terms, f)])
        total += passes * forward + 3 * forward
    return total


def bench_demo() -> None:
    """The `demo_train` line (module docstring): best of --loss_repeats after a warm-up call."""
    from cope_jax.train.train_step import Learner
    from cope_jax.stages.loop import learn
    import models

    parts, trajs, examples = demo_phase()
    try:
        c = parts.config
        ref_model = models.qwen.frozen_copy(parts.model)
        learner = Learner(parts.model, parts.loss_cfg, parts.opt_cfg, mesh=parts.mesh)
        mbs = []

        def phase():
            _, _, built = learn(parts, learner, parts.loss_cfg, parts.spec, trajs, examples,
                                groups_per_minibatch=c.train.minibatch_tasks, ref_model=ref_model)
            mbs[:] = built

        peak = matmul_peak(FLAGS.loss_dtype, emit=False)
        seconds = _best(phase, FLAGS.loss_repeats)
        flops = demo_flops(parts.model.cfg, mbs)
        tokens = int(sum((np.asarray(mb.batch.segment_ids) > 0).sum() for mb in mbs))
        _emit(bench="loss", kind="demo_train", episodes=len(trajs), af_examples=len(examples),
              minibatches=len(mbs), tokens=tokens, seconds=round(seconds, 3), model_tflop=round(flops / 1e12, 4),
              peak_tflops=round(peak / 1e12, 4), bound_seconds=round(flops / peak, 3),
              of_bound=round(flops / peak / seconds, 4))
    finally:
        parts.close()


def run(argv: list[str]) -> None:
    del argv
    import jax
    matmul_peak(FLAGS.loss_dtype)
    cfg = model_config(FLAGS.loss_layers, FLAGS.loss_dtype)
    max_bytes = _max_run_bytes()
    timed = FLAGS.loss_time_step_tokens
    if "peer" in FLAGS.loss_parts:
        bench_peer(cfg)
    if "demo" in FLAGS.loss_parts:
        bench_demo()
    for tokens in (int(t) for t in FLAGS.loss_tokens if {"logits", "step", "grpo"} & set(FLAGS.loss_parts)):
        batch = packed_batch(tokens, FLAGS.loss_row_len, cfg.vocab_size)
        tokens = batch.tokens.size  # whole rows
        if "logits" in FLAGS.loss_parts:
            bench_logits(cfg, batch, tokens, max_bytes)
        time_it = "all" in timed or str(tokens) in timed
        if "step" in FLAGS.loss_parts:
            bench_step(cfg, batch, tokens, max_bytes, time_it=time_it)
        if "grpo" in FLAGS.loss_parts and time_it:
            bench_grpo(cfg, batch, tokens, max_bytes)
    jax.clear_caches()
