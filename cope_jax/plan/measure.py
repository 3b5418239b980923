"""Compile one program for a target and read what the compiler says: memory per chip, and cost.

Memory is the compiler's `memory_analysis` of the exact program (arguments, new outputs,
temporaries, code), plus the run's buffers that stay alive meanwhile (`Program.resident_bytes`),
against the chip's usable memory. The TPU compiler refuses a program that does not fit; that
refusal is a result ("does not fit", with the compiler's numbers), not an error. A program whose
parameters, optimizer state and resident buffers alone exceed the memory is not compiled at all
(full fine-tuning of 7B on one GPU: minutes of compiling to learn what a sum says).

Cost is the compiler's `cost_analysis` (FLOPs and HBM bytes per chip). It counts a loop body once,
so each loop kind with more than one trip is compiled once more unrolled by two
(`models.loops.unrolled`): the difference is one iteration, and the program's cost is the counted
cost plus (trips - 1) iterations per kind (times the enclosing trips for a loop inside a
counted loop: the blockwise attention inside each decoder layer). A loop marked `whole` (the
sampler's layers) is compiled unrolled entirely instead: there one more iteration of the rolled
loop counted twice what an unrolled layer does. The partitioner makes loops of its own too (a windowed
einsum overlaps an FSDP all-gather with slices of the matmul), which no flag of ours unrolls, so the
cost compiles turn those off (`COST_OPTIONS`): they move the same FLOPs and bytes, only in one piece.
The GPU compiler reports no cost, so GPU estimates use the analytical counts; what it reports
instead is what each program launches (`plan/launches.py`: kernels, and loops the host steers); so do programs whose
cost variants do not fit (the note says so). The roofline time, max(FLOPs / peak, bytes / bandwidth), is an estimate: a
lower bound that ignores communication and overlap.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time

from cope_jax.plan import launches
from cope_jax.plan.programs import Program
from cope_jax.plan.targets import Target
from models import loops


@dataclasses.dataclass
class Result:
    program: str
    shape: str
    fits: bool
    compile_s: float
    usable_bytes: int
    params: int = 0
    optimizer: int = 0
    inputs: int = 0
    outputs: int = 0
    temporaries: int = 0
    code: int = 0
    resident: int = 0
    total: int = 0
    refused: str = ""              # the compiler's reason when it refused the program (or ours)
    compiled: bool = True          # False: its state alone exceeds the memory (module docstring)
    flops: float | None = None     # per chip, per call
    hbm_bytes: float | None = None
    cost_source: str = ""          # 'compiler' or 'analytic'
    analytic_flops: float = 0.0
    est_s: float | None = None
    tokens_per_s: float | None = None
    must_bytes: float | None = None  # per chip: what the program cannot avoid moving (`Program.must_bytes`)
    bytes_ratio: float | None = None  # hbm_bytes / must_bytes
    kernels: int | None = None     # GPU: kernels launched per call (per step of a decode loop)
    kernels_per_layer: float | None = None
    host_synced: int | None = None  # GPU: loops (and conditionals) per call whose trip count the host reads
    note: str = ""

    @property
    def headroom(self) -> int:
        return self.usable_bytes - self.total

    @property
    def largest_part(self) -> tuple[str, int]:
        """(name, bytes) of the largest of the parts its total adds up. A program the compiler
        refused has one figure for all its own buffers (arguments, temporaries)."""
        if self.refused and self.compiled:
            parts = {"resident": self.resident, "its own buffers": self.total - self.resident}
        else:
            parts = {"params": self.params, "optimizer": self.optimizer, "inputs": self.inputs,
                     "outputs": self.outputs, "temporaries": self.temporaries, "code": self.code,
                     "resident": self.resident}
        return max(parts.items(), key=lambda kv: kv[1])


# compiler options of the cost compiles (TPU): no partitioner-made loops (module docstring)
COST_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
_OOM = re.compile(r"(RESOURCE_EXHAUSTED|[Rr]an out of memory)")
_GIB = re.compile(r"(\d+(?:\.\d+)?)([KMGT])(?:i?B)?\b")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CompileError(RuntimeError):
    """The target's compiler failed on a program for a reason other than memory."""


