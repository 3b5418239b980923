"""python -m launch.bench --suite=NAME [suite flags]: machine-readable benchmark lines (JSON).

Each suite lives in its own module `launch/bench/<suite>.py` exposing `run(argv: list[str]) -> None`,
which prints one JSON object per line, each next to the reference it is compared with in the same run.
"""
from __future__ import annotations

import importlib
import sys

from absl import flags

from launch import cli, huge_pages

SUITES = {
    "sampler": "launch.bench.sampler",
    "loss": "launch.bench.loss",
    "envs": "launch.bench.envs",
    "convert": "launch.bench.convert",
    "rollout": "launch.bench.rollout",
    "attention": "launch.bench.attention",
    "ablation": "launch.experiments.ablation",
}

flags.DEFINE_enum("suite", None, sorted(SUITES), "Which benchmark suite to run.")
flags.mark_flag_as_required("suite")


def main(argv):
    module = importlib.import_module(SUITES[flags.FLAGS.suite])
    module.run(argv[1:])


if __name__ == "__main__":
    huge_pages.reexec()  # before the suites' imports (cli.run would do it after them)
    # suites define their own absl flags at import time; import the chosen one before parsing
    for arg in sys.argv[1:]:
        if arg.startswith("--suite="):
            name = arg.split("=", 1)[1]
            if name in SUITES:
                importlib.import_module(SUITES[name])
    cli.run(main)
