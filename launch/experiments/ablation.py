"""The paper's ablations (section 8) on one shared warm start: `python -m launch.bench --suite=ablation`.

  python -m launch.bench --suite=ablation [--ablation_dir=runs/ablation] [--ablation_arms=grpo,cope_k2,...]
      [--ablation_seeds=0,1,2] [--ablation_config=configs/demo.py] [--ablation_steps=N]
      [--ablation_eval_every=5] [--ablation_eval_tasks=N] [--ablation_set=section.field=value ...]
      [--ablation_report_only]

Arms (`ARMS`): GRPO; CoPE at K in {0, 1, 2, 4}; lambda in {1e-4, 1e-3, 1e-2, 1e-1} at K = 2; CoPE
without group normalization; `sft_success`; `cope_k0` with the invalid-action filter; CoPE with
`af_mode=sequential`. Each arm is the config's method with one field changed, nothing else: one warm
start (written once under the sweep directory, by the config's own seed), one RL setting, RL seeds
config seed + s. Arms whose settings coincide (the config's lambda is one of the sweep's) run once
per sweep directory, their results shared; so is the evaluation at step 0 (the same starting policy,
evaluated with the seed's key), logged once per seed and reused by the seed's other runs. A config
without a warm start (`warmstart.steps` 0, the paper configs) starts every arm from its `model.path`.
The arms about the forecasting term's weight (lambda, K = 2, group normalization) report its and the
policy term's own gradient norms (`train.grad_norm_terms`, `Arm.term_norms`); every arm the total.

Resumable and shardable: each (arm, seed) run lives in `<dir>/<arm>_seed<s>/` and resumes from its
checkpoints; a finished one writes `<dir>/results/<arm>_seed<s>.jsonl` (its evaluation points and
step records, tagged with arm, seed and the warm start's fingerprint) and is skipped afterwards;
results of another warm start are refused (one written on another machine can differ). Several
hosts sharing the directory can run disjoint `--ablation_arms` / `--ablation_seeds` after one of
them has written the warm start (`--ablation_arms=` with no arm does only that). The report
(`--ablation_report_only` reads the results without running anything) prints one JSON line per arm
and writes `ablation.md` (the table: final success, its difference from GRPO paired by seed, steps
to GRPO's final success, gradient norms) and `ablation.png` (mean test success per arm with a band
of one standard error, one panel per ablation as the paper's Figure 8) to the sweep directory; every
number in them is recomputed from the results files.

On a real benchmark: `--ablation_config=configs/sciworld.py --ablation_set=model.path=ckpt/qwen25-7b`
(any `section.field=value` the config has, for every arm), one host per arm (`--ablation_arms=cope_k2`)
on a shared `--ablation_dir`; the paper configs have no warm start, every arm starts from the model.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import shutil

import jax
import ml_collections
import numpy as np
from absl import flags

from cope_jax.run import metrics as metrics_lib
from models.config import ConfigError

flags.DEFINE_string("ablation_dir", "runs/ablation", "Sweep directory (runs, results, report).")
flags.DEFINE_list("ablation_arms", None, "Arms to run (default: all of ARMS); empty: only the warm start.")
flags.DEFINE_list("ablation_seeds", ["0", "1", "2"], "RL seeds (offsets to the config's seed).")
flags.DEFINE_string("ablation_config", "configs/demo.py", "Config file (its get_config(method)).")
flags.DEFINE_integer("ablation_steps", 0, "RL steps per run (0: the config's train.steps).")
flags.DEFINE_integer("ablation_eval_every", 5, "Evaluate the test split every this many steps.")
flags.DEFINE_integer("ablation_eval_tasks", 0, "Test tasks per evaluation (0: the whole split).")
flags.DEFINE_bool("ablation_report_only", False, "Only report the results already in --ablation_dir.")
flags.DEFINE_multi_string("ablation_set", [], "section.field=value for every arm before its own change, "
                          "e.g. model.path=ckpt/qwen25-7b (repeatable).")
FLAGS = flags.FLAGS

REFERENCE = "grpo"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    method: str
    overrides: tuple = ()  # ((config field, value), ...): the one setting this arm changes
    # log the policy and forecasting terms' own gradient norms (`train.grad_norm_terms`): one more
    # pass over the rows (the policy term's gradient is the total minus the forecasting term's), so
    # only in the arms about the forecasting term's weight (lambda, K = 2 which is lambda 1e-3 on the
    # demo, group normalization); every arm logs the total
    term_norms: bool = False


ARMS = [Arm("grpo", "grpo")] + [
    Arm(f"cope_k{k}", "cope", (("train.horizon", k),), term_norms=k == 2) for k in (0, 1, 2, 4)] + [
    Arm(f"cope_lambda_{lam:g}", "cope", (("train.horizon", 2), ("train.af_coef", lam)), term_norms=True)
    for lam in (1e-4, 1e-3, 1e-2, 1e-1)] + [
    Arm("cope_no_group_norm", "cope", (("train.af_group_norm", False),), term_norms=True),
    Arm("sft_success", "sft_success"),
    Arm("cope_k0_filtered", "cope_k0", (("train.skip_invalid", True),)),
    Arm("cope_sequential", "cope", (("train.af_mode", "sequential"),)),
]
ARMS_BY_NAME = {a.name: a for a in ARMS}
# the figure's panels, as the paper's Figure 8 groups them; each starts with the reference arm
PANELS = {
    "forecasting horizon K": ("grpo", "cope_k0", "cope_k1", "cope_k2", "cope_k4"),
    "lambda at K = 2": ("grpo", "cope_lambda_0.0001", "cope_lambda_0.001", "cope_lambda_0.01", "cope_lambda_0.1"),
    "group normalization, af mode": ("grpo", "cope_k2", "cope_no_group_norm", "cope_sequential"),
    "delay-0 targets": ("grpo", "cope_k2", "cope_k0", "cope_k0_filtered", "sft_success"),
}


def arm_config(arm: Arm, seed: int):
    """The config of one (arm, seed) run: the sweep's shared settings, then the arm's one change."""
    if not os.path.isfile(FLAGS.ablation_config):
        raise ConfigError(f"--ablation_config={FLAGS.ablation_config}: no such config file (e.g. configs/demo.py)")
    spec = importlib.util.spec_from_file_location("ablation_config", FLAGS.ablation_config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(arm.method)
    c.seed += seed
    if FLAGS.ablation_steps:
        c.train.steps = FLAGS.ablation_steps
    c.eval.update(every=FLAGS.ablation_eval_every, tasks=FLAGS.ablation_eval_tasks)
    c.checkpoint.every = FLAGS.ablation_eval_every  # a killed sweep loses at most this many steps
    for setting in FLAGS.ablation_set:
        _set(c, *_parse_setting(c, setting))
    for field, value in arm.overrides:
        _set(c, field, value)
    c.train.grad_norm_terms = ("pg", "af") if arm.term_norms else ()
    return c


def _parse_setting(c, setting: str) -> tuple[str, object]:
    """'section.field=value' -> (field path, value typed like the field's current value)."""
    field, sep, text = setting.partition("=")
    section, _, name = field.partition(".")
    if not sep or section not in c or not isinstance(c[section], ml_collections.ConfigDict) or name not in c[section]:
        raise ConfigError(f"--ablation_set={setting}: expected section.field=value with a field of the config "
                         f"(e.g. model.path=ckpt/qwen25-7b)")
    if isinstance(c[section][name], str):
        return field, text
    try:
        return field, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--ablation_set={setting}: {text!r} is not a value for {field} "
                         f"(now {c[section][name]!r})") from None


