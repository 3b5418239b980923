"""python -m launch.train --config=configs/<env>.py:<method> --workdir=DIR [--config.x.y=v ...]

Runs the optional supervised warm start, then the RL stage of the configured method, with periodic
evaluation, Orbax checkpoints and automatic resume from --workdir (rerun the same command after a
crash). Logs go to DIR/metrics.jsonl and DIR/tensorboard.
"""
from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

from launch import cli

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/demo.py or configs/sciworld.py:cope.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory (created; an existing one is resumed).")
flags.DEFINE_bool("progress", True, "Show the console progress bar.")
flags.DEFINE_enum("resume", "latest", ["latest", "latest_valid"], "latest: resume from the newest checkpoint "
                  "and stop if it is unreadable (naming the newest intact one); latest_valid: set unreadable "
                  "steps aside and resume from the newest intact one.")
flags.mark_flags_as_required(["config", "workdir"])
cli.define_multihost_flags()
FLAGS = flags.FLAGS


def main(argv):
    cli.start(argv)
    from cope_jax.stages.entry import train_run

    final = train_run(FLAGS.config, FLAGS.workdir, progress=FLAGS.progress, resume=FLAGS.resume)
    import jax

    if jax.process_index() == 0:
        print(json.dumps({"workdir": os.path.abspath(FLAGS.workdir),
                          "final_eval": {k: final.get(k) for k in ("succ", "score", "episodes")}}))


if __name__ == "__main__":
    cli.run(main)
