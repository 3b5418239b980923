"""The two jobs behind `launch.train` and `launch.eval`, callable without absl flags."""
from __future__ import annotations

import os
import sys
from typing import Any

from cope_jax.run import metrics as metrics_lib


class RunDirectoryError(FileNotFoundError):
    """The workdir lacks what the command needs (its config.json, a checkpoint, the warm start)."""


def train_run(config, workdir: str, *, progress: bool = True, resume: str = "latest") -> dict[str, Any]:
    """Warm start (once per workdir), the starting policy's evaluation (once), then the RL stage
    (resumed from the newest checkpoint; `resume`: `cope_jax/stages/rl.py: resume_from`). Returns the
    last evaluation summary."""
    from cope_jax.run.build import build
    from cope_jax.stages.evaluate import evaluate_once
    from cope_jax.stages.rl import train
    from cope_jax.stages.warmstart import warmstart

    parts = build(config, workdir)
    try:
        warmstart(parts, progress=progress)
        s = evaluate_once(parts, 0, progress=progress) if config.eval.every else None
        if s:
            print(f"step 0 (start of RL): succ {s['succ']:.3f} score {s['score']:.3f}", file=sys.stderr)
        summary = train(parts, progress=progress, resume=resume)
        if not summary:  # nothing left to train: report the run's last evaluation
            evals = metrics_lib.latest_records(metrics_lib.read_log(parts.workdir), "eval")
            summary = evals[max(evals)] if evals else {}
        return summary
    finally:
        parts.close()


def eval_run(config, workdir: str, *, checkpoint: int | None = None, split: str | None = None,
             samples: int | None = None, tasks: int | None = None, progress: bool = False,
             reevaluate: bool = False) -> dict[str, Any]:
    """Evaluates one checkpoint of a run (default: the newest; 0: the starting policy) and writes
    eval.json, eval.md and learning_curves.png next to the run's logged evaluations. Never trains:
    a run without checkpoints (or, for 0, without its finished warm start) is refused.

    When training already evaluated that checkpoint with the config's settings (split, samples and
    tasks not overridden), its logged result is reported instead of playing the same episodes again:
    the evaluation's key is a function of the seed and the step, so a second run of it returns the
    same episodes. `reevaluate` plays them anyway (and reads the checkpoint)."""
    import jax
    from flax import nnx

    from cope_jax.run import config_check, distributed
    from cope_jax.run.build import build
    from cope_jax.run.checkpoint import TrainCheckpointer
    from cope_jax.stages.evaluate import evaluate
    from cope_jax.stages.rl import CHECKPOINT_DIR, trained_params
    from cope_jax.stages.warmstart import WARMSTART_DIR, warmstart

    config_check.check(config)  # before the workdir is read: a logged result may answer without `build`
    if not os.path.isfile(os.path.join(workdir, "config.json")):
        raise RunDirectoryError(f"{workdir} is not a run directory (no config.json); run launch.train first")
    ckpt_dir = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    latest = TrainCheckpointer.steps_in(ckpt_dir)
    step = checkpoint if checkpoint is not None else (latest[-1] if latest else None)
    if step is None:
        raise RunDirectoryError(f"{workdir} has no checkpoint yet; pass --checkpoint=0 to evaluate the policy "
                                "RL starts from")
    if step and step not in latest:
        raise RunDirectoryError(f"{workdir} has no checkpoint {step} (it has {latest or 'none'})")
    if not step and config.warmstart.steps > 0 and not os.path.isdir(os.path.join(workdir, WARMSTART_DIR)):
        raise RunDirectoryError(f"{workdir} has no finished warm start ({WARMSTART_DIR}/), so no starting policy "
                                "to evaluate; run launch.train first")
    logged = metrics_lib.latest_records(metrics_lib.read_log(workdir), "eval")
    # process 0's log decides, as for training's evaluations: every process takes the same path
    reused = distributed.broadcast_object(
        logged.get(step) if not reevaluate and _config_evaluation(config, split, samples, tasks) else None)
    if reused is not None:
        summary = _from_record(reused) | {k: reused[k] for k in ("split", "samples")}
        return _report(config, workdir, step, summary, logged, is_main=jax.process_index() == 0)
    parts = build(config, workdir)  # writes nothing: the workdir is a run's already
    try:
        if not step:
            warmstart(parts)  # loads the finished warm start (checked above), never trains
        else:
            if parts.model.cfg.lora is not None and parts.config.warmstart.steps > 0:
                warmstart(parts)  # the base of the run's adapters
            with TrainCheckpointer(ckpt_dir) as ckpt:
                nnx.update(parts.model, _restore_params(ckpt, step, trained_params(parts.model)))
        summary = evaluate(parts, step, split=split, samples=samples, tasks=tasks, name="eval_binary",
                           progress=progress)
        return _report(config, parts.workdir, step, summary, logged, is_main=parts.is_main)
    finally:
        parts.close()


def _restore_params(ckpt, step: int, abstract):
    """The parameters of checkpoint `step`; an unreadable one is refused in one line that names the
    newest intact step and the flag that evaluates it."""
    from cope_jax.run.checkpoint import CheckpointError

    def readable(s):
        try:
            ckpt.restore(s, abstract_state={"params": abstract})
            return True
        except CheckpointError:
            return False

    try:
        return ckpt.restore(step, abstract_state={"params": abstract})[1]["params"]
    except CheckpointError as e:
        intact = next((s for s in sorted(ckpt.all_steps(), reverse=True) if s != step and readable(s)), None)
        hint = (f"step {intact} is intact: pass --checkpoint={intact} to evaluate it" if intact is not None
                else "no other checkpoint step is intact (--checkpoint=0 evaluates the starting policy)")
        raise CheckpointError(f"{e}; {hint}") from e


def _config_evaluation(config, split, samples, tasks) -> bool:
    """The asked evaluation is the one training runs (`stages/evaluate.py: evaluate`'s defaults)."""
    return (split in (None, config.env.eval_split) and samples in (None, config.eval.samples)
            and tasks in (None, config.eval.tasks))


def _report(config, workdir: str, step: int, summary: dict, logged: dict, *, is_main: bool) -> dict[str, Any]:
    """Writes the report (process 0): the run's logged evaluations, then this checkpoint's."""
    results = {f"step_{s}": _from_record(r) for s, r in sorted(logged.items())}
    results[f"checkpoint_{step}"] = summary
    meta = {"config": config.env.family + ":" + config.method, "checkpoint": step,
            "split": summary["split"], "samples": summary["samples"]}
    paths = metrics_lib.write_eval_report(workdir, results, meta) if is_main else {}
    return {"checkpoint": step, "succ": summary["succ"], "score": summary["score"],
            "episodes": summary["episodes"], **paths}


def _from_record(r: dict) -> dict:
    fams = {k.split("/", 1)[1]: {"succ": v} for k, v in r.items() if k.startswith("succ/")}
    for f, fam in fams.items():
        if f"episodes/{f}" in r:  # logged since the success table's standard errors
            fam["episodes"] = r[f"episodes/{f}"]
    return {"score": r["score"], "succ": r["succ"], "episodes": r["episodes"], "families": fams}
