"""python -m launch.bench --suite=attention: blockwise attention next to dense on packed rows.

One packed row per length in --attention_tokens (four segments, the second a trunk with two
branches, as the forecasting examples are packed), GQA with --attention_heads query heads over
--attention_kv_heads, forward and backward (the train step's use): `value_and_grad` of a weighted
sum of the outputs with respect to q, k and v.

JSON lines, one per (tokens, implementation): the compiler's memory of the compiled program
(`temp_gb`: its working set; `peak_gb`: arguments + outputs + temporaries) and, where that peak
fits in --attention_max_run_gb, the best-of-N wall time; then one `ratio` line per length and
implementation over dense (the Pallas kernel only on TPU and GPU) (memory, and time where both ran). FLOPs differ on purpose: blockwise never
computes the key blocks after a query block (about half of dense's at long rows).
"""
from __future__ import annotations

import json
import os
import time

from absl import flags

flags.DEFINE_list("attention_tokens", ["2048", "4096", "8192", "16384", "32768"], "Packed row lengths.")
flags.DEFINE_integer("attention_heads", 4, "Query heads (a tp shard of a real model's).")
flags.DEFINE_integer("attention_kv_heads", 2, "Key/value heads.")
flags.DEFINE_integer("attention_head_dim", 64, "Head dimension.")
flags.DEFINE_integer("attention_block", 512, "Blockwise block size (tokens).")
flags.DEFINE_enum("attention_dtype", "float32", ["float32", "bfloat16"], "q, k, v dtype.")
flags.DEFINE_integer("attention_repeats", 3, "Timed repeats after a warm-up call; the best is reported.")
flags.DEFINE_float("attention_max_run_gb", None, "Time only programs whose compiled peak is below this "
                   "(default: 75% of the available host memory).")
FLAGS = flags.FLAGS

GB = 1024 ** 3

def implementations(backend: str) -> tuple[str, ...]:
    """dense (the reference) and blockwise everywhere; the platform's Pallas kernel on TPU and GPU
    (off them it would run in interpret mode, which measures nothing)."""
    return ("dense", "blockwise") + (("pallas",) if backend in ("tpu", "gpu") else ())


def _emit(**line):
    print(json.dumps(line), flush=True)


def packed_ids(T: int):
    """Four segments of T/4 tokens; the second a trunk of T/8 with two branches of T/16."""
    import numpy as np
    from models import attention as attn

    quarter, eighth, sixteenth = T // 4, T // 8, T // 16
    seg = np.repeat(np.arange(1, 5), quarter)
    seg = np.r_[seg, np.zeros(T - len(seg), int)]
    pos, branch = np.zeros(T, int), np.zeros(T, int)
    for s in range(4):
        pos[s * quarter:(s + 1) * quarter] = np.arange(quarter)
    tree = quarter  # second segment: trunk, then branch 1 from position eighth/2, branch 2 from eighth
    for b, start in ((1, eighth // 2), (2, eighth)):
        lo = tree + eighth + (b - 1) * sixteenth
        branch[lo:lo + sixteenth] = b
        pos[lo:lo + sixteenth] = start + np.arange(sixteenth)
    return attn.packed_ids(*(np.asarray(a, np.int32)[None] for a in (seg, pos, branch)))


def compiled_grad(impl: str, T: int):
    """(compiled fn, its arguments): value_and_grad of the attention over one packed row."""
    import jax
    import jax.numpy as jnp
    from models import attention as attn

    H, K, D = FLAGS.attention_heads, FLAGS.attention_kv_heads, FLAGS.attention_head_dim
    ids = packed_ids(T)
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.dtype(FLAGS.attention_dtype)
    args = [jax.random.normal(keys[0], (1, T, H, D), dtype)] + [
        jax.random.normal(kk, (1, T, K, D), dtype) for kk in keys[1:3]]
    w = jax.random.normal(keys[3], (1, T, H, D), jnp.float32)

    def loss(q, k, v):
        out = attn.attention(q, k, v, ids, implementation=impl, block=FLAGS.attention_block)
        return jnp.sum(out.astype(jnp.float32) * w)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn.lower(*args).compile(), args


def _max_run_bytes() -> float:
    if FLAGS.attention_max_run_gb is not None:
        return FLAGS.attention_max_run_gb * GB
    return 0.75 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure(impl: str, T: int) -> dict:
    import jax

    compiled, args = compiled_grad(impl, T)
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    line = dict(bench="attention", implementation=impl, tokens=T, heads=FLAGS.attention_heads,
                kv_heads=FLAGS.attention_kv_heads, head_dim=FLAGS.attention_head_dim,
                block=FLAGS.attention_block, dtype=FLAGS.attention_dtype,
                temp_gb=round(m.temp_size_in_bytes / GB, 4), peak_gb=round(peak / GB, 4))
    if peak > _max_run_bytes():
        line["skipped"] = f"compiled peak {peak / GB:.1f} GB > {_max_run_bytes() / GB:.1f} GB allowed"
        return line
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(max(1, FLAGS.attention_repeats)):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    line["seconds"] = round(min(times), 4)
    return line


def run(argv: list[str]) -> None:
    del argv
    import jax

    for T in (int(t) for t in FLAGS.attention_tokens):
        lines = {impl: measure(impl, T) for impl in implementations(jax.default_backend())}
        for line in lines.values():
            _emit(backend=jax.default_backend(), **line)
        dense = lines.pop("dense")
        for impl, line in lines.items():
            ratio = dict(bench="attention", kind="ratio", implementation=impl, tokens=T,
                         temp_ratio=round(line["temp_gb"] / dense["temp_gb"], 4) if dense["temp_gb"] else None)
            if "seconds" in dense and "seconds" in line:
                ratio["time_ratio"] = round(line["seconds"] / dense["seconds"], 3)
            _emit(**ratio)
