"""A LoRA run end to end on the built-in environment: the warm start trains every weight, RL trains
only the adapters on top of it, checkpoints hold the adapters, evaluation reads them, and a resume
with another rank is refused in one line."""
import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import models
from cope_jax.stages.entry import eval_run, train_run
from models import ConfigError, lora
from tests.stages.test_train_e2e import tiny_config


def test_a_lora_run_trains_the_adapters_on_the_warm_started_base(tmp_path):
    c = tiny_config("cope")
    c.warmstart.update(steps=2, tasks=8, batch_episodes=4, af_examples=3)
    c.train.lora.update(rank=4, alpha=8.0)
    workdir = str(tmp_path / "run")
    train_run(c, workdir, progress=False)
    records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["minibatches"] >= 1 for r in train)
    assert all(np.isfinite(r["loss"]) for r in train)
    # the step's checkpoint: the adapters and their optimizer state only
    step = os.path.join(workdir, "checkpoints", "2")
    saved = ocp.StandardCheckpointer().metadata(os.path.join(step, "params")).item_metadata.tree
    names = {f"{k}/{n}" for k, v in saved.items() for n in (v if isinstance(v, dict) else {})}
    assert names and all(lora.is_adapter(n) for n in names), names
    # the warm start saved a plain model (no adapters), every weight trained
    warm, _ = models.load_model(os.path.join(workdir, "warmstart"))
    assert warm.cfg.lora is None
    out = eval_run(c, workdir, reevaluate=True)
    assert json.load(open(out["json"]))["results"]["checkpoint_2"]["episodes"] == 2
    other = tiny_config("cope")
    other.warmstart.update(steps=2, tasks=8, batch_episodes=4, af_examples=3)
    other.train.lora.update(rank=8, alpha=8.0)
    other.train.steps = 3
    before = sorted(os.listdir(workdir))
    with pytest.raises(ConfigError, match=r"different config \(.*train.lora.rank"):
        train_run(other, workdir, progress=False)
    assert sorted(os.listdir(workdir)) == before


@pytest.mark.parametrize("field, value, message", [
    ("rank", None, "train.lora.alpha set without train.lora.rank: give a rank"),
    ("rank", -1, "train.lora.rank=-1: expected a whole number >= 1"),
    ("rank", 0, "train.lora.rank=0: expected a whole number >= 1"),
    ("targets", ("q_proj", "qkv"), "unknown projection 'qkv'"),
    ("dropout", 0.1, "train.lora.dropout=0.1: only 0 is supported"),
])
def test_a_bad_lora_field_is_refused_before_anything_is_written(tmp_path, field, value, message):
    from cope_jax.run.build import build

    c = tiny_config("grpo")
    c.train.lora.update(rank=4, alpha=8.0)
    c.train.lora[field] = value
    with pytest.raises(ConfigError, match=message):
        build(c, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_convert_merges_a_lora_step_into_its_base(tmp_path):
    """orbax_to_hf of WORKDIR/checkpoints/STEP of a LoRA run: the adapters merged into the warm
    start; transformers loads it and computes what the run's policy (base + adapters) does."""
    import transformers
    import torch

    from launch import convert as convert_lib

    c = tiny_config("grpo", steps=1)
    c.warmstart.update(steps=2, tasks=8, batch_episodes=4)
    # one step on a tiny, near-uniform policy moves B little: scale alpha / rank = 100 makes it show
    c.train.lora.update(rank=4, alpha=400.0)
    c.train.learning_rate = 0.05
    workdir = str(tmp_path / "run")
    train_run(c, workdir, progress=False)
    step = os.path.join(workdir, "checkpoints", "1")
    out = convert_lib.convert("orbax_to_hf", step, str(tmp_path / "hf"))
    assert out["params"] == models.qwen.count_params(models.qwen.frozen_config(models.QwenConfig.from_hf_dir(str(tmp_path / "hf"))))
    policy, _ = convert_lib._lora_step_model(step, os.path.join(workdir, "warmstart"), None)
    assert np.abs(np.asarray(policy.layers.q_proj_lora_b[...])).max() > 0
    tokens = np.random.RandomState(0).randint(0, 320, (2, 16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(policy(tokens)), rtol=1e-4, atol=1e-4)
    base, _ = models.load_model(os.path.join(workdir, "warmstart"))
    assert np.abs(np.asarray(base(tokens)) - got).max() > 1e-3  # the adapters are in it (the parity above is at 1e-4)


def test_a_lora_demo_run_learns_from_its_warm_start(tmp_path, monkeypatch):
    """The demo, on a split of 6 train tasks that a small model memorises in 200 warm-start steps
    (success certain, so the forecasting term has targets): 4 CoPE steps training only rank-8
    adapters lower the forecasting loss and keep the warm start's success. The warm start never saw
    a forecasting example, so the term starts high and only the adapters can lower it."""
    from configs import demo
    from envs import builtin

    real = builtin.BuiltinEnv.task_ids
    monkeypatch.setattr(builtin.BuiltinEnv, "task_ids",
                        lambda self, split: real(self, split)[:6] if split == "train" else real(self, split))
    c = demo.get_config("cope")
    c.model.update(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
    c.mesh = (1, 1, 1)
    c.env.update(workers=1, eval_split="train")
    c.rollout.update(tasks_per_step=6, group_size=4, sampler_rows=24)
    c.train.update(steps=4, minibatch_tasks=6, rows_per_micro=4, learning_rate=1e-3)
    c.train.lora.update(rank=8, alpha=16.0)
    c.warmstart.update(steps=200, batch_episodes=8, mistakes=0.0, dawdle=0.0)
    c.eval.update(every=4, samples=4)
    c.checkpoint.update(every=4, keep=1)
    workdir = str(tmp_path / "run")
    train_run(c, workdir, progress=False)
    records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = {r["step"]: r["succ"] for r in records if r["kind"] == "eval"}
    train = [r for r in records if r["kind"] == "train"]
    assert evals[0] >= 0.5, evals  # the warm start plays its tasks (else "not worse" says nothing)
    assert all(r["minibatches"] >= 1 and r["af_loss"] > 0 for r in train), train
    assert train[-1]["af_loss"] < 0.9 * train[0]["af_loss"], [r["af_loss"] for r in train]
    # 24 episodes: one standard error of a success rate near 0.9 is ~0.06
    assert evals[4] >= evals[0] - 0.15, evals