def _set(c, field: str, value) -> None:
    section, name = field.split(".")
    try:
        c[section][name] = value
    except TypeError as e:
        raise ConfigError(f"{field}={value!r}: {e}") from None


def _settings(c) -> str:
    """What a run computes (seed included), to spot arms that are the same run."""
    return json.dumps(json.loads(c.to_json()), sort_keys=True)


# -- running -----------------------------------------------------------------------------------------
def _warmstart(root: str) -> str | None:
    """The shared warm start (a zero-step run of the reference arm), written once; None for a config
    without one (every arm starts from the config's own checkpoint, `model.path`)."""
    from cope_jax.stages.entry import train_run
    from cope_jax.stages.warmstart import WARMSTART_DIR

    c = arm_config(ARMS_BY_NAME[REFERENCE], 0)
    if c.warmstart.steps <= 0:
        return None
    warm = os.path.join(root, "warmstart_run")
    if not os.path.isdir(os.path.join(warm, WARMSTART_DIR)):
        c.train.steps, c.eval.every = 0, 0  # every RL run evaluates its own step 0
        train_run(c, warm, progress=False)
    return os.path.join(warm, WARMSTART_DIR)


def fingerprint(warm: str | None) -> str:
    """The warm start's identity: sha256 of its parameters (path, dtype, shape, values) and of the
    tokenizer its run trained, 16 hex digits; '' without one. Equal only for the same policy,
    whichever machine wrote it."""
    if warm is None:
        return ""
    import orbax.checkpoint as ocp
    from models import orbax_io

    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(orbax_io.params_dir(warm))
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    tokenizer = _warm_tokenizer(warm)
    if os.path.isfile(tokenizer):  # a tokenizer trained with the warm start is part of the policy
        with open(tokenizer, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _warm_tokenizer(warm: str) -> str:
    """Where the warm start's run keeps its own trained tokenizer (configs with `sentencepiece:N`)."""
    from cope_jax.run.build import TOKENIZER_FILE

    return os.path.join(os.path.dirname(warm), TOKENIZER_FILE)


def _one_start(records: list[dict], where: str) -> None:
    """Refuses records of more than one warm start (e.g. a results directory copied from a machine
    whose warm start came out different): their arms did not start together."""
    starts = sorted({r.get("warmstart", "") for r in records})
    if len(starts) > 1:
        raise ConfigError(f"{where}: results from different warm starts ({', '.join(repr(s) for s in starts)}); "
                         f"every arm must start from one (keep one warm start's results per directory)")


def _start_key(c) -> str:
    """What the evaluation at step 0 depends on: everything but the RL settings (every arm starts
    from the same policy and evaluates it with the same seed and settings)."""
    settings = json.loads(c.to_json())
    del settings["train"], settings["method"]
    return json.dumps(settings, sort_keys=True)


def _run(arm: Arm, seed: int, root: str, warm: str | None, same_as: dict, started: dict, start: str) -> None:
    """One (arm, seed) run, resumed if it was interrupted; its results file marks it done.
    `same_as`: settings -> the workdir of the run that computed them; `started`: start key -> the
    evaluation record at step 0 some run of this sweep logged (the others reuse it); `start`: the
    warm start's fingerprint, written into every result."""
    from cope_jax.stages.entry import train_run
    from cope_jax.stages.warmstart import WARMSTART_DIR

    results = os.path.join(root, "results", f"{arm.name}_seed{seed}.jsonl")
    config = arm_config(arm, seed)
    workdir = os.path.join(root, f"{arm.name}_seed{seed}")
    if os.path.isfile(results):
        return
    key = _settings(config)
    if key in same_as:  # another arm of this sweep is this very run: share its records
        _write_results(results, arm, seed, same_as[key], start)
        return
    if warm is not None and not os.path.isdir(os.path.join(workdir, WARMSTART_DIR)):
        shutil.copytree(warm, os.path.join(workdir, WARMSTART_DIR))
        if os.path.isfile(_warm_tokenizer(warm)):  # the run reads the tokenizer its policy was trained with
            shutil.copy2(_warm_tokenizer(warm), workdir)
    _reuse_start(started, config, workdir)
    train_run(config, workdir, progress=False)
    same_as[key] = workdir
    _remember_start(started, config, workdir)
    _write_results(results, arm, seed, workdir, start)


def _finished(root: str, seeds) -> tuple[dict, dict]:
    """(same_as, started) of the runs this directory finished before (every arm, `seeds`), so an
    invocation shares them whichever arms it runs."""
    same_as, started = {}, {}
    for seed in seeds:
        for arm in ARMS:
            config, workdir = arm_config(arm, seed), os.path.join(root, f"{arm.name}_seed{seed}")
            if (os.path.isfile(os.path.join(root, "results", f"{arm.name}_seed{seed}.jsonl"))
                    and os.path.isfile(os.path.join(workdir, "metrics.jsonl"))):  # run here, not shared
                same_as.setdefault(_settings(config), workdir)
                _remember_start(started, config, workdir)
    return same_as, started


def _remember_start(started: dict, config, workdir: str) -> None:
    record = metrics_lib.latest_records(metrics_lib.read_log(workdir), "eval").get(0)
    if record is not None:
        started.setdefault(_start_key(config), record)


def _reuse_start(started: dict, config, workdir: str) -> None:
    """Logs the step-0 evaluation another run made of the same starting policy, so `train_run`
    skips its own (which would compute the same record again)."""
    record = started.get(_start_key(config))
    if record is None or 0 in metrics_lib.latest_records(metrics_lib.read_log(workdir), "eval"):
        return
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def _write_results(path: str, arm: Arm, seed: int, workdir: str, start: str) -> None:
    """The run's evaluation points and step records, tagged with arm, seed and warm start; written
    whole, then renamed."""
    log = metrics_lib.read_log(workdir)
    lines = [{"arm": arm.name, "seed": seed, "warmstart": start, "kind": kind, "step": step,
              **{k: v for k, v in r.items() if k not in ("kind", "step") and isinstance(v, (int, float))}}
             for kind in ("eval", "train") for step, r in sorted(metrics_lib.latest_records(log, kind).items())]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(path + ".tmp", path)


# -- reporting ---------------------------------------------------------------------------------------
def read_results(root: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(root, "results", "*.jsonl"))):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def curves(records: list[dict]) -> dict[str, dict[int, dict[int, float]]]:
    """{arm: {seed: {step: test success}}} from the evaluation records (the latest per step)."""
    out: dict[str, dict[int, dict[int, float]]] = {}
    for r in records:
        if r["kind"] == "eval":
            out.setdefault(r["arm"], {}).setdefault(r["seed"], {})[r["step"]] = float(r["succ"])
    order = {a.name: i for i, a in enumerate(ARMS)}  # the table's and figure's order: ARMS'
    return {arm: dict(sorted(out[arm].items())) for arm in sorted(out, key=lambda a: (order.get(a, len(order)), a))}


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def mean_curve(by_seed: dict[int, dict[int, float]]) -> dict[int, tuple[float, float]]:
    """{step: (mean, standard error) over seeds} at the steps every seed evaluated."""
    steps = sorted(set.intersection(*(set(c) for c in by_seed.values())))
    return {s: _mean_se([c[s] for c in by_seed.values()]) for s in steps}


