"""launch.bench --suite=sampler: our sampler beside transformers' generate on the same weights, and
beside this host's decode bound measured in the same run."""
import json
import subprocess
import sys

from tests.paths import ROOT


def test_the_ratio_line_carries_the_hosts_decode_bound():
    out = subprocess.run([sys.executable, "-m", "launch.bench", "--suite=sampler", "--sampler_configs=tiny",
                          "--sampler_batches=2", "--sampler_repeats=1", "--sampler_new_tokens=256"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    ours, theirs, ratio = lines
    assert (ours["impl"], theirs["impl"], ratio["impl"]) == ("cope_jax", "transformers", "ratio")
    assert ratio["greedy_tokens_agree"] == 1.0  # the same weights decode the same tokens
    assert ratio["read_gb_s"] > 0 and ratio["matmul_gflops"] > 0 and ratio["bound_tok_s"] > 0
    assert abs(ratio["of_bound"] - ours["decode_tok_s"] / ratio["bound_tok_s"]) < 1e-3
