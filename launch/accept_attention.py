"""`launch.accept`'s attention section: every implementation this backend runs, on one packed row per
length (four segments, the second a trunk with two forecasting branches: `bench_attention.packed_ids`),
bf16, GQA.

Per (length, implementation): the output's and the gradients' largest error relative to the
reference (dense where its compiled peak fits, else blockwise), forward and forward+backward seconds
(best of N) against the compiler's roofline on this device, and the device allocator's peak against
the compiler's layout of the call (TPU / GPU; the CPU client keeps no statistics).
"""
from __future__ import annotations

import os

from launch import accept_device
from launch.accept_report import Check
from launch.bench_attention import implementations, packed_ids

SIZES = {"tiny": dict(tokens=(512, 1024), heads=4, kv_heads=2, head_dim=64),
         "full": dict(tokens=(4096, 16384, 32768), heads=8, kv_heads=2, head_dim=128)}
BLOCK = 512
ERROR = 0.05  # bf16 against bf16 dense: rounding differs per block, errors of ~1e-2 of the largest value
TIME_WITHIN = 2.0  # a kernel within twice the roofline is doing its job at these sizes
MEMORY_WITHIN = 1.25


def run(*, size: str, repeats: int) -> list[Check]:
    import jax

    shape = SIZES[size]
    checks = []
    for T in shape["tokens"]:
        checks += _length(T, shape, implementations(jax.default_backend()), repeats)
    return checks


def _length(T: int, shape: dict, impls, repeats: int) -> list[Check]:
    programs = {impl: _programs(impl, T, shape) for impl in impls}
    runnable = {impl: p for impl, p in programs.items() if accept_device.compiled_peak_bytes(p[1][0]) < _budget()}
    reference = "dense" if "dense" in runnable else "blockwise"
    checks = [Check("attention", f"{impl} {T} tokens", "", None, note="its compiled peak does not fit: not run")
              for impl in programs if impl not in runnable]
    results = {impl: _run(impl, T, *p, repeats) for impl, p in runnable.items()}
    ref_out, ref_grads = results[reference][0]
    for impl, ((out, grads), timed) in results.items():
        checks += timed
        if impl == reference:
            continue
        err = max(_error(a, b) for a, b in zip((out, *grads), (ref_out, *ref_grads)))
        checks.append(Check("attention", f"{impl} {T} tokens: output / gradient error vs {reference}", "",
                            err, ERROR, within=1.0, note="the largest absolute error over the reference's largest absolute value"))
    return checks


def _programs(impl: str, T: int, shape: dict):
    """((forward, its args), (value_and_grad, its args)), compiled."""
    import jax
    import jax.numpy as jnp

    from models import attention as attn

    H, K, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    ids = packed_ids(T)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, T, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, T, K, D), jnp.bfloat16) for kk in keys[1:3])
    w = jax.random.normal(keys[3], (1, T, H, D), jnp.float32)

    def forward(q, k, v):
        return attn.attention(q, k, v, ids, implementation=impl, block=BLOCK)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * w)

    args = (q, k, v)
    fwd = jax.jit(forward).lower(*args).compile()
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return (fwd, args), (grad, args)


def _run(impl: str, T: int, fwd, grad, repeats: int):
    """((output, gradients), timing and memory checks)."""
    (f, args), (g, _) = fwd, grad
    before = accept_device.peak_bytes_in_use()
    out = f(*args)
    _, grads = g(*args)
    after = accept_device.peak_bytes_in_use()
    checks = []
    for what, compiled in (("forward", f), ("forward+backward", g)):
        seconds = accept_device.best_seconds(lambda: compiled(*args), repeats)
        predicted = accept_device.roofline_s(compiled)
        checks.append(Check("attention", f"{impl} {T} tokens {what}", "s", seconds, predicted,
                            within=None if predicted is None else TIME_WITHIN,
                            note="" if predicted is not None else "no roofline: this device has no public figures"))
    peak = None if before is None or after is None or after <= before else after - before
    checks.append(Check("attention", f"{impl} {T} tokens forward+backward peak memory", "B", peak,
                        accept_device.compiled_peak_bytes(g), within=None if peak is None else MEMORY_WITHIN,
                        note="" if peak is not None else "the client keeps no allocator statistics, or its peak "
                        "was reached earlier"))
    return (out, grads), checks


def _error(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _budget() -> float:
    """Bytes a program may lay out: 75% of the device's memory (CPU: of the free host memory)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and stats.get("bytes_limit"):
        return 0.75 * stats["bytes_limit"]
    return 0.75 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
