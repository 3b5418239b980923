"""python -m launch.experiments.fit_table --out=DIR [--cells=SUBSTRING,...] [--render_only] [--force]

The README's fit table, reproducible: plans every cell (a paper config on a target, full fine-tuning
or LoRA rank 64) with `launch.plan --mesh=auto --nocost --json`, one process per cell, and writes
`DIR/<cell>.jsonl` (the planner's records) and `DIR/table.md` (the tables, from whatever cells have a
record), and the same tables into the marked block of `--doc` (docs/scaling.md). A cell already
planned is kept unless --force: an interrupted run resumes where it stopped (a 7B plan takes
minutes to half an hour on two cores). Cells on one host, and AppWorld's everywhere, plan with
`--sampler_rows=auto`: the most sampler rows per host that fit.

alfworld and webshop plan to the programs of sciworld (same model, row length, window, turn cap
and batch: `tests/plan/test_fit_table.py` checks the fields), so one row stands for the three.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from absl import flags

from cope_jax.run import files
from launch import cli
from models.config import ConfigError

flags.DEFINE_string("out", "docs/fit", "Directory of the cells' records and table.md.")
flags.DEFINE_list("cells", [], "Plan only the cells whose name contains one of these (e.g. lora64-v6e-8).")
flags.DEFINE_bool("render_only", False, "Write table.md (and --doc) from the records there; plan nothing.")
flags.DEFINE_string("doc", "docs/scaling.md", "A document whose fit-table block is replaced by the tables ('' for none).")
flags.DEFINE_bool("force", False, "Plan the chosen cells again even where a record exists.")
FLAGS = flags.FLAGS

CONFIGS = {"sciworld": "configs/sciworld.py:cope", "tau2": "configs/tau2.py:cope",
           "appworld": "configs/appworld.py:cope"}
SHARED_ROWS = {"sciworld": "`sciworld.py:cope`, `alfworld.py:cope`, `webshop.py:cope`"}
PODS = ("v4-32", "v5e-64", "v5p-32", "v6e-32", "8xH100", "tpu7x-8")
ONE_HOST = ("v5e-8", "v6e-8", "v5p-8", "1xH100")
TUNINGS = {"full": (), "lora64": ("--config.train.lora.rank=64",)}
GIB = float(1 << 30)
# cells planned on a given mesh instead of the search: the TPU compiler of the pinned jax aborts
# (LLVM: "Not enough space for TILESPMEM spill") on tau2's train step at 1x8x1, the search's first
MESHES = {"tau2-full-tpu7x-8": "1,4,2"}
BEGIN, END = "<!-- launch.experiments.fit_table: begin -->", "<!-- launch.experiments.fit_table: end -->"


@dataclasses.dataclass(frozen=True)
class Cell:
    env: str
    topology: str
    tuning: str  # a key of TUNINGS

    @property
    def name(self) -> str:
        return f"{self.env}-{self.tuning}-{self.topology}"

    @property
    def searches_rows(self) -> bool:
        return self.topology in ONE_HOST or self.env == "appworld"

    def args(self) -> list[str]:
        rows = ["--sampler_rows=auto"] if self.searches_rows else []
        return [f"--config={CONFIGS[self.env]}", f"--topology={self.topology}",
                f"--mesh={MESHES.get(self.name, 'auto')}", "--nocost", "--json", *rows, *TUNINGS[self.tuning]]


def cells() -> list[Cell]:
    """Every cell, the one-host block first (LoRA, then full fine-tuning), then the pods."""
    one_host = [Cell(e, t, tuning) for tuning in ("lora64", "full") for e in CONFIGS for t in ONE_HOST]
    return one_host + [Cell(e, t, "full") for e in CONFIGS for t in PODS]


def plan_cell(cell: Cell, out: str) -> dict | None:
    """Runs the planner for one cell; its summary record, or None when it failed (stderr kept)."""
    proc = subprocess.run([sys.executable, "-m", "launch.plan", *cell.args()], capture_output=True, text=True)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, 2) or not records or not records[-1].get("summary"):
        # the stack frames name this machine's paths: the error lines are what the record keeps
        said = [line for line in proc.stderr.splitlines() if not line.startswith("  File ")]
        files.write_text(os.path.join(out, cell.name + ".err"), "\n".join(said) + "\n")
        return None
    files.write_text(os.path.join(out, cell.name + ".jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    if os.path.exists(os.path.join(out, cell.name + ".err")):
        os.remove(os.path.join(out, cell.name + ".err"))
    return records[-1]


def read_cell(cell: Cell, out: str) -> list[dict] | None:
    path = os.path.join(out, cell.name + ".jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_failure(cell: Cell, out: str) -> str | None:
    """The line that says why the cell's last plan failed (a compiler abort, the planner's error),
    or None where it never failed."""
    path = os.path.join(out, cell.name + ".err")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    said = [line for line in lines if "ERROR" in line or "error:" in line] or lines[-1:] or ["no output"]
    return f"`{said[0][:120]}`"


def describe(records: list[dict], searched_rows: bool) -> str:
    """One cell's text: 'fits, mesh 1x8x1 (train_step 26 of 31 GiB)', with the sampler rows found
    where they were searched; or '**no** (mesh 1x1x1: train_step 166 of 59 GiB, largest part
    optimizer 57)'."""
    *programs, summary = records
    worst = max(programs, key=lambda r: r["total"] / r["usable_bytes"])
    mesh = "x".join(map(str, summary["mesh"]))
    n = summary["sampler_rows"]
    rows = f", {n} sampler row{'s' * (n != 1)}" if searched_rows else ""
    used = f"{worst['program']} {worst['total'] / GIB:.0f} of {worst['usable_bytes'] / GIB:.0f} GiB"
    if summary["fits"]:
        return f"fits, mesh {mesh}{rows} ({used})"
    part, size = worst["largest_part"]
    return f"**no** (mesh {mesh}{rows}: {used}, largest part {part} {size / GIB:.0f})"


