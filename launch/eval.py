"""python -m launch.eval --config=... --workdir=DIR [--checkpoint=STEP] [--split=test] [--samples=k]

Evaluates a run's checkpoint (default: the newest; 0 = the policy RL started from, i.e. the warm
start or the pretrained model) on a split: Score and Succ per sub-task family and overall, Avg@k
over k samples per task. Writes DIR/eval.json, DIR/eval.md and DIR/learning_curves.png, next to the
run's logged evaluations. Prints the summary as one JSON line, then test success per family across
the run (right after the warm start, at each logged evaluation, and this checkpoint's).
"""
from __future__ import annotations

import json

from absl import flags
from ml_collections import config_flags

from launch import cli

config_flags.DEFINE_config_file("config", None, "The run's config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "The run directory (as given to launch.train).")
flags.DEFINE_integer("checkpoint", None, "Checkpoint step; default: the newest (a run without one is "
                     "refused); 0: the starting policy.", lower_bound=0)
flags.DEFINE_string("split", None, "Task split (default: the config's eval split).")
flags.DEFINE_integer("samples", None, "Samples per task (Avg@k).", lower_bound=1)
flags.DEFINE_integer("tasks", None, "Evaluate N tasks of the split, taken in turn from each sub-task family.",
                     lower_bound=1)
flags.DEFINE_bool("reevaluate", False, "Play the episodes again even when training already evaluated this "
                  "checkpoint with the config's settings (by default its logged result is reported: the same "
                  "key gives the same episodes).")
flags.DEFINE_bool("progress", True, "Show the console progress bar.")
flags.mark_flags_as_required(["config", "workdir"])
cli.define_multihost_flags()
FLAGS = flags.FLAGS


def main(argv):
    cli.start(argv)
    from cope_jax.stages.entry import eval_run

    out = eval_run(FLAGS.config, FLAGS.workdir, checkpoint=FLAGS.checkpoint, split=FLAGS.split,
                   samples=FLAGS.samples, tasks=FLAGS.tasks, progress=FLAGS.progress,
                   reevaluate=FLAGS.reevaluate)
    print(json.dumps(out))
    if "json" in out:  # process 0
        from cope_jax.run.metrics import success_screen

        with open(out["json"]) as f:
            print(success_screen(json.load(f)))


if __name__ == "__main__":
    cli.run(main)
