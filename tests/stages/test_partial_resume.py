"""Partial rollouts in training: the trainer killed with SIGKILL while episodes are parked resumes
them from the checkpoint, and over the whole run every group it started is trained or counted as
dropped exactly once; the settings partial rollouts need are refused one line at a time."""
import json
import os
import subprocess
import sys

import pytest

from configs import demo
from cope_jax.run.config_check import check
from models.config import ConfigError
from tests.config_flags import override_flags
from tests.paths import ROOT
from tests.stages.test_train_e2e import kill_9_after_checkpoint, tiny_config


def partial_config(steps: int):
    """The tiny run on the long-tailed family, 2 groups trained per step out of 4 in flight."""
    c = tiny_config("grpo", steps)
    c.env.update(family="tail", max_rounds_train=8)
    c.rollout.update(partial=True, groups_in_flight=4, max_staleness=3)
    c.train.rollout_correction = "tis"
    c.eval.every = 0
    return c


def _cmd(workdir, steps):
    flags = [f"--config={ROOT}/configs/demo.py:grpo", f"--workdir={workdir}", "--noprogress",
             *override_flags(partial_config(steps), demo.get_config("grpo"))]
    return [sys.executable, "-m", "launch.train"] + flags


def last_records(workdir) -> dict[int, dict]:
    """Each train step's record, the last life's where a step was logged twice."""
    out = {}
    for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))):
        if r["kind"] == "train":
            out[r["step"]] = r
    return out


def parked_in(workdir, step) -> list[list[dict]]:
    """Every host's parked episodes in checkpoint `step`'s data state."""
    with open(os.path.join(workdir, "checkpoints", str(step), "data_state", "metadata")) as f:
        return json.load(f)["partial"]["hosts"]


def assert_every_group_once(records: dict[int, dict]) -> None:
    started = sum(r["groups_started"] for r in records.values())
    accounted = sum(r["groups_trained"] + r["stale_groups_dropped"] for r in records.values())
    assert started == accounted and records[max(records)]["parked_groups"] == 0, records


def test_kill_9_while_episodes_are_parked_then_resume_trains_each_group_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    workdir = str(tmp_path / "run")
    kill_9_after_checkpoint(_cmd(workdir, 5), workdir, env)
    assert max(last_records(workdir)) < 5
    parked = parked_in(workdir, 2)[0]
    assert parked and any(ep["versions"] for ep in parked)  # killed with episodes parked mid-way
    out = subprocess.run(_cmd(workdir, 5), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from step 2" in out.stderr and "start again" not in out.stderr
    records = last_records(workdir)
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert_every_group_once(records)
    assert records[3]["staleness_max"] >= 1  # a parked episode's older turns trained after the resume


@pytest.mark.parametrize("change, message", [
    (dict(rollout_correction="none"), "rollout.partial trains on tokens sampled by older policies"),
    (dict(zero_variance="filter"), "rollout.partial with train.zero_variance='filter' is not supported"),
    (dict(groups_in_flight=1), "rollout.groups_in_flight=1 is under rollout.tasks_per_step=2"),
])
def test_settings_partial_rollouts_cannot_run_with_are_one_line(change, message):
    c = partial_config(2)
    for key, value in change.items():
        (c.rollout if key == "groups_in_flight" else c.train)[key] = value
    with pytest.raises(ConfigError) as e:
        check(c)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
