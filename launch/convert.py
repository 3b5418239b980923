"""Converts Qwen checkpoints between HF safetensors and Orbax model directories.

  python -m launch.convert --mode=hf_to_orbax --src=HF_DIR --dst=ORBAX_DIR [--dtype=bfloat16]
  python -m launch.convert --mode=orbax_to_hf --src=ORBAX_DIR --dst=HF_DIR [--max_shard_size=5GB]
  python -m launch.convert --mode=orbax_to_hf --src=WORKDIR/STEP --config_dir=HF_DIR --dst=OUT
      (a training checkpoint step: its params, with config.json and tokenizer files from HF_DIR)

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
        raise ValueError(f"unknown mode {mode!r}; choose from {sorted(MODES)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"--dst must differ from --src ({src})")
    src_kind, dst_kind = MODES[mode]
    model_dir.check_destination(os.path.abspath(dst), overwrite)  # fail fast, before reading anything
    found = model_dir.kind(src)
    if found != src_kind:
        raise ValueError(f"{src}: is an {found} model directory, but --mode={mode} reads {src_kind}")
    if found == "orbax" and not os.path.isfile(os.path.join(config_dir or src, model_dir.CONFIG_FILE)):
        raise ValueError(f"{config_dir or src}: no {model_dir.CONFIG_FILE}; for a training checkpoint "
                         f"step pass --config_dir=DIR (a directory with the model's config.json)")
    hf_io.parse_size(max_shard_size)  # validate before the (long) load
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=2, desc=f"read {src_kind}", disable=None if progress else True, leave=False) as bar:
        model, cfg = models.load_model(src, dtype=dtype, mesh=mesh, config_dir=config_dir)
        bar.update(1)
        bar.set_description(f"write {dst_kind}")
        carry_from = config_dir or src
        if dst_kind == "orbax":
            files = orbax_io.save_orbax(model, dst, carry_from=carry_from, overwrite=overwrite)
        else:
            files = hf_io.save_hf(model, dst, max_shard_size=max_shard_size, carry_from=carry_from,
                                  overwrite=overwrite)
        bar.update(1)
    return {"mode": mode, "src": src, "dst": dst, "architecture": cfg.architecture, "dtype": cfg.param_dtype,
            "params": models.qwen.count_params(cfg), "files": files,
            "seconds": round(time.perf_counter() - t0, 3)}


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
