"""Run metrics: episode summaries (Score, Succ, per family, Avg@k), the metrics log, and plots.

Definitions (paper appendix B.4, method §5.4): Score = mean raw environment score, Succ = mean success label Y,
both per sub-task family and overall. The overall is count-weighted over all episodes, except for
families that declare `overall = "family-mean"` (tau2: the unweighted mean of its domains). With k
samples per task, Avg@k is the mean over all k x tasks episodes (= the mean of per-sample means).

`MetricsLog` appends one JSON line per record to `<workdir>/metrics.jsonl` (the source of the
plots and of the resume test) and mirrors scalars to TensorBoard event files. Only process 0 writes.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
from absl import logging

from cope_jax.rollout.trajectory import Trajectory
from cope_jax.run import files


def summarize(trajectories: Sequence[Trajectory], *, overall: str = "count-weighted") -> dict[str, Any]:
    """{'score', 'succ', 'episodes', 'families': {name: {...}}, ...} of a set of episodes."""
    by_family: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_family[t.metadata.get("task_family", t.family)].append(t)
    fams = {name: {"score": float(np.mean([t.score for t in ts])),
                   "succ": float(np.mean([t.success for t in ts])), "episodes": len(ts)}
            for name, ts in sorted(by_family.items())}
    if not trajectories:
        return {"score": math.nan, "succ": math.nan, "episodes": 0, "families": {}}
    if overall == "family-mean":
        score = float(np.mean([f["score"] for f in fams.values()]))
        succ = float(np.mean([f["succ"] for f in fams.values()]))
    else:
        score = float(np.mean([t.score for t in trajectories]))
        succ = float(np.mean([t.success for t in trajectories]))
    reasons: dict[str, int] = defaultdict(int)
    for t in trajectories:
        reasons[t.finish_reason] += 1
    return {"score": score, "succ": succ, "episodes": len(trajectories), "families": fams,
            "overall": overall, "finish_reasons": dict(reasons),
            "mean_steps": float(np.mean([t.num_steps for t in trajectories]))}


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """A table of Score / Succ per family for each named result (e.g. 'warmstart', 'final')."""
    families = sorted({f for r in results.values() for f in r.get("families", {})})
    head = "| run | " + " | ".join(f"{f} succ" for f in families) + " | Score | Succ | episodes |"
    lines = [head, "|" + " --- |" * (len(families) + 4)]
    for name, r in results.items():
        cells = [f"{100 * r['families'][f]['succ']:.1f}" if f in r["families"] else "-" for f in families]
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {r['score']:.3f} | {100 * r['succ']:.1f} | {r['episodes']} |")
    return "\n".join(lines) + "\n"


def success_table(results: dict[str, dict[str, Any]]) -> str:
    """Test success per family (rows) for each named result (columns), each with its binomial
    standard error over the result's episodes: what a reader compares across training."""
    families = sorted({f for r in results.values() for f in r.get("families", {})})
    lines = ["| family | " + " | ".join(results) + " |", "|" + " --- |" * (len(results) + 1)]
    for f in families + ["overall"]:
        cells = []
        for r in results.values():
            cell = r if f == "overall" else r.get("families", {}).get(f)
            cells.append("-" if cell is None else _with_error(cell["succ"], cell.get("episodes")))
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def success_screen(report: dict[str, Any]) -> str:
    """An eval.json report's results as the success table, in step order, columns named for a
    reader (the evaluation binary's last screen)."""
    def step(name: str) -> int:
        return int(name.rsplit("_", 1)[1])

    def label(name: str) -> str:
        if name.startswith("checkpoint"):
            return f"checkpoint {step(name)} (this evaluation)"
        return "start (step 0)" if step(name) == 0 else f"step {step(name)}"

    order = sorted(report["results"], key=lambda k: (k.startswith("checkpoint"), step(k)))
    table = success_table({label(k): report["results"][k] for k in order})
    return (f"Test success, {report['split']} split, {report['samples']} sample(s) per task "
            f"(± binomial standard error):\n{table}")


def _with_error(p: float, n: int | None) -> str:
    if not n:
        return f"{p:.3f}"
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"


class MetricsLog:
    """metrics.jsonl + TensorBoard scalars under `workdir` (process 0 only). Nothing is touched
    before the first record: a job refused early (`launch.eval` on a damaged checkpoint) leaves the
    workdir as it was."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.workdir = workdir
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.enabled = enabled
        self._tb = None

    def _open(self) -> None:
        from tensorboardX import SummaryWriter

        os.makedirs(self.workdir, exist_ok=True)
        _cut_torn_tail(self.path)  # or the next record would be glued to it
        self._tb = SummaryWriter(os.path.join(self.workdir, "tensorboard"))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._tb is None:
            self._open()
        record = {"kind": kind, "step": int(step), **values}
        line = (json.dumps(record, sort_keys=True, default=float) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of the whole record: a kill leaves it whole or torn at the end
        finally:
            os.close(fd)
        for name, v in values.items():
            if isinstance(v, (int, float, np.floating, np.integer)) and math.isfinite(float(v)):
                self._tb.add_scalar(f"{kind}/{name}", float(v), int(step))
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_log(workdir: str) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl`. A torn last record (a kill or power loss mid-append)
    is left out with one warning; a damaged record before the last is an error naming its line."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if any(rest.strip() for rest in lines[i + 1:]):
                raise ValueError(f"{path}: line {i + 1} is not a JSON record (a damaged log; the records after "
                                 "it are intact: remove that line to go on)") from None
            _warn_torn(path, i + 1)
    return records


def _warn_torn(path: str, line: int) -> None:
    logging.warning("%s: its last record (line %d) is torn (the run was killed mid-write): left out", path, line)


def _cut_torn_tail(path: str) -> None:
    """Removes an unfinished last line (no newline at its end) from an append-only log."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        _warn_torn(path, data[:keep].count(b"\n") + 1)
        f.truncate(keep)


def latest_records(records: Sequence[dict], kind: str) -> dict[int, dict]:
    """{step: record} of one kind; a step logged twice (a resumed run) keeps the newest record."""
    return {r["step"]: r for r in records if r["kind"] == kind}


def plot_learning_curves(workdir: str, path: str | None = None) -> str:
    """PNG of success and reward over steps: training rollouts and evaluation points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(workdir)
    train = latest_records(records, "train")
    evals = latest_records(records, "eval")
    path = path or os.path.join(workdir, "learning_curves.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "succ", "success rate"), (axes[1], "score", "reward (raw score)")):
        steps = sorted(train)
        ax.plot(steps, [train[s].get(key, math.nan) for s in steps], ".-", alpha=0.6, label="train rollouts")
        esteps = sorted(evals)
        ax.plot(esteps, [evals[s].get(key, math.nan) for s in esteps], "o-", lw=2, label="eval (test split)")
        if key == "succ":
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.normpath(workdir)))
    fig.tight_layout()
    with files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


def write_eval_report(workdir: str, results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, str]:
    """eval.json, eval.md (a Score/Succ table) and learning_curves.png in `workdir`."""
    paths = {"json": os.path.join(workdir, "eval.json"), "markdown": os.path.join(workdir, "eval.md")}
    files.write_json(paths["json"], {**meta, "results": results}, indent=2, sort_keys=True)
    files.write_text(paths["markdown"], f"# Evaluation: {meta.get('config', '')}\n\n"
                     + ", ".join(f"{k}: {v}" for k, v in meta.items() if k != "config") + "\n\n"
                     + markdown_table(results)
                     + "\nTest success (± its binomial standard error over the episodes):\n\n" + success_table(results))
    paths["plot"] = plot_learning_curves(workdir)
    return paths