def measure(program: Program, target: Target, *, cost: bool = True) -> Result:
    t0 = time.perf_counter()
    result = Result(program.name, program.shape, fits=False, compile_s=0.0, usable_bytes=target.usable_bytes,
                    resident=program.resident_bytes, analytic_flops=program.analytic_flops, note=program.note)
    state = program.param_bytes + program.optimizer_bytes + program.resident_bytes
    if state > target.usable_bytes:
        result.params, result.optimizer, result.total = program.param_bytes, program.optimizer_bytes, state
        result.compiled = False
        result.refused = (f"not compiled: its parameters, optimizer state and resident buffers alone are "
                          f"{state / (1 << 30):.1f} of {target.usable_bytes / (1 << 30):.1f} GiB")
        return result
    try:
        compiled = program.lower().compile()
    except Exception as e:  # the TPU compiler refuses what does not fit
        if not _OOM.search(str(e)):
            raise CompileError(f"the {target.platform.upper()} compiler failed on {program.name} ({program.shape}) "
                               f"for {target.name}: {_first_line(str(e))}") from e
        result.compile_s = time.perf_counter() - t0
        result.refused = _first_line(str(e))
        result.params, result.optimizer = program.param_bytes, program.optimizer_bytes
        result.total = _refused_total(str(e)) + program.resident_bytes
        return result
    result.compile_s = time.perf_counter() - t0
    _memory(result, compiled.memory_analysis(), program)
    if target.platform == "cuda":
        _launches(result, compiled.as_text(), program)
    result.fits = result.total <= result.usable_bytes
    if cost:
        add_cost(result, program, target)
    return result


def _memory(result: Result, mem, program: Program) -> None:
    result.params, result.optimizer = program.param_bytes, program.optimizer_bytes
    result.inputs = max(0, mem.argument_size_in_bytes - program.param_bytes - program.optimizer_bytes)
    result.outputs = max(0, mem.output_size_in_bytes - mem.alias_size_in_bytes)
    result.temporaries, result.code = mem.temp_size_in_bytes, mem.generated_code_size_in_bytes
    result.total = (mem.argument_size_in_bytes + result.outputs + result.temporaries + result.code
                    + program.resident_bytes)


def _launches(result: Result, hlo_text: str, program: Program) -> None:
    counted = launches.count(hlo_text, per_step=program.per_step)
    result.kernels, result.host_synced = counted.kernels, counted.host_synced
    layers = program.loops.get("layers")
    result.kernels_per_layer = counted.kernels / layers.trips if layers else None


def add_cost(result: Result, program: Program, target: Target) -> None:
    """The roofline estimate of a measured program (module docstring)."""
    if result.refused:
        return
    counted = _compiler_cost(program, target) if target.platform == "tpu" else None
    if counted is None:
        result.flops, result.hbm_bytes, result.cost_source = program.analytic_flops, program.must_bytes, "analytic"
        if target.platform == "tpu":
            result.note = "; ".join(filter(None, (result.note, "a cost compile does not fit: analytic FLOPs")))
    else:
        result.flops, result.hbm_bytes, result.cost_source = *counted, "compiler"
    result.must_bytes = program.must_bytes
    if program.must_bytes and result.hbm_bytes and result.cost_source == "compiler":  # analytic: they are one
        result.bytes_ratio = result.hbm_bytes / program.must_bytes
    chip = target.chip
    result.est_s = max(result.flops / chip.peak_flops, (result.hbm_bytes or 0.0) / chip.hbm_bandwidth)
    result.tokens_per_s = program.tokens / result.est_s if result.est_s else None


def _compiler_cost(program: Program, target: Target) -> tuple[float, float] | None:
    """(FLOPs, HBM bytes) per chip of one call, every loop iteration counted; None when a cost
    compile does not fit."""
    options = COST_OPTIONS if target.platform == "tpu" else {}
    whole = [kind for kind, loop in program.loops.items() if loop.whole and loop.trips > 1]
    try:
        with contextlib.ExitStack() as stack:
            for kind in whole:
                stack.enter_context(loops.unrolled(kind, True))
            base = _counted(program.lower().compile(compiler_options=options))
            flops, hbm = base
            for kind, loop in program.loops.items():
                if loop.trips <= 1 or kind in whole:
                    continue
                with loops.unrolled(kind):
                    f2, b2 = _counted(program.lower().compile(compiler_options=options))
                per = 1 if loop.traced else loops.trips_counted(loop.trips)  # a traced count peels nothing
                flops += loop.times * (loop.trips - 1) * (f2 - base[0]) / per
                hbm += loop.times * (loop.trips - 1) * (b2 - base[1]) / per
    except Exception as e:
        if _OOM.search(str(e)):
            return None
        raise
    return flops, hbm


def _counted(compiled) -> tuple[float, float] | None:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"]), float(analysis.get("bytes accessed", 0.0))


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if _OOM.search(ln) or "exceed" in ln.lower()]
    return (lines[0] if lines else message.strip().splitlines()[0])[:300]


def _refused_total(message: str) -> int:
    """The largest memory figure in the compiler's refusal: what the program would have needed. The
    TPU compiler calls it "HLO temporaries" but counts the arguments in it too (a refused decode
    loop's figure is its parameters + cache + temporaries as compiled on a larger chip)."""
    sizes = [float(v) * _UNITS[u] for v, u in _GIB.findall(message)]
    return int(max(sizes)) if sizes else 0