def render(out: str) -> str:
    """The pods table and the one-host table (full and LoRA) from the cells planned in `out`."""
    def cell_text(cell):
        records = read_cell(cell, out)
        if records is not None:
            return describe(records, cell.searches_rows)
        failure = read_failure(cell, out)
        return "not planned yet" if failure is None else f"planner failed: {failure}"

    def table(columns, rows):
        head = ["config", *columns]
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join([label, *(cell_text(c) for c in row)]) + " |" for label, row in rows]
        return "\n".join(lines)

    label = lambda e: SHARED_ROWS.get(e, f"`{e}.py:cope`")
    pods = table(PODS, [(label(e), [Cell(e, t, "full") for t in PODS]) for e in CONFIGS])
    one_host = table(ONE_HOST, [(f"{label(e)}, {tuning}", [Cell(e, t, tuning) for t in ONE_HOST])
                                for tuning in TUNINGS for e in CONFIGS])
    return (f"## Pods and GPU hosts (full fine-tuning)\n\n{pods}\n\n## One host (full fine-tuning and "
            f"LoRA rank 64)\n\n{one_host}\n")


def main(argv):
    chosen = [c for c in cells() if not FLAGS.cells or any(s in c.name for s in FLAGS.cells)]
    if FLAGS.cells and not chosen:
        raise ConfigError(f"--cells={','.join(FLAGS.cells)}: no cell matches; cells are named like "
                         f"{cells()[0].name}")
    os.makedirs(FLAGS.out, exist_ok=True)
    for cell in [] if FLAGS.render_only else chosen:
        if read_cell(cell, FLAGS.out) is not None and not FLAGS.force:
            continue
        print(f"planning {cell.name} ...", file=sys.stderr, flush=True)
        summary = plan_cell(cell, FLAGS.out)
        print(f"  {cell.name}: " + ("failed (see its .err)" if summary is None
                                   else describe(read_cell(cell, FLAGS.out), cell.searches_rows)), flush=True)
    text = render(FLAGS.out)
    files.write_text(os.path.join(FLAGS.out, "table.md"), text)
    if FLAGS.doc:
        with open(FLAGS.doc) as f:
            files.write_text(FLAGS.doc, splice(f.read(), text, FLAGS.doc))
    print(text)


def splice(doc: str, tables: str, name: str = "the document") -> str:
    """`doc` with the text between its BEGIN and END markers replaced by `tables`."""
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise ConfigError(f"{name}: expected one '{BEGIN}' line and one '{END}' after it")
    head, rest = doc.split(BEGIN)
    return f"{head}{BEGIN}\n{tables}{END}{rest.split(END)[1]}"


if __name__ == "__main__":
    cli.run(main)