def table(records: list[dict], reference: str = REFERENCE) -> list[dict]:
    """Per arm: final test success (mean and standard error over seeds), the first step whose mean
    success reaches the reference arm's final mean (None: never), the largest gradient norm of any
    step (and of each term's), over the steps every seed evaluated."""
    by_arm = curves(records)
    means = {arm: mean_curve(by_seed) for arm, by_seed in by_arm.items()}
    target = means[reference][max(means[reference])][0] if reference in means else math.inf
    rows = []
    for arm, by_seed in by_arm.items():
        curve = means[arm]
        last = max(curve)
        train = [r for r in records if r["arm"] == arm and r["kind"] == "train"]
        # on the unrounded means; the tolerance absorbs summation order (equal successes, other seeds)
        reached = [s for s, (m, _) in curve.items() if s > 0 and m >= target - 1e-9]
        row = {"arm": arm, "seeds": len(by_seed), "final_step": last,
               "final_succ_mean": round(curve[last][0], 4), "final_succ_se": round(curve[last][1], 4),
               "mean_curve": {str(s): round(m, 4) for s, (m, _) in curve.items()}}
        # the largest optimizer step's norm (`<key>_max`); records from before it was logged hold
        # only each step's mean over its optimizer steps, and the row says which (`grad_norm_of`)
        row["grad_norm_of"] = "optimizer steps" if any("grad_norm_max" in r for r in train) else "step means"
        for key in ("grad_norm", "grad_norm_pg", "grad_norm_af"):
            values = [r.get(f"{key}_max", r[key]) for r in train if key in r]
            row[f"max_{key}"] = round(max(values), 4) if values else None
        row["steps_to_reference"] = reached[0] if reached else None
        row["minus_reference_mean"], row["minus_reference_se"] = _paired(by_seed, by_arm.get(reference, {}), last)
        rows.append(row)
    return rows


