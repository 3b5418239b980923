"""python -m launch.bench --suite=NAME [suite flags]: machine-readable benchmark lines (JSON).

Each suite lives in its own module `launch/bench_<suite>.py` exposing `run(argv: list[str]) -> None`,
which prints one JSON object per line, each next to the reference it is compared with in the same run.
"""
from __future__ import annotations

import importlib
import sys

from absl import flags

from launch import cli, huge_pages

SUITES = {
    "sampler": "launch.bench_sampler",
    "loss": "launch.bench_loss",
    "envs": "launch.bench_envs",
    "convert": "launch.bench_convert",
    "rollout": "launch.bench_rollout",
    "attention": "launch.bench_attention",
    "ablation": "launch.bench_ablation",
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
