"""python -m launch.accept: this machine's accelerator (or CPU) measured beside what it should take.

One command for a borrowed accelerator: it detects the backend, runs each section at the sizes the
backend takes (`--size=auto`: full on TPU / GPU, tiny on CPU, where it is part of the test suite so
it never rots; `--size=quick`: every section in about 8 minutes of one GPU, which
`launch/gpu/accept.sh run` gives it with the packages the machine lacks carried as wheels) and writes `<out>/accept.jsonl` (one line per check, written as it is measured, so a
run cut short keeps what it measured) and `<out>/accept.md` (the table:
measured, predicted, ratio). It exits 0 even when a check falls short: the table says which.

Sections (`--sections`):
- attention (`launch/accept/attention.py`): every implementation the backend runs, on packed rows
  with segments and a forecasting tree: outputs and gradients against the reference, forward and
  forward+backward seconds against the roofline of the work the row needs, peak memory against the
  compiler's.
- sampler (`launch/accept/sampler.py`): decode steps at batch 1, 8 and 64 and prefill of a random bf16
  model against the bytes / FLOPs they must move over the bandwidth / FLOP/s measured in the run.
- train (`launch/accept/train.py`): one micro-batch of the RL train step on this machine's devices:
  step time, peak memory and model FLOPs utilization beside the planner's prediction of the same
  program on the same devices.
- rl (`launch/accept/rl.py`): one RL step of the built-in demo through the trainer's entry point:
  rollout and update seconds (no prediction: environments and host work included).

`--topology=T` adds the train step planned for a `launch.plan` target (section `plan`): predicted
rows only, unless this machine is that chip (then the train section is its measurement).

A predicted peak is the compiler's memory analysis of the program that runs. A predicted time is the
roofline of analytical counts (FLOPs, bytes) on the device's public peak FLOP/s and HBM bandwidth
(`cope_jax/plan/targets.py`), never the compiler's cost analysis, which counts a loop body once and
a kernel as nothing (`accept_device.roofline_s`); where the device is not in that table (CPU) the
time has no prediction and says so. A measurement comes only from
running: a program this backend cannot run is not in the table.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

from absl import flags

from launch import cli
from launch.accept.report import SECTIONS, Check, table
from models.config import ConfigError

# train first: on CPU its peak is the process's resident memory, which pages freed by an earlier
# section would hide
flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, from {SECTIONS}.")
flags.DEFINE_enum("size", "auto", ["auto", "tiny", "quick", "full"], "Shapes: full (accelerators), quick "
                  "(accelerators, every section inside about 8 minutes: attention at 16k tokens only, half the "
                  "decode steps), tiny (CPU, minutes), auto: full on TPU / GPU, tiny on CPU.")
flags.DEFINE_string("out", "runs/accept", "Directory for accept.jsonl and accept.md.")
flags.DEFINE_integer("repeats", 3, "Timed calls after a warm-up one; the best is reported.")
flags.DEFINE_string("topology", None, "Also plan the train step for this launch.plan target (e.g. 1xH100, "
                    "v5e-8): predicted rows, measured only where this machine is that chip.")
FLAGS = flags.FLAGS


def device_summary() -> dict:
    import jax

    from launch.accept import device as accept_device

    d = jax.devices()[0]
    chip = accept_device.chip()
    return dict(backend=jax.default_backend(), device_kind=d.device_kind, devices=jax.device_count(),
                chip=None if chip is None else chip.kind)


def _logged(log, checks: Iterable[Check]) -> list[Check]:
    """Each check written (and flushed) the moment its section yields it."""
    done = []
    for c in checks:
        log.write(json.dumps(c.record()) + "\n")
        log.flush()
        done.append(c)
    return done


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv):
    del argv
    import jax

    unknown = sorted(set(FLAGS.sections) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    size = FLAGS.size if FLAGS.size != "auto" else ("tiny" if jax.default_backend() == "cpu" else "full")
    if FLAGS.topology:
        from cope_jax.plan import targets

        targets.get_target(FLAGS.topology)  # an unknown one fails before anything runs
    os.makedirs(FLAGS.out, exist_ok=True)
    from launch.accept import attention as accept_attention
    from launch.accept import rl as accept_rl
    from launch.accept import sampler as accept_sampler
    from launch.accept import train as accept_train

    runners = {"attention": accept_attention.run, "sampler": accept_sampler.run, "train": accept_train.run,
               "rl": accept_rl.run}
    checks: list[Check] = []
    summary = dict(device_summary(), size=size)
    seconds = {}
    # one line per check as it finishes: a run cut short by a borrowed machine's limit keeps what it measured
    with open(os.path.join(FLAGS.out, "accept.jsonl"), "w") as log:
        log.write(json.dumps(dict(summary=True, **summary)) + "\n")
        for section in (s for s in SECTIONS if s in FLAGS.sections):
            start = time.perf_counter()
            checks += _logged(log, runners[section](size=size, repeats=FLAGS.repeats))
            seconds[section] = round(time.perf_counter() - start, 1)
            print(f"accept: {section} done in {seconds[section]:.0f} s", flush=True)
        if FLAGS.topology:
            checks += _logged(log, accept_train.planned(size=size, topology=FLAGS.topology))
    summary["seconds"] = seconds  # the borrowed machine's budget, per section
    _write(os.path.join(FLAGS.out, "accept.jsonl"),  # complete: the summary line gains the seconds
           "".join(json.dumps(r) + "\n" for r in [dict(summary=True, **summary)] + [c.record() for c in checks]))
    header = (f"# launch.accept: {summary['device_kind']} x {summary['devices']} ({summary['backend']}), "
              f"size {size}, {sum(seconds.values()):.0f} s ("
              + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ")")
    _write(os.path.join(FLAGS.out, "accept.md"), table(checks, header))
    print(table(checks, header))


if __name__ == "__main__":
    cli.run(main)