def _paired(by_seed: dict, reference: dict, step: int) -> tuple[float | None, float | None]:
    """Final success minus the reference arm's, seed by seed (the two share the warm start, the RL
    seed's rollout keys and its evaluation tasks and keys), as mean and standard error."""
    diffs = [c[step] - reference[s][step] for s, c in by_seed.items() if step in reference.get(s, {})]
    if not diffs:
        return None, None
    mean, se = _mean_se(diffs)
    return round(mean, 4) + 0.0, round(se, 4)  # + 0.0: a sum of rounding errors prints as 0, not -0


def _markdown(rows: list[dict]) -> str:
    def pm(mean, se, seeds, sign=""):
        return "-" if mean is None else f"{mean:{sign}.3f}" + (f" ± {se:.3f}" if seeds > 1 else "")

    def norm(value):
        return "-" if value is None else f"{value:.2f}"

    of = "" if all(r["grad_norm_of"] == "optimizer steps" for r in rows) else " (of step means)"
    head = ("| arm | seeds | final success (mean ± s.e.) | minus GRPO, paired by seed | steps to GRPO's final "
            f"| max grad norm{of} | max pg / af grad norm{of} |\n| --- | --- | --- | --- | --- | --- | --- |\n")
    body = "".join(
        f"| {r['arm']} | {r['seeds']} | {pm(r['final_succ_mean'], r['final_succ_se'], r['seeds'])} | "
        f"{pm(r['minus_reference_mean'], r['minus_reference_se'], r['seeds'], '+')} | "
        f"{r['steps_to_reference'] if r['steps_to_reference'] is not None else 'never'} | "
        f"{norm(r['max_grad_norm'])} | {norm(r['max_grad_norm_pg'])} / {norm(r['max_grad_norm_af'])} |\n"
        for r in rows)
    return head + body


