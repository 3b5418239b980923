"""Converts Qwen checkpoints between HF safetensors and Orbax model directories.

  python -m launch.convert --mode=hf_to_orbax --src=HF_DIR --dst=ORBAX_DIR [--dtype=bfloat16]
  python -m launch.convert --mode=orbax_to_hf --src=ORBAX_DIR --dst=HF_DIR [--max_shard_size=5GB]
  python -m launch.convert --mode=orbax_to_hf --src=WORKDIR/STEP --config_dir=HF_DIR --dst=OUT
      (a training checkpoint step: its params, with config.json and tokenizer files from HF_DIR)
  python -m launch.convert --mode=orbax_to_hf --src=WORKDIR/checkpoints/STEP --dst=OUT
      (a LoRA run's step: its adapters merged into the run's base, the warm start or model.path)

The source is fully validated (config, every tensor's presence, shape and byte range) before
anything is written; the destination appears atomically or not at all. On bad input the binary
prints one line naming the problem to stderr and exits with status 1.
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags

from launch import cli
from models.config import ConfigError

MODES = {"hf_to_orbax": ("hf", "orbax"), "orbax_to_hf": ("orbax", "hf")}

flags.DEFINE_enum("mode", None, sorted(MODES), "Conversion direction.")
flags.DEFINE_string("src", None, "Source model directory.")
flags.DEFINE_string("dst", None, "Destination directory (must not exist or be empty, unless --overwrite).")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32", "float16"],
                  "Stored dtype of the output (default: the source's).")
flags.DEFINE_string("max_shard_size", "5GB", "HF output: split safetensors files above this size.")
flags.DEFINE_bool("overwrite", False, "Replace a non-empty destination.")
flags.DEFINE_string("config_dir", None, "Directory whose config.json (and tokenizer files) describe the "
                    "model when --src has none, e.g. a training checkpoint step.")
flags.DEFINE_list("mesh", None, "data,fsdp,tp mesh to place the parameters on (default: one device).")
flags.DEFINE_string("platform", "cpu", "JAX platform to convert on ('' = JAX's default). The CPU "
                    "leaves accelerators free for a job that may be holding them.")
FLAGS = flags.FLAGS


def convert(mode: str, src: str, dst: str, *, dtype: str | None = None, max_shard_size: str = "5GB",
            overwrite: bool = False, config_dir: str | None = None, mesh=None, progress: bool = False) -> dict:
    """Runs one conversion; returns a summary. Raises ValueError/OSError on bad input, dst untouched.
    progress: a bar over the two long phases (read, write) on a terminal."""
    import models
    from models import hf_io, model_dir, orbax_io

    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; choose from {sorted(MODES)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ConfigError(f"--dst must differ from --src ({src})")
    src_kind, dst_kind = MODES[mode]
    model_dir.check_destination(os.path.abspath(dst), overwrite)  # fail fast, before reading anything
    lora_base = _lora_step_base(src)
    if lora_base is not None:
        if mode != "orbax_to_hf":
            raise ConfigError(f"{src}: a LoRA run's checkpoint step holds adapters only: convert it with --mode=orbax_to_hf")
        config_dir = config_dir or lora_base  # its config.json and tokenizer files
    found = model_dir.kind(src)
    if found != src_kind:
        raise ConfigError(f"{src}: is an {found} model directory, but --mode={mode} reads {src_kind}")
    if found == "orbax" and not os.path.isfile(os.path.join(config_dir or src, model_dir.CONFIG_FILE)):
        raise ConfigError(f"{config_dir or src}: no {model_dir.CONFIG_FILE}; for a training checkpoint "
                         f"step pass --config_dir=DIR (a directory with the model's config.json)")
    hf_io.parse_size(max_shard_size)  # validate before the (long) load
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=2, desc=f"read {src_kind}", disable=None if progress else True, leave=False) as bar:
        if lora_base is None:
            model, cfg = models.load_model(src, dtype=dtype, mesh=mesh, config_dir=config_dir)
        else:
            model, cfg = _lora_step_model(src, lora_base, mesh)
        bar.update(1)
        bar.set_description(f"write {dst_kind}")
        carry_from = config_dir or src
        if dst_kind == "orbax":
            files = orbax_io.save_orbax(model, dst, carry_from=carry_from, overwrite=overwrite)
        else:
            files = hf_io.save_hf(model, dst, max_shard_size=max_shard_size, carry_from=carry_from,
                                  overwrite=overwrite)
        bar.update(1)
    written = models.qwen.frozen_config(cfg) if cfg.lora is not None else cfg  # adapters merged
    return {"mode": mode, "src": src, "dst": dst, "architecture": cfg.architecture,
            "dtype": dtype or models.qwen.stored_dtype(cfg), "params": models.qwen.count_params(written), "files": files,
            "seconds": round(time.perf_counter() - t0, 3)}


def _run_config(step_dir: str) -> dict | None:
    """The run config a training checkpoint step saved (None: `step_dir` is not one)."""
    path = os.path.join(step_dir, "config", "metadata")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _lora_step_base(src: str) -> str | None:
    """The base model directory of a LoRA run's checkpoint step `src` (WORKDIR/checkpoints/STEP):
    the run's warm start when it had one, else its model.path; None when `src` is no LoRA step."""
    run = _run_config(src)
    if run is None or (run.get("train", {}).get("lora") or {}).get("rank") is None:
        return None
    workdir = os.path.dirname(os.path.dirname(os.path.abspath(src)))
    if run["warmstart"]["steps"] > 0:
        base = os.path.join(workdir, "warmstart")
        if not os.path.isdir(base):
            raise ConfigError(f"{src}: a LoRA step whose base is the run's warm start, and {base} is missing")
        return base
    if not run["model"]["path"]:
        raise ConfigError(f"{src}: a LoRA step of a randomly initialised model without a warm start has no "
                         "stored base to merge its adapters into")
    return run["model"]["path"]


def _lora_step_model(src: str, base: str, mesh):
    """(model, config): the base of `src` with the step's adapters restored (unmerged)."""
    import ml_collections
    import orbax.checkpoint as ocp
    from flax import nnx

    import models
    from cope_jax.run import run_config

    run = ml_collections.ConfigDict(_run_config(src))
    lora = run_config.lora_config(run)
    model, _ = models.load_model(base, mesh=mesh, **run_config.execution(run))
    model = models.qwen.with_adapters(model, lora, param_dtype=run.model.param_dtype)
    abstract = _abstract(nnx.state(model, nnx.LoRAParam))
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            adapters = checkpointer.restore(os.path.join(src, "params"), abstract)
        except Exception as e:  # Orbax / TensorStore raise their own types
            raise ConfigError(f"{src}/params: not the adapters of rank {lora.rank} on {lora.targets}: "
                             f"{str(e).strip().splitlines()[0][:200]}") from None
    nnx.update(model, adapters)
    return model, model.cfg


def _abstract(tree):
    """Abstract leaves with the arrays' shapes, dtypes and shardings (a restore target)."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def main(argv):
    cli.start(argv)
    for name in ("mode", "src", "dst"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    if FLAGS.platform:
        import jax
        jax.config.update("jax_platforms", FLAGS.platform)
    mesh = None
    if FLAGS.mesh:
        import models
        mesh = models.make_mesh([int(x) for x in FLAGS.mesh])
    summary = convert(FLAGS.mode, FLAGS.src, FLAGS.dst, dtype=FLAGS.dtype, max_shard_size=FLAGS.max_shard_size,
                      overwrite=FLAGS.overwrite, config_dir=FLAGS.config_dir, mesh=mesh, progress=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.run(main)
