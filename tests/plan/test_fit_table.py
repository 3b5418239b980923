"""`launch.experiments.fit_table`: the README's fit table from planner records, and the claim that lets one row
stand for sciworld, alfworld and webshop."""
import json
import os
import subprocess
import sys

import pytest

from configs import alfworld, sciworld, webshop
from cope_jax.plan import programs, targets
from cope_jax.run import run_config
from launch.experiments import fit_table
from tests.paths import ROOT
from tests.plan.test_plan import TINY, _records, _run

TINY_MODEL = dict(init="random", preset="", family="qwen3", hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512)


def test_sciworld_alfworld_and_webshop_plan_to_the_same_programs():
    """Each program of the three paper configs lowers to the same text (on a small model: the
    paper's row length, window, batch and mesh; only the architecture is smaller), but the first
    turn's prompt prefill, which is ALFWorld's over its shorter prompts (1,024 tokens, not 2,048):
    no larger than the others', so sciworld's stands for it."""
    target = targets.get_target("v5p-8")
    devices = targets.devices(target)
    lowered = {}
    for module in (sciworld, alfworld, webshop):
        c = module.get_config("cope")
        c.model.update(TINY_MODEL)
        cfg = run_config.random_model_config(c, None)
        _, progs = programs.run_programs(c, cfg, devices, (1, 4, 1))
        lowered[module.__name__] = {p.name: (p.shape, p.tokens, p.loops, p.lower().as_text()) for p in progs}
    first, *rest = lowered.values()
    assert set(first) == {"train_step", "logprobs", *programs.SAMPLER_PROGRAMS}
    for other in rest:
        for name in first:
            if name == "prefill@group" and other is lowered[alfworld.__name__]:
                assert (other[name][0], first[name][0]) == ("16 x 512 into 1024", "16 x 512 into 2048")
                continue
            assert other[name] == first[name], name


def test_a_cell_reads_as_the_table_says(tmp_path):
    """describe() on a real plan's records: one that fits, and the same plan on a GPU whose usable
    memory is made too small (it names the program, the mesh and the largest part)."""
    rc, out, err = _run("--config=configs/demo.py", "--topology=1xH100", "--json", "--nocost", *TINY,
                        "--sampler_rows=auto")
    assert rc == 0, err
    records = _records(out)
    text = fit_table.describe(records, searched_rows=True)
    worst = max(records[:-1], key=lambda r: r["total"])
    assert text == f"fits, mesh 1x1x1, 8 sampler rows ({worst['program']} 0 of 59 GiB)"
    rc, out, err = _run("--config=configs/demo.py", "--topology=1xH100", "--json", "--nocost", *TINY,
                        env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.0000001"})
    assert rc == 2, err
    text = fit_table.describe(_records(out), searched_rows=False)
    assert text.startswith("**no** (mesh 1x1x1: ") and "largest part " in text and "sampler rows" not in text


def test_render_shows_what_is_planned_and_names_the_rest(tmp_path):
    cell = fit_table.Cell("tau2", "v6e-8", "lora64")
    assert cell.args()[:2] == ["--config=configs/tau2.py:cope", "--topology=v6e-8"]
    assert "--sampler_rows=auto" in cell.args() and "--config.train.lora.rank=64" in cell.args()
    assert "--sampler_rows=auto" not in fit_table.Cell("tau2", "v5p-32", "full").args()
    assert "--sampler_rows=auto" in fit_table.Cell("appworld", "v5p-32", "full").args()
    names = [c.name for c in fit_table.cells()]
    assert len(names) == len(set(names)) == 3 * 4 * 2 + 3 * 6
    summary = dict(summary=True, fits=True, mesh=[1, 8, 1], sampler_rows=32)
    step = dict(program="train_step", total=20 * 2**30, usable_bytes=31.25 * 2**30)
    with open(tmp_path / f"{cell.name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in (step, summary))
    text = fit_table.render(str(tmp_path))
    assert "fits, mesh 1x8x1, 32 sampler rows (train_step 20 of 31 GiB)" in text
    assert text.count("not planned yet") == len(names) - 1
    assert "`sciworld.py:cope`, `alfworld.py:cope`, `webshop.py:cope`" in text
    crashed = fit_table.Cell("tau2", "tpu7x-8", "full")
    with open(tmp_path / f"{crashed.name}.err", "w") as f:
        f.write("LLVM ERROR: Not enough space for spill\nFatal Python error: Aborted\n  File x.py\n")
    text = fit_table.render(str(tmp_path))
    assert "planner failed: `LLVM ERROR: Not enough space for spill`" in text
    assert text.count("not planned yet") == len(names) - 2


def test_the_docs_show_the_committed_records():
    """docs/scaling.md's fit-table block is the table of docs/fit's records, and no cell of it was
    left unplanned."""
    tables = fit_table.render(os.path.join(ROOT, "docs", "fit"))
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    assert fit_table.splice(doc, tables) == doc
    assert f"{fit_table.BEGIN}\n{tables}{fit_table.END}" in doc
    assert "not planned yet" not in tables
    with pytest.raises(ValueError, match="expected one '<!-- launch.experiments.fit_table: begin -->' line"):
        fit_table.splice("no markers", tables)


def test_a_bad_cell_filter_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.experiments.fit_table", f"--out={tmp_path}", "--cells=nothing-here"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "fit_table: error: --cells=nothing-here: no cell matches; cells are named like sciworld-lora64-v5e-8"]
    assert os.listdir(tmp_path) == []
