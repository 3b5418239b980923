"""The local device for `launch.accept`: its public figures, the roofline of a count of work on it,
what the compiler lays out for a program, and what running one measures (best-of-N seconds, peak
memory)."""
from __future__ import annotations

import os

# the runtime's device_kind -> the planner's chip (cope_jax/plan/targets.py: CHIPS)
KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5p": "v5p", "TPU v5": "v5p",
         "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x"}
GPUS = ("H200", "H100", "A100")  # a CUDA device_kind names its GPU: "NVIDIA H100 80GB HBM3"


def chip():
    """The planner's Chip of this machine's device, or None (CPU, or a device not in the table)."""
    import jax

    from cope_jax.plan import targets

    kind = jax.devices()[0].device_kind
    if kind in KINDS:
        return targets.CHIPS[KINDS[kind]]
    return next((targets.CHIPS[g] for g in GPUS if g in kind), None)


def roofline_s(flops: float, hbm_bytes: float) -> float | None:
    """max(FLOPs / peak, HBM bytes / bandwidth) on this device (None where it has no public figures).
    The counts are analytical: the compiler's cost analysis counts a loop body once and a Pallas or
    cuDNN kernel as nothing (on the H200 it put a 36-layer train step at 1/80 of its time and a
    kernel at a negative one); `launch.plan` corrects loops with extra compiles, accept does not."""
    c = chip()
    if c is None:
        return None
    return max(flops / c.peak_flops, hbm_bytes / c.hbm_bandwidth)


def compiled_peak_bytes(compiled) -> int:
    """What the compiler lays out for one call: arguments, new outputs and temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def peak_bytes_in_use() -> int | None:
    """The device allocator's peak so far (TPU / GPU); None where the client keeps no statistics (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def memory_budget(fraction: float = 0.9) -> float | None:
    """Bytes a program may lay out on this device: `fraction` of the allocator's limit; None where
    the client keeps no statistics (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return fraction * stats["bytes_limit"] if stats and stats.get("bytes_limit") else None


def host_budget(fraction: float = 0.75) -> float:
    """`fraction` of this host's free memory (CPU programs)."""
    return fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
