"""launch.bench --suite=loss: the peer comparison's GRPO batch (8 sequences of 64 prompt + 128
completion tokens), loss + gradients and the whole step, each beside the host's FLOP bound; the
demo's train phase beside its own."""
import json
import subprocess
import sys

import pytest

from launch.bench import loss as bench_loss
from tests.paths import ROOT


def test_the_peer_batch_is_the_comparisons_definition():
    batch, cfg = bench_loss.peer_batch(vocab=1000)
    assert batch.tokens.shape == (1, 8, 192) and cfg.kl_coef == 0.04 and cfg.aggregation == "seq-mean-token-mean"
    pg = batch.weights["pg"][0]
    assert (pg[:, :64] == 0).all() and (pg[:, 64:] != 0).all()  # the completions, every one of them
    # seq-mean-token-mean: each sequence weighs 1/8, spread over its 128 completion tokens
    assert abs(abs(pg).sum() - 1.0) < 1e-5 and abs(abs(pg[0]).sum() - 1 / 8) < 1e-6
    assert (batch.old_logp[0][:, 64:] != 0).all() and (batch.ref_logp[0][:, 64:] != 0).all()


def test_the_peer_step_lines_stand_beside_the_flop_bound():
    out = subprocess.run([sys.executable, "-m", "launch.bench", "--suite=loss", "--loss_parts=peer",
                          "--loss_layers=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    peer = [x for x in lines if x["kind"] == "peer_step"]
    assert [x["part"] for x in peer] == ["grads", "step"]
    for x in peer:
        assert x["tokens"] == 1536 and x["layers"] == 1
        assert 0 < x["bound_seconds"] < x["seconds"] * 1.5
        assert x["of_bound"] == pytest.approx(x["bound_seconds"] / x["seconds"], abs=5e-4)  # rounded parts


def test_the_demo_train_phase_stands_beside_its_flop_bound():
    """`demo_train`: the demo's first RL step's mini-batches (48 demonstrator episodes, half of each
    group failed, their forecasting examples) through `loop.learn`, with its model FLOPs counted
    from the rows (a pass each for old and reference log-probs, then the step: 5 forwards' worth)."""
    out = subprocess.run([sys.executable, "-m", "launch.bench", "--suite=loss", "--loss_parts=demo",
                          "--noloss_warmup"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith('{"bench": "loss", "kind": "demo')]
    assert line["episodes"] == 48 and line["minibatches"] == 2 and line["af_examples"] > 0, line
    # forward FLOPs of the demo model (~0.57 M matmul parameters, 2 N per token) set a floor
    assert line["model_tflop"] * 1e12 > 5 * 2 * 0.5e6 * line["tokens"] * 0.5, line
    assert line["bound_seconds"] == pytest.approx(line["model_tflop"] / line["peak_tflops"], rel=2e-2, abs=2e-3)
    assert line["of_bound"] == pytest.approx(line["bound_seconds"] / line["seconds"], rel=2e-2, abs=1e-3)
