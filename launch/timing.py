"""Timing helpers the benchmarks and the acceptance run share: best-of-N wall time of a device call
this machine's matmul peak and memory bandwidth, each measured in the same run as what it is compared with."""
from __future__ import annotations

import time


def best_seconds(call, repeats: int, setup=lambda: None) -> float:
    """Best wall time of `call()` (its result waited for) over `repeats` calls after a first one
    (it compiles), each after an untimed `setup()`."""
    import jax

    best = float("inf")
    for r in range(max(1, repeats) + 1):
        setup()
        t = time.perf_counter()
        jax.block_until_ready(call())
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(dtype: str, n: int | None = None, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul in `dtype`, accumulated in float32 (n default:
    2048 on CPU, 8192 on accelerators)."""
    import jax
    import jax.numpy as jnp

    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    product = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / best_seconds(lambda: product(a), repeats)


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a jitted sum over a bf16 array of `nbytes` (it reads each byte once), best of
    `repeats`: memory's bandwidth where `nbytes` outgrows the caches."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return nbytes / best_seconds(lambda: total(x), repeats)
