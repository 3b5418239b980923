"""`launch.accept`'s attention section: every implementation this backend runs, on one packed row per
length (four segments, the second a trunk with two forecasting branches: `bench_attention.packed_ids`),
bf16, GQA.

Per (length, implementation): the output's and the gradients' largest error relative to the
reference (dense where its compiled peak fits, else blockwise), forward and forward+backward seconds
(best of N) against the roofline of the work the row needs on this device (`_needed`: the visible
query-key pairs' matmuls, the call's inputs and outputs once; dense does more, by design), and the device allocator's peak against
the compiler's layout of the call (TPU / GPU; the CPU client keeps no statistics).
"""
from __future__ import annotations

from collections.abc import Iterator

from launch import timing
from launch.accept import device as accept_device
from launch.accept.report import Check
from launch.bench.attention import implementations, packed_ids

SIZES = {"tiny": dict(tokens=(512, 1024), heads=4, kv_heads=2, head_dim=64),
         "full": dict(tokens=(4096, 16384, 32768), heads=8, kv_heads=2, head_dim=128)}
SIZES["quick"] = dict(SIZES["full"], tokens=(16384,))  # the row the GPU kernel is held to cuDNN at
BLOCK = 512
ERROR = 0.05  # bf16 against bf16 dense: rounding differs per block, errors of ~1e-2 of the largest value
TIME_WITHIN = 2.0  # a kernel within twice the roofline is doing its job at these sizes
MEMORY_WITHIN = 1.25


def run(*, size: str, repeats: int) -> Iterator[Check]:
    import jax

    shape = SIZES[size]
    for T in shape["tokens"]:
        yield from _length(T, shape, implementations(jax.default_backend()), repeats)
        if jax.default_backend() == "gpu":
            yield from _cudnn(T, shape, repeats)


def _length(T: int, shape: dict, impls, repeats: int) -> list[Check]:
    ids = packed_ids(T)
    needed = _needed(ids, T, shape)
    programs = {impl: _programs(_ours(impl, ids), T, shape) for impl in impls}
    runnable = {impl: p for impl, p in programs.items() if accept_device.compiled_peak_bytes(p[1][0]) < _budget()}
    reference = "dense" if "dense" in runnable else "blockwise"
    checks = [Check("attention", f"{impl} {T} tokens", "", None, note="its compiled peak does not fit: not run")
              for impl in programs if impl not in runnable]
    results = {impl: _run(f"{impl} {T} tokens", *p, repeats, needed) for impl, p in runnable.items()}
    for impl in results:
        if impl != reference:
            checks.append(_agreement(f"{impl} {T} tokens", results[impl][0], results[reference][0], reference))
    return checks + [c for _, timed in results.values() for c in timed]


def _cudnn(T: int, shape: dict, repeats: int) -> list[Check]:
    """cuDNN's fused attention (`jax.nn.dot_product_attention`) as a reference where its mask can
    express the row: one causal segment (segments it could take as sequence lengths, a forecasting
    tree it cannot), beside the Pallas kernel on the same row."""
    import jax
    import numpy as np

    from models import attention as attn

    ids = attn.packed_ids(np.ones((1, T), np.int32), np.arange(T, dtype=np.int32)[None])

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    name = f"{T} tokens, one causal segment"
    needed = _needed(ids, T, shape)
    theirs = _run(f"cudnn {name}", *_programs(cudnn, T, shape), repeats, needed)
    ours = _run(f"pallas {name}", *_programs(_ours("pallas", ids), T, shape), repeats, needed)
    return [_agreement(f"pallas {name}", ours[0], theirs[0], "cudnn"), *theirs[1], *ours[1]]


def _ours(impl: str, ids):
    from models import attention as attn

    return lambda q, k, v: attn.attention(q, k, v, ids, implementation=impl, block=BLOCK)


def _agreement(name: str, result, reference, reference_name: str) -> Check:
    (out, grads), (ref_out, ref_grads) = result, reference
    err = max(_error(a, b) for a, b in zip((out, *grads), (ref_out, *ref_grads)))
    return Check("attention", f"{name}: output / gradient error vs {reference_name}", "", err, ERROR, within=1.0,
                 note="the largest absolute error over the reference's largest absolute value")


def _programs(forward, T: int, shape: dict):
    """((forward, its args), (value_and_grad, its args)), compiled, on random bf16 q, k, v of one row."""
    import jax
    import jax.numpy as jnp

    H, K, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, T, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, T, K, D), jnp.bfloat16) for kk in keys[1:3])
    w = jax.random.normal(keys[3], (1, T, H, D), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * w)

    args = (q, k, v)
    fwd = jax.jit(forward).lower(*args).compile()
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return (fwd, args), (grad, args)


def _needed(ids, T: int, shape: dict) -> dict:
    """what -> (FLOPs, bytes) the row's attention cannot avoid: 4 FLOPs per visible (query, key) pair
    and head-dim in the forward (scores, values), 8 more in the backward (dV, dP, dQ, dK); bf16 q, k,
    v read and the output (forward) or the three gradients (forward+backward) written once."""
    import numpy as np

    from models import attention as attn

    pairs = 0
    for lo in range(0, T, 2048):  # [2048, T] blocks of the mask: a whole one at 32k tokens is 1 GiB
        rows = tuple(a[:, lo:lo + 2048] for a in ids.queries())
        pairs += int(np.asarray(attn.allowed(rows, ids.keys())).sum())
    H, K, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    qkv = 2 * T * (H + 2 * K) * D
    return {"forward": (4 * pairs * H * D, qkv + 2 * T * H * D), "forward+backward": (12 * pairs * H * D, 2 * qkv)}


def _run(name: str, fwd, grad, repeats: int, needed: dict):
    """((output, gradients), timing and memory checks named `name`)."""
    (f, args), (g, _) = fwd, grad
    before = accept_device.peak_bytes_in_use()
    out = f(*args)
    _, grads = g(*args)
    after = accept_device.peak_bytes_in_use()
    checks = []
    for what, compiled in (("forward", f), ("forward+backward", g)):
        seconds = timing.best_seconds(lambda: compiled(*args), repeats)
        predicted = accept_device.roofline_s(*needed[what])
        checks.append(Check("attention", f"{name} {what}", "s", seconds, predicted,
                            within=None if predicted is None else TIME_WITHIN,
                            note="" if predicted is not None else "no roofline: this device has no public figures"))
    peak = None if before is None or after is None or after <= before else after - before
    checks.append(Check("attention", f"{name} forward+backward peak memory", "B", peak,
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
    return accept_device.memory_budget(0.75) or accept_device.host_budget(0.75)
