"""A Plan as a table for people and as JSON lines for programs."""
from __future__ import annotations

import dataclasses
import math

from cope_jax.plan.planner import Plan
from cope_jax.plan.programs import layer_matmul_params
from models import lora, qwen

GIB = float(1 << 30)


def _gib(n) -> str:
    return f"{n / GIB:.2f}"


def _si(x, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def header(plan: Plan) -> list[str]:
    t, m = plan.target, plan.model_cfg
    chip = t.chip
    params = layer_matmul_params(m) + m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    weights = f"{m.param_dtype} weights"
    if m.lora is not None:  # the base frozen in the compute dtype, the adapters trained
        adapters = sum(math.prod(s) for n, s in qwen.param_shapes(m).items() if lora.is_adapter(n))
        weights = (f"{m.dtype} frozen weights + LoRA rank {m.lora.rank} on {len(m.lora.targets)} projections: "
                   f"{adapters / 1e6:.1f}M {m.param_dtype} parameters trained")
    return [
        f"plan: {plan.config} / {plan.model} ({params / 1e9:.2f}B parameters, {weights}, "
        f"{m.dtype} compute, remat {m.remat})",
        f"target: {t.name} ({t.chips} x {chip.kind}, {t.hosts} host{'s' if t.hosts > 1 else ''}; "
        f"{t.usable_bytes / GIB:.2f} GiB usable per chip, {_si(chip.peak_flops, 'FLOP/s')} bf16, "
        f"{_si(chip.hbm_bandwidth, 'B/s')} HBM); mesh data {plan.mesh[0]}, fsdp {plan.mesh[1]}, tp {plan.mesh[2]}; "
        f"sampler rows per host {plan.sampler_rows}"
        + (" (searched: the most that fit, up to the config's)" if plan.rows_searched else ""),
    ]


COLUMNS = ("program", "shape", "params", "optim", "inputs", "outputs", "temps", "code", "resident", "total",
           "fits", "compile s", "FLOPs/chip", "analytic", "HBM B/chip", "must move", "x", "est. s", "tokens/s",
           "kernels", "/layer", "host syncs")


def rows(plan: Plan) -> list[tuple[str, ...]]:
    out = []
    for r in plan.results:
        fits = "yes" if r.fits else "NO"
        headroom = f"{fits} ({_gib(r.headroom)})"
        cost_mark = "" if r.cost_source != "analytic" else "*"
        unknown = (lambda n: "-") if r.refused else _gib  # the compiler stopped before it laid them out
        out.append((r.program, r.shape, _gib(r.params), _gib(r.optimizer), unknown(r.inputs), unknown(r.outputs),
                    unknown(r.temporaries), unknown(r.code), _gib(r.resident), _gib(r.total), headroom,
                    f"{r.compile_s:.1f}", _si(r.flops, "") + cost_mark, _si(r.analytic_flops, ""),
                    _si(r.hbm_bytes, "") + cost_mark, _si(r.must_bytes, ""),
                    "-" if r.bytes_ratio is None else f"{r.bytes_ratio:.2f}",
                    "-" if r.est_s is None else f"{r.est_s:.3g}",
                    "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                    "-" if r.kernels is None else f"{r.kernels:,}",
                    "-" if r.kernels_per_layer is None else f"{r.kernels_per_layer:.1f}",
                    "-" if r.host_synced is None else str(r.host_synced)))
    return out


def table(plan: Plan) -> str:
    body = [COLUMNS, *rows(plan)]
    widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]
    lines = header(plan) + ["memory in GiB per chip; fits (headroom GiB); must move: the bytes a sampler "
                            "program cannot avoid (its weights, the KV cache it reads and writes), x: HBM bytes "
                            "over that; estimates are rooflines: max(FLOPs / peak, HBM bytes / bandwidth), "
                            "no communication; tokens/s per host for the sampler's programs; GPU: kernels launched per call "
                            "(per step for decode) and host syncs: loops per call whose trip count the host reads"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in body]
    for r in plan.results:
        if r.refused:
            lines.append(f"{r.program}: does not fit: {r.refused}")
        if r.note:
            lines.append(f"{r.program}: {r.note}")
    if any(r.cost_source == "analytic" for r in plan.results):
        lines.append("* analytic FLOPs (no compiler cost for this program)")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append(("fits" if plan.fits else f"does NOT fit: {tightest(plan)}") + f" ({plan.seconds:.0f} s)")
    return "\n".join(lines)


def tightest(plan: Plan) -> str:
    """'decode 177.0 of 59.4 GiB, largest part inputs 112.0': the program furthest over (or
    closest to) its memory, and what of it weighs most."""
    r = max(plan.results, key=lambda r: r.total / r.usable_bytes)
    part, size = r.largest_part
    return f"{r.program} {_gib(r.total)} of {_gib(r.usable_bytes)} GiB, largest part {part} {_gib(size)}"


def json_records(plan: Plan) -> list[dict]:
    base = dict(config=plan.config, model=plan.model, topology=plan.target.name, chips=plan.target.chips,
                mesh=list(plan.mesh))
    out = [dict(base, **dataclasses.asdict(r), largest_part=list(r.largest_part)) for r in plan.results]
    out.append(dict(base, summary=True, fits=plan.fits, warnings=plan.warnings, seconds=round(plan.seconds, 1),
                    usable_bytes=plan.target.usable_bytes, sampler_rows=plan.sampler_rows,
                    rows_searched=plan.rows_searched, lora_rank=None if plan.model_cfg.lora is None
                    else plan.model_cfg.lora.rank, tightest=tightest(plan) if plan.results else ""))
    return out
