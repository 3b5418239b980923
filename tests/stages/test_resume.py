"""A corrupt checkpoint: one line naming the step and what is wrong, the newest intact step and the
flag; with `resume="latest_valid"` the run continues from the intact step to the same metrics."""
import glob
import json
import os
import shutil

import pytest

from configs import demo
from cope_jax.run.build import build
from cope_jax.stages.entry import train_run
from cope_jax.stages.rl import train
from models import CheckpointError
from tests.config_flags import override_flags
from tests.stages.test_train_e2e import TIMING, tiny_config
from tests.stages.test_train_e2e import _metrics as _train_records


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Three steps trained straight; checkpoints 2 and 3 kept."""
    workdir = str(tmp_path_factory.mktemp("straight") / "run")
    c = tiny_config("grpo", steps=3)
    c.eval.every = 0
    train_run(c, workdir, progress=False)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "3"]
    return c, workdir


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _largest_file(directory):
    return max((p for p in glob.glob(os.path.join(directory, "**"), recursive=True) if os.path.isfile(p)),
               key=os.path.getsize)


CORRUPTIONS = {
    # (damage, what the line names: the damaged item and, where the reader says it, why)
    "truncated data file": (lambda d: _truncate(_largest_file(os.path.join(d, "params"))),
                            "is unreadable: params/: Encountered error while reading"),
    "missing _METADATA": (lambda d: os.remove(os.path.join(d, "params", "_METADATA")), "is unreadable: params/: "),
    "truncated data_state": (lambda d: _truncate(os.path.join(d, "data_state", "metadata")),
                             "is unreadable: data_state/: Unterminated string"),
    "missing optimizer": (lambda d: shutil.rmtree(os.path.join(d, "optimizer")), "missing optimizer/"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_step_stops_with_one_line_then_resumes_from_the_intact_one(straight, tmp_path, case, capsys):
    c, source = straight
    workdir = str(tmp_path / "run")
    shutil.copytree(source, workdir)
    corrupt, detail = CORRUPTIONS[case]
    corrupt(os.path.join(workdir, "checkpoints", "3"))
    parts = build(c, workdir)
    try:
        with pytest.raises(CheckpointError) as e:
            train(parts, progress=False)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("checkpoint step 3 (") and "is unreadable" in msg, msg
        assert detail in msg and msg.endswith("step 2 is intact: rerun with --resume=latest_valid to continue from it")
        assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "3"]  # nothing touched
        train(parts, progress=False, resume="latest_valid")
    finally:
        parts.close()
    assert "resuming from step 2" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "3", "3.unreadable"]
    records = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if r["kind"] == "train"]
    again = {k: v for k, v in records[-1].items() if not k.endswith(TIMING)}
    assert again == _train_records(source)[3]


def test_a_run_stopped_between_checkpoint_and_evaluation_evaluates_on_resume(tmp_path):
    """The evaluation due at the step a run resumes from is run (and logged) if the last life
    checkpointed that step but stopped before evaluating it; a finished one is never repeated."""
    workdir = str(tmp_path / "run")
    c = tiny_config("grpo", steps=2)
    train_run(c, workdir, progress=False)
    path = os.path.join(workdir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    with open(path, "w") as f:  # as if killed during the evaluation after step 2
        f.writelines(json.dumps(r) + "\n" for r in records if not (r["kind"] == "eval" and r["step"] == 2))
    summary = train_run(c, workdir, progress=False)
    again = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in again if r["kind"] == "eval"] == [0, 2]
    assert [r["step"] for r in again if r["kind"] == "train"] == [1, 2]  # nothing trained again
    assert summary["episodes"] == evals[1]["episodes"] and summary["succ"] == evals[1]["succ"]
    train_run(c, workdir, progress=False)
    assert len([json.loads(line) for line in open(path)]) == len(again)


class _Checkpoints:
    """A checkpointer of steps 2 and 3 whose `unreadable` steps fail to restore (one host's view)."""

    workdir = "run"

    def __init__(self, steps, unreadable=()):
        self.steps, self.unreadable, self.set_aside_steps = list(steps), set(unreadable), []

    def all_steps(self):
        return self.steps

    def step_dir(self, step):
        return f"run/checkpoints/{step}"

    def restore(self, step, *, abstract_state):
        if step in self.unreadable:
            raise CheckpointError(f"checkpoint step {step} ({self.step_dir(step)}) is unreadable: truncated")
        return step, abstract_state, {}, {}

    def set_aside(self, step):
        self.set_aside_steps.append(step)
        return self.step_dir(step) + ".unreadable"


def _hosts(monkeypatch, other: _Checkpoints):
    """This process is process 0 of two; process 1 sees `other`. The exchanges in `resume_from`
    are, in order: the step lists, then one restore verdict per step tried."""
    from cope_jax.run import distributed

    verdicts = iter(None if s not in other.unreadable else f"checkpoint step {s} is unreadable: truncated"
                    for s in sorted(other.steps, reverse=True))

    def allgather(obj):
        return [obj, other.steps if isinstance(obj, list) else next(verdicts)]
    monkeypatch.setattr(distributed, "allgather_objects", allgather)


@pytest.mark.parametrize("other", [_Checkpoints([2, 3], unreadable=[3]), _Checkpoints([2])],
                         ids=["other_host_cannot_read", "other_host_does_not_see"])
def test_every_host_resumes_from_the_same_step(monkeypatch, other):
    """Multi-host: this host reads step 3, process 1 cannot (or does not list it): step 3 is
    unreadable for both, the run stops naming process 1, and latest_valid resumes both from step 2."""
    from cope_jax.stages.rl import resume_from

    _hosts(monkeypatch, other)
    mine = _Checkpoints([2, 3])
    stop = r"(process 1.*step 3|step 3.*process 1).*; step 2 is intact: rerun with --resume=latest_valid"
    with pytest.raises(CheckpointError, match=stop):
        resume_from(mine, {"params": 0}, "latest", is_main=True)
    _hosts(monkeypatch, other)
    step, _, _, _ = resume_from(mine, {"params": 0}, "latest_valid", is_main=True)
    assert step == 2 and mine.set_aside_steps == [3]


def test_hosts_that_read_every_step_resume_from_the_newest(monkeypatch):
    from cope_jax.stages.rl import resume_from

    _hosts(monkeypatch, _Checkpoints([2, 3]))
    step, _, _, _ = resume_from(_Checkpoints([2, 3]), {"params": 0}, "latest", is_main=True)
    assert step == 3


def _tree(root):
    """{path: (size, mtime)} of every file and folder under root."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def test_eval_of_a_damaged_checkpoint_is_one_line_naming_the_intact_step_and_writes_nothing(straight, tmp_path):
    """launch.eval on a run whose newest step has a truncated array file: one line on stderr naming
    the step, the newest intact one and the flag that evaluates it, rc 1, and the workdir untouched
    (no TensorBoard file, no report) before and after."""
    import subprocess
    import sys

    from tests.paths import ROOT

    c, source = straight
    workdir = str(tmp_path / "run")
    shutil.copytree(source, workdir)
    CORRUPTIONS["truncated data file"][0](os.path.join(workdir, "checkpoints", "3"))
    before = _tree(workdir)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    config = os.path.join(workdir, "config.py")
    flags = [f"--config={os.path.join(ROOT, 'configs', 'demo.py')}:grpo"]
    # the fixture's tiny config, as flags on the demo config (launch.eval reads a config file)
    flags += override_flags(c, demo.get_config("grpo"))
    proc = subprocess.run([sys.executable, "-m", "launch.eval", *flags, f"--workdir={workdir}", "--noprogress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert len(lines) == 1, proc.stderr
    msg = lines[0]
    assert msg.startswith("eval: error: checkpoint step 3 (") and "is unreadable" in msg, msg
    assert msg.endswith("; step 2 is intact: pass --checkpoint=2 to evaluate it"), msg
    assert "TensorStore details" not in msg and "<bound method" not in msg, msg
    assert _tree(workdir) == before and not os.path.exists(config)