def _plot(records: list[dict], path: str) -> None:
    """One panel per group of `PANELS` (arms outside them in a last one): mean test success per
    arm with a band of one standard error over seeds; one color per arm across panels, the
    reference in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm = curves(records)
    panels = {title: [a for a in arms if a in by_arm] for title, arms in PANELS.items()}
    panels["other arms"] = [a for a in by_arm if not any(a in arms for arms in PANELS.values())]
    panels = {title: arms for title, arms in panels.items() if arms}
    palette = plt.get_cmap("tab20")
    color = {arm: "black" if arm == REFERENCE else palette(i % 20) for i, arm in enumerate(by_arm)}
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (title, arms) in zip(axes.flat, panels.items()):
        for arm in arms:
            curve = mean_curve(by_arm[arm])
            steps, stats = list(curve), list(curve.values())
            mean = [m for m, _ in stats]
            ax.plot(steps, mean, marker="o", color=color[arm], label=f"{arm} ({len(by_arm[arm])} seeds)")
            ax.fill_between(steps, [m - e for m, e in stats], [m + e for m, e in stats], color=color[arm], alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("test success (mean ± s.e.)")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(root: str) -> list[dict]:
    records = read_results(root)
    if not records:
        raise ConfigError(f"{root}: no results yet (results/*.jsonl); run some arms first")
    _one_start(records, root)
    rows = table(records)
    for row in rows:
        print(json.dumps({"suite": "ablation"} | row), flush=True)
    with open(os.path.join(root, "ablation.md"), "w") as f:
        f.write(_markdown(rows))
    _plot(records, os.path.join(root, "ablation.png"))
    return rows


def run(argv: list[str]) -> None:
    del argv
    root = FLAGS.ablation_dir
    if not FLAGS.ablation_report_only:
        names = [a.name for a in ARMS] if FLAGS.ablation_arms is None else FLAGS.ablation_arms
        unknown = [n for n in names if n not in ARMS_BY_NAME]
        if unknown:
            raise ConfigError(f"--ablation_arms: unknown arms {unknown}; expected some of {list(ARMS_BY_NAME)}")
        arm_config(ARMS_BY_NAME[REFERENCE], 0)  # a bad config or --ablation_set refuses before anything is written
        os.makedirs(root, exist_ok=True)
        warm = _warmstart(root)
        start = fingerprint(warm)
        _one_start(read_results(root) + [{"warmstart": start}], root)  # refused before running anything
        seeds = [int(s) for s in FLAGS.ablation_seeds]
        same_as, started = _finished(root, seeds)
        for seed in seeds:
            for name in names:
                _run(ARMS_BY_NAME[name], seed, root, warm, same_as, started, start)
        if not names:
            return
    report(root)
