"""python -m launch.plan --config=configs/<env>.py:<method> --topology=NAME [--mesh=auto|d,f,t]
       [--model=PRESET | --config.model.path=DIR] [--sampler_rows=auto] [--json] [--nocost]

Will it fit? Compiles, from abstract shapes on this machine (no accelerator, no weights), every
program the run executes on the target: the train step at the config's micro-batch shape, the
log-prob pass, the sampler's prefill chunk and decode loop at `rollout.sampler_rows` x `max_len`
(on one host's chips, as the run samples), and the warm-start step when the config has one. Prints
per chip: parameters, optimizer state, other inputs, new outputs, temporaries, code, the run's
buffers alive meanwhile (resident), the total against the chip's usable memory, compile time, and a
roofline estimate (seconds per call, tokens/s) from the compiler's own FLOP and byte counts.

Targets (`--topology`): TPU slices v4-8 ... v4-128, v5e-8 ... v5e-256, v5p-8 ... v5p-256,
v6e-8 ... v6e-256, tpu7x-8 ... tpu7x-256, and GPU hosts 1xA100, 8xA100, 1xH100, 8xH100, 1xH200,
8xH200, 2x8xH100 (`cope_jax/plan/targets.py`). `--sampler_rows=auto` finds the most sampler rows per
host that fit (AppWorld's 34k-token windows on one host).
The architecture: --model (a preset: models/presets.py), else --config.model.path (its config.json
only), else the config's `model.preset`, else its own fields (`model.init='random'`).

Exit status: 0 every program fits; 2 a program does not fit (or the compiler refused it); 1 bad
input (one line on stderr).
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for a target needs no local accelerator

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli  # noqa: E402
from models.config import ConfigError

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/sciworld.py:cope.", lock_config=True)
flags.DEFINE_string("topology", None, "Target: a TPU slice (v5p-32, v5e-64, ...) or GPU host (8xH100, ...).")
flags.DEFINE_string("mesh", None, "data,fsdp,tp (one may be -1), or 'auto': the smallest tp at which every "
                    "program fits. Default: the config's mesh.")
flags.DEFINE_string("model", None, "Architecture preset (e.g. Qwen2.5-7B-Instruct); default: from the config.")
flags.DEFINE_bool("json", False, "Print JSON lines (one per program, then a summary) instead of the table.")
flags.DEFINE_bool("cost", True, "Compile the cost variants for the roofline estimate (--nocost: memory only).")
flags.DEFINE_enum("sampler_rows", None, ["auto"], "'auto': the most rollout.sampler_rows per host, up to the "
                  "config's, whose sampler programs fit (the config's own, else the largest power of two below).")
flags.DEFINE_list("programs", [], "Plan only these programs (e.g. prefill,decode,decode@fill: the sampler's, in "
                  "minutes); default: every program of the run.")
flags.mark_flags_as_required(["config", "topology"])
FLAGS = flags.FLAGS


def _model(c):
    """(QwenConfig, name) of the planned architecture (module docstring)."""
    from cope_jax.run import run_config
    from models import QwenConfig, presets

    execution = run_config.execution(c)
    if FLAGS.model:  # with train.lora's adapters, as the run builds it
        return run_config.adapted(c, presets.preset_config(FLAGS.model, **execution)), FLAGS.model
    if c.model.path:
        return run_config.adapted(c, QwenConfig.from_hf_dir(c.model.path, **execution)), c.model.path
    if c.model.preset:
        return run_config.adapted(c, presets.preset_config(c.model.preset, **execution)), c.model.preset
    if c.model.init != "random":
        raise ConfigError("the config names no architecture: pass --model=PRESET or --config.model.path=DIR")
    vocab = int(c.tokenizer.split(":")[1]) if c.tokenizer.startswith("sentencepiece:") else None
    return run_config.random_model_config(c, vocab), "random init"


def _config_name() -> str:
    for arg in sys.argv[1:]:
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return "config"


def main(argv):
    cli.start(argv)
    from cope_jax.plan import planner, report, targets
    from cope_jax.run import config_check

    c = FLAGS.config
    try:
        config_check.check(c)
        target = targets.get_target(FLAGS.topology)
        mesh = planner.parse_mesh(FLAGS.mesh) if FLAGS.mesh else tuple(c.mesh)
        if mesh != "auto":
            planner.resolve_mesh(mesh, target)  # a wrong mesh fails before any compile
        model_cfg, model_name = _model(c)
        log = (lambda msg: None) if FLAGS.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
        result = planner.plan(c, _config_name(), target, model_cfg, model_name, mesh, cost=FLAGS.cost,
                              only=tuple(FLAGS.programs), sampler_rows=FLAGS.sampler_rows, log=log)
    except cli.refusals() as e:
        sys.exit(f"plan: error: {e}")
    if FLAGS.json:
        for record in report.json_records(result):
            print(json.dumps(record))
    else:
        print(report.table(result))
    sys.exit(0 if result.fits else 2)


if __name__ == "__main__":
    cli.run(main)
