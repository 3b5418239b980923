"""The planner on one host: the most sampler rows that fit (`--sampler_rows=auto`), a state that
cannot fit reported without compiling, and a LoRA run's warm start planned as the full step it is."""
import json

import numpy as np
import pytest

from cope_jax.plan import measure, planner, programs, report, targets
from cope_jax.run import run_config
from models import lora, presets, qwen
from tests.plan.test_plan import TINY, _records, _run, _tiny_config

GIB = 1 << 30


def _long_window(rows: int = 64):
    c = _tiny_config()
    c.rollout.update(sampler_rows=rows, max_len=16384)
    return c


def _sampler_total(cfg, target, rows: int) -> float:
    """The tightest sampler program's total at `rows` rows, planned with that many rows set."""
    c = _long_window(rows)
    plan = planner.plan(c, "demo", target, cfg, "tiny", (1, 1, 1), cost=False, only=programs.SAMPLER_PROGRAMS)
    return max(r.total for r in plan.results)


def test_sampler_rows_auto_finds_the_most_rows_that_fit(monkeypatch):
    """On one GPU whose usable memory lies between what 16 and 32 rows of a long window need, the
    search settles on 16: plans made with 16 and 32 rows set by hand say the same."""
    target = targets.get_target("1xH100")
    c = _long_window()
    cfg = run_config.random_model_config(c, 1024)
    at16, at32 = (_sampler_total(cfg, target, r) for r in (16, 32))
    assert at32 > at16 * 1.5  # the cache dominates
    # usable = memory x XLA_PYTHON_CLIENT_MEM_FRACTION (targets.Target.usable_bytes)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", str((at16 + at32) / 2 / target.chip.hbm_bytes))
    assert at16 < target.usable_bytes < at32
    found = planner.plan(c, "demo", target, cfg, "tiny", (1, 1, 1), cost=False, only=programs.SAMPLER_PROGRAMS,
                         sampler_rows="auto")
    assert found.sampler_rows == 16 and found.rows_searched and found.fits
    assert {r.program for r in found.results} == set(programs.SAMPLER_PROGRAMS)
    assert max(r.total for r in found.results) == at16
    assert "sampler rows per host 16 (searched" in report.header(found)[1]


def test_sampler_rows_auto_keeps_the_configs_rows_when_they_fit():
    c = _tiny_config()
    plan = planner.plan(c, "demo", targets.get_target("1xH100"), run_config.random_model_config(c, 1024), "tiny",
                        (1, 1, 1), cost=False, only=("decode",), sampler_rows="auto")
    assert plan.sampler_rows == c.rollout.sampler_rows == 8 and plan.fits


def test_sampler_rows_auto_from_the_command_line():
    rc, out, err = _run("--config=configs/demo.py", "--topology=1xH100", "--json", "--nocost", *TINY,
                        "--sampler_rows=auto", "--programs=decode")
    assert rc == 0, err
    summary = _records(out)[-1]
    assert summary["sampler_rows"] == 8 and summary["rows_searched"] and summary["lora_rank"] is None
    rc, _, err = _run("--config=configs/demo.py", "--topology=1xH100", "--sampler_rows=most", *TINY)
    assert rc == 1 and "sampler_rows" in err


def test_a_state_too_large_for_the_chip_is_reported_without_compiling():
    """Full fine-tuning of Qwen2.5-7B on one H100: float32 parameters and AdamW's two moments alone
    are 12 bytes a parameter, ~85 GiB of 59; the plan says so at once and names the largest part."""
    c = _tiny_config()
    cfg = run_config.adapted(c, presets.preset_config("Qwen2.5-7B-Instruct", **run_config.execution(c)))
    target = targets.get_target("1xH100")
    plan = planner.plan(c, "sciworld", target, cfg, "Qwen2.5-7B-Instruct", (1, 1, 1), cost=False,
                        only=("train_step",))
    step = plan.results[0]
    n = qwen.count_params(cfg)
    assert not plan.fits and step.compile_s == 0 and step.refused.startswith("not compiled")
    assert step.params == 4 * n and step.optimizer == 8 * n + 8
    assert step.total == step.params + step.optimizer + step.resident > target.usable_bytes
    assert step.largest_part == ("optimizer", step.optimizer)
    assert report.tightest(plan).startswith("train_step ") and "largest part optimizer" in report.tightest(plan)
    assert json.dumps(report.json_records(plan))  # every field is plain data


def test_a_lora_runs_warm_start_is_planned_as_a_full_step():
    """The warm start trains every weight under LoRA too (stages/warmstart.py, through the base view):
    its program holds the whole base in the compute dtype with AdamW moments of every weight, the
    adapters stay alive beside it; the RL step holds the adapters' moments only."""
    c = _tiny_config()
    c.model.dtype = "bfloat16"
    c.train.lora.update(rank=8)
    c.warmstart.steps = 4
    cfg = run_config.random_model_config(c, 1024)
    target = targets.get_target("v5e-8")
    layout, progs = programs.run_programs(c, cfg, targets.devices(target), (1, 8, 1))
    warm, rl = (next(p for p in progs if p.name == n) for n in ("warmstart_step", "train_step"))
    shapes = qwen.param_shapes(cfg)

    def per_chip(name, shape):  # fsdp 8 splits each `embed` dimension (hidden 128)
        axes = qwen.PARAM_AXES[name]
        return int(np.prod(shape)) // (8 if "embed" in axes and shape[axes.index("embed")] % 8 == 0 else 1)
    base = sum(per_chip(n, s) for n, s in shapes.items() if not lora.is_adapter(n))
    adapters = sum(per_chip(n, s) for n, s in shapes.items() if lora.is_adapter(n))
    assert warm.param_bytes == 2 * base
    assert 0 < warm.optimizer_bytes - 2 * 2 * base <= 16  # bf16 moments, and int32 step counters
    assert warm.resident_bytes == layout.replica_bytes + 4 * adapters
    assert rl.optimizer_bytes == 2 * 4 * adapters + 8
    result = measure.measure(warm, target, cost=False)
    assert result.fits and result.temporaries > 0
    # and the analytic count: the frozen weights get no gradient in RL, the warm start trains them
    tokens = rl.tokens / programs._row_ways(layout.rows_per_micro, layout.mesh)
    remat = 2 if cfg.remat == "full" else 0
    assert warm.analytic_flops - rl.analytic_flops == pytest.approx(
        tokens * (2 * programs.layer_matmul_params(cfg) - (6 + remat) * programs.adapter_matmul_params(cfg)),
        rel=1e-6)
