"""Learning benchmark: CoPE vs GRPO on the built-in environment, from one shared warm start.

  python -m launch.bench --suite=learning [--seeds=3] [--learning_methods=cope,grpo]
                                          [--learning_config=configs/demo.py] [--learning_steps=N]
                                          [--learning_eval_every=5] [--learning_eval_tasks=N]
                                          [--learning_warmstart_steps=N] [--learning_workdir=DIR]

The config's supervised warm start runs once, with the config's own seed (the demo's seed is chosen
so that its warm start picks up the recovery rule); every (method, seed) run then starts RL from a
copy of that checkpoint, with RL seeds config seed + 0, 1, ..., so the methods differ only in their
objective and the seed only in the rollout randomness, task order and evaluation samples. Each run
evaluates the test split every `eval_every` steps.
Prints one JSON line per evaluation point, one summary line per run, and per method the mean curve
and `steps_to_reference`: the first evaluation step at which the method's mean test success reaches
the reference method's (GRPO's) final mean success. Writes `learning.png` (mean and per-seed curves).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile

from absl import flags

from cope_jax import metrics as metrics_lib
from cope_jax.trainer import WARMSTART_DIR

flags.DEFINE_integer("seeds", 3, "RL seeds per method.")
flags.DEFINE_list("learning_methods", ["cope", "grpo"], "Methods to compare; the last one is the reference.")
flags.DEFINE_string("learning_config", "configs/demo.py", "Config file (its get_config(method)).")
flags.DEFINE_integer("learning_steps", 0, "RL steps per run (0: the config's train.steps).")
flags.DEFINE_integer("learning_eval_every", 5, "Evaluate the test split every this many steps.")
flags.DEFINE_integer("learning_eval_tasks", 0, "Test tasks per evaluation (0: the whole split).")
flags.DEFINE_integer("learning_warmstart_steps", -1, "Warm-start steps (-1: the config's).")
flags.DEFINE_string("learning_workdir", "", "Where runs go (default: a temporary directory, removed).")
FLAGS = flags.FLAGS


def _config(method: str, seed_offset: int = 0):
    spec = importlib.util.spec_from_file_location("learning_config", FLAGS.learning_config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(method)
    c.seed += seed_offset
    if FLAGS.learning_steps:
        c.train.steps = FLAGS.learning_steps
    c.eval.every = FLAGS.learning_eval_every
    c.eval.tasks = FLAGS.learning_eval_tasks
    if FLAGS.learning_warmstart_steps >= 0:
        c.warmstart.steps = FLAGS.learning_warmstart_steps
    c.checkpoint.every = c.train.steps  # only the final checkpoint: the bench never resumes
    return c


def _curve(workdir: str) -> dict[int, float]:
    evals = metrics_lib.latest_records(metrics_lib.read_log(workdir), "eval")
    return {step: float(r["succ"]) for step, r in sorted(evals.items())}


def _plot(curves: dict[str, dict[int, dict[int, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, by_seed) in enumerate(curves.items()):
        color = f"C{i}"
        for curve in by_seed.values():
            ax.plot(list(curve), list(curve.values()), "-", color=color, alpha=0.25)
        mean = _mean_curve(by_seed)
        ax.plot(list(mean), list(mean.values()), "o-", color=color, lw=2, label=f"{method} (mean of {len(by_seed)})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("test success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("built-in environment, same warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean_curve(by_seed: dict[int, dict[int, float]]) -> dict[int, float]:
    steps = sorted(set.intersection(*(set(c) for c in by_seed.values())))
    return {s: sum(c[s] for c in by_seed.values()) / len(by_seed) for s in steps}


def compare(curves: dict[str, dict[int, dict[int, float]]], reference: str) -> list[dict]:
    """Per method: the mean curve over seeds, its final value and `steps_to_reference`, the first RL
    step (> 0) whose mean success reaches the reference method's final mean success (None: never)."""
    target = list(_mean_curve(curves[reference]).values())[-1]
    out = []
    for method, by_seed in curves.items():
        mean = _mean_curve(by_seed)
        reached = [s for s, v in mean.items() if s > 0 and v >= target - 1e-9]
        out.append({"method": method, "seeds": len(by_seed),
                    "mean_curve": {str(s): round(v, 4) for s, v in mean.items()},
                    "final_mean_succ": round(list(mean.values())[-1], 4), "reference": reference,
                    "reference_final_mean_succ": round(target, 4),
                    "steps_to_reference": reached[0] if reached else None})
    return out


def _emit(record: dict) -> None:
    print(json.dumps({"suite": "learning"} | record), flush=True)


def run(argv: list[str]) -> None:
    del argv
    from cope_jax.runs import train_run

    root = FLAGS.learning_workdir or tempfile.mkdtemp(prefix="cope_learning_")
    os.makedirs(root, exist_ok=True)
    methods = list(FLAGS.learning_methods)
    reference = methods[-1]
    try:
        # One warm start, shared: a zero-step run of the reference method writes it.
        warm = os.path.join(root, "warmstart_run")
        c = _config(reference)
        c.train.steps, c.eval.every = 0, 0  # every RL run evaluates its own step 0
        train_run(c, warm, progress=False)
        curves: dict[str, dict[int, dict[int, float]]] = {}
        for method in methods:
            for seed in range(FLAGS.seeds):
                workdir = os.path.join(root, f"{method}_seed{seed}")
                if not os.path.isdir(os.path.join(workdir, WARMSTART_DIR)):
                    shutil.copytree(os.path.join(warm, WARMSTART_DIR), os.path.join(workdir, WARMSTART_DIR))
                config = _config(method, seed)
                summary = train_run(config, workdir, progress=False)
                curve = _curve(workdir)
                curves.setdefault(method, {})[seed] = curve
                for step, succ in curve.items():
                    _emit({"method": method, "seed": config.seed, "step": step, "succ": succ})
                _emit({"method": method, "seed": config.seed, "final_succ": summary.get("succ"),
                       "start_succ": curve.get(0), "workdir": workdir if FLAGS.learning_workdir else None})
        for record in compare(curves, reference):
            _emit(record)
        png = os.path.join(FLAGS.learning_workdir or os.getcwd(), "learning.png")
        _plot(curves, png)
        _emit({"plot": os.path.basename(png)})
    finally:
        if not FLAGS.learning_workdir:
            shutil.rmtree(root, ignore_errors=True)
        print("learning bench done", file=sys.stderr)
