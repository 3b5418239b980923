"""End to end on the built-in environment: every method trains 2 steps and leaves checkpoints,
TensorBoard events and eval.json; a run killed with SIGKILL resumes to the same metrics."""
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from configs import base, demo
from cope_jax.stages.entry import eval_run, train_run
from tests.config_flags import override_flags
from tests.stages.expert import with_a_success_per_group
from tests.paths import ROOT

REPO = ROOT
TIMING = ("seconds", "_s", "per_s")


def tiny_config(method: str, steps: int = 2):
    c = demo.get_config(method)
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.tokenizer = "sentencepiece:320"
    c.mesh = (1, 1, 1)  # one device: the sharded step has its own tests
    c.env.update(workers=1, max_rounds_train=3, max_rounds_eval=3)
    c.rollout.update(tasks_per_step=2, group_size=2, max_turn_tokens=6, max_len=1024, sampler_rows=4)
    c.train.update(steps=steps, minibatch_tasks=1, row_len=1024, rows_per_micro=2, learning_rate=1e-3)
    c.warmstart.update(steps=0)
    c.eval.update(every=steps, tasks=2, samples=1)
    c.checkpoint.update(every=1, keep=2)
    return c


def term_activity(record: dict, terms) -> dict:
    """{term: its gradient norm in this step's record} (`train.grad_norm_terms`)."""
    return {t: record.get(f"grad_norm_{t}", 0.0) for t in terms}


@pytest.mark.parametrize("method", base.METHODS)
def test_every_method_trains_two_steps(method, tmp_path, monkeypatch):
    """Every step runs mini-batches and every term of the method moves the weights: its gradient
    norm (each term's own pass: `train.grad_norm_terms`) is finite and non-zero."""
    from cope_jax.objective.methods import get_method

    c = tiny_config(method)
    terms = c.train.grad_norm_terms = get_method(method).terms
    c.train.entropy_coef = 0.01  # the demo's 0 would switch the entropy term off
    c.rollout.prefetch_resets = False  # the expert plays on the same pool between steps
    with_a_success_per_group(monkeypatch)
    if method == "cope":  # one method also runs the warm start stage, with forecasting examples
        c.warmstart.update(steps=2, tasks=8, batch_episodes=4, af_examples=3)
    workdir = str(tmp_path / method.replace("+", "_"))
    train_run(c, workdir, progress=False)
    records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["minibatches"] >= 1 and r["succ"] >= 0.5, r  # a success in each group of 2
        active = term_activity(r, terms)
        assert all(math.isfinite(v) and v > 0 for v in active.values()), (method, active)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    if method == "cope":
        assert os.path.isdir(os.path.join(workdir, "warmstart", "params"))
        warm = [r for r in records if r["kind"] == "warmstart"]
        assert warm and all(r["af_examples"] == 3 for r in warm)
    out = eval_run(c, workdir)
    report = json.load(open(out["json"]))
    assert report["checkpoint"] == 2 and report["results"]["checkpoint_2"]["episodes"] == 2
    assert os.path.getsize(out["plot"]) > 1000 and open(out["markdown"]).read().startswith("# Evaluation")
    # every result, logged by training or just evaluated, counts its episodes per family (the
    # success table's standard errors)
    for result in report["results"].values():
        assert sum(f["episodes"] for f in result["families"].values()) == result["episodes"], result
    overall = [l for l in open(out["markdown"]).read().splitlines() if l.startswith("| overall |")]
    assert len(overall) == 1 and overall[0].count(" ± ") == len(report["results"])
    if method == "cope":
        # the report above reused training's evaluation of checkpoint 2; playing it again (after
        # reading the checkpoint) gives the same result, family by family
        logged = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if r["kind"] != "train"]
        assert not any(r["kind"] == "eval_binary" for r in logged)
        again = json.load(open(eval_run(c, workdir, reevaluate=True)["json"]))["results"]["checkpoint_2"]
        reused = report["results"]["checkpoint_2"]
        assert {k: again[k] for k in ("succ", "score", "episodes")} == {k: reused[k] for k in ("succ", "score", "episodes")}
        assert {f: v["succ"] for f, v in again["families"].items()} == {f: v["succ"] for f, v in reused["families"].items()}


def test_filtered_zero_variance_steps_refill_then_train_on_what_carries_signal(tmp_path):
    """`train.zero_variance='filter'` through the trainer, prefetched resets on: a random tiny model
    fails every episode, so each step drops its groups, plays its one refill round (the batch whose
    resets were prefetched) and trains on nothing that lacks signal; both steps are logged."""
    c = tiny_config("grpo")
    c.train.update(zero_variance="filter", refill_rounds=1)
    workdir = str(tmp_path / "filter")
    train_run(c, workdir, progress=False)
    train = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        played = r["refill_rollouts"] / 4 + 1  # rounds of 2 tasks x 2 episodes
        assert r["refill_rollouts"] in (0.0, 4.0) and r["zero_variance_groups"] <= 2 * played
        if r["zero_variance_groups"] == 2 * played:  # nothing carried signal: no optimizer step
            assert r["minibatches"] == 0


def test_pool_gives_every_sampler_row_an_environment(tmp_path):
    """env.envs_per_worker=0 sizes the pool to the sampler (3 workers, 8 rows: 3 instances each)."""
    from cope_jax.run.build import build

    c = tiny_config("grpo")
    c.env.workers, c.rollout.sampler_rows = 3, 8
    for envs, want in ((0, 9), (1, 3)):
        c.env.envs_per_worker = envs
        parts = build(c, str(tmp_path / str(envs)))
        try:
            assert parts.pool.capacity("builtin") == want
        finally:
            parts.close()


def _train_cmd(workdir, steps):
    c = tiny_config("grpo", steps)
    flags = [f"--config={REPO}/configs/demo.py:grpo", f"--workdir={workdir}", "--noprogress",
             *override_flags(c, demo.get_config("grpo"))]
    return [sys.executable, "-m", "launch.train"] + flags


def _metrics(workdir):
    out = {}
    for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))):
        if r["kind"] == "train":
            out[r["step"]] = {k: v for k, v in r.items() if not k.endswith(TIMING)}
    return out


def kill_9_after_checkpoint(cmd, workdir, env, step=2):
    """Runs `cmd` until `workdir` holds checkpoint `step`, then SIGKILLs it with everything it started."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not os.path.isdir(os.path.join(workdir, "checkpoints", str(step))):
        assert proc.poll() is None and time.time() < deadline, f"the run ended before checkpoint {step}"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_9_then_rerun_resumes_exactly(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    subprocess.run(_train_cmd(straight, 4), env=env, cwd=REPO, check=True, capture_output=True, timeout=600)
    kill_9_after_checkpoint(_train_cmd(killed, 4), killed, env)
    before = _metrics(killed)
    assert max(before) < 4
    subprocess.run(_train_cmd(killed, 4), env=env, cwd=REPO, check=True, capture_output=True, timeout=600)
    after, reference = _metrics(killed), _metrics(straight)
    assert sorted(after) == [1, 2, 3, 4]
    for step in (3, 4):
        assert after[step] == reference[step], step
