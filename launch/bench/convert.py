"""Conversion benchmark: time and peak RSS of `launch.convert` on a 0.5B-shaped random Qwen2, bf16.

  python -m launch.bench --suite=convert [--convert_repeats=3] [--convert_layers=24]

Builds a random Qwen2 of the Qwen2.5-0.5B shape (hidden 896, 24 layers, vocab 151,936, tied
embeddings) in bfloat16, writes it as an HF directory, then runs each direction as its own
`python -m launch.convert` process (best of N), reading that child's peak RSS from `os.wait4`.
This process never imports JAX (Linux counts a parent's RSS at fork into the child's peak), so
the model is built in a child too.
References measured in the same run: a process that only imports the stack (the RSS and seconds
every conversion pays before touching weights) and a plain copy of the safetensors file (the I/O
floor). One JSON object per line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import flags

flags.DEFINE_integer("convert_repeats", 2, "Runs per measurement; the best is reported.")
flags.DEFINE_integer("convert_layers", 24, "Decoder layers of the benchmark model.")
flags.DEFINE_string("convert_workdir", None, "Where to write the checkpoints (default: a temp dir).")
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE_05B = dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_heads=14,
                 num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                 qkv_bias=True, qk_norm=False, eos_token_id=151643)


def _measure(cmd: list[str]) -> dict:
    """Wall seconds and peak RSS (MiB) of one child process; its last stdout line if JSON."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return {"seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024, "summary": summary}


def _best(cmd: list[str], repeats: int, before=None) -> dict:
    runs = []
    for _ in range(repeats):
        if before:
            before()
        runs.append(_measure(cmd))
    return min(runs, key=lambda r: r["seconds"])


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def write_random_model(directory: str, num_layers: int) -> None:
    """Child-process entry: a random bf16 model of the benchmark shape, saved as an HF directory."""
    import models
    from models import hf_io

    cfg = models.QwenConfig(num_layers=num_layers, dtype="bfloat16", param_dtype="bfloat16", **SHAPE_05B)
    hf_io.save_hf(models.create_model(cfg, seed=0), directory, overwrite=True)
    print(json.dumps({"params": models.qwen.count_params(cfg)}))


def run(argv: list[str]) -> None:
    del argv
    workdir = FLAGS.convert_workdir or tempfile.mkdtemp(prefix="cope_bench_convert_")
    hf_dir, orbax_dir, back_dir = (os.path.join(workdir, n) for n in ("hf", "orbax", "hf_back"))
    python = sys.executable
    setup = _measure([python, "-c", "import sys; from launch.bench.convert import write_random_model; "
                      "write_random_model(sys.argv[1], int(sys.argv[2]))", hf_dir, str(FLAGS.convert_layers)])
    params = setup["summary"]["params"]
    weights = _dir_bytes(hf_dir)
    print(json.dumps({"suite": "convert", "case": "setup_random_model", "params": params,
                      "weights_mib": round(weights / 2**20, 1), "seconds": round(setup["seconds"], 2)}),
          flush=True)

    copy_dst = os.path.join(workdir, "copy.safetensors")
    copy = _best([python, "-c", "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])",
                  os.path.join(hf_dir, "model.safetensors"), copy_dst], FLAGS.convert_repeats)
    os.remove(copy_dst)
    imports = _best([python, "-c", "import jax, flax.nnx, orbax.checkpoint, models, launch.convert; "
                     "jax.devices()"], FLAGS.convert_repeats)
    refs = {"file_copy": copy, "import_only": imports}
    for name, r in refs.items():
        print(json.dumps({"suite": "convert", "case": name, "seconds": round(r["seconds"], 3),
                          "peak_rss_mib": round(r["peak_rss_mib"], 1)}), flush=True)

    directions = {
        "hf_to_orbax": (hf_dir, orbax_dir),
        "orbax_to_hf": (orbax_dir, back_dir),
    }
    for mode, (src, dst) in directions.items():
        cmd = [python, "-m", "launch.convert", f"--mode={mode}", f"--src={src}", f"--dst={dst}",
               "--dtype=bfloat16", "--overwrite"]
        r = _best(cmd, FLAGS.convert_repeats, before=lambda d=dst: shutil.rmtree(d, ignore_errors=True))
        print(json.dumps({
            "suite": "convert", "case": mode, "dtype": "bfloat16", "params": params,
            "seconds": round(r["seconds"], 3),  # whole process, start-up included
            "convert_seconds": r["summary"].get("seconds"),  # load + write, as the binary reports it
            "peak_rss_mib": round(r["peak_rss_mib"], 1),
            "weights_mib": round(weights / 2**20, 1),
            "rss_over_weights": round(r["peak_rss_mib"] * 2**20 / weights, 2),
            "rss_over_import_only": round(r["peak_rss_mib"] / imports["peak_rss_mib"], 2),
            "seconds_over_file_copy": round(r["seconds"] / copy["seconds"], 1),
            "repeats": FLAGS.convert_repeats,
        }), flush=True)
    if not FLAGS.convert_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
