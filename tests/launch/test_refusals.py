"""Inputs a run cannot take are refused before anything is written, in one line (exit 1), and a
failed start leaves its workdir reusable."""
import os
import subprocess
import sys

import pytest

from cope_jax.run.build import build
from cope_jax.stages.entry import eval_run
from cope_jax.stages.evaluate import evaluate, stratified
from cope_jax.stages.warmstart import warmstart
from models import CheckpointError, ConfigError
from tests.stages.test_train_e2e import tiny_config
from tests.paths import ROOT

REPO = ROOT


def _binary(module, *args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=dict(env, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize("args, message", [
    (["--config=CONFIGS/demo.py", "--workdir="], "train: error: --workdir is empty"),
    (["--config=CONFIGS/demo.py", "--workdir=REPO"], "is the repository's root"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.row_len=100"],
     "train.row_len=100 is shorter than rollout.max_len=768"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.rollout.max_prompt_len=500",
      "--config.rollout.max_response_len=500"], "max_response_len = 1000 exceeds rollout.max_len=768"),
    (["--config=CONFIGS/demo.py:nosuch", "--workdir=run"], "unknown method 'nosuch'"),
    (["--config=CONFIGS/nosuch.py", "--workdir=run"], "nosuch.py: no such config file"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--nosuchflag"], "Unknown command line flag 'nosuchflag'"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.model.init=pretrained",
      "--config.model.path=/nonexistent"], "/nonexistent: no such directory"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.rollout.max_fault_fraction=2"],
     "rollout.max_fault_fraction=2: expected a fraction in [0, 1]"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.lora.rank=0"],
     "train.lora.rank=0: expected a whole number >= 1 (unset: full fine-tuning)"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.lora.rank=8",
      "--config.train.lora.targets=('q_proj','attn')"], "train.lora.targets=('q_proj', 'attn'): unknown projection"),
    # every config value against its declared range or set, and fields by name
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.trian.steps=3"],
     "train: error: --config.trian.steps=3: no field 'trian' (did you mean 'train'?)"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.stepz=3"], "no field 'stepz' (did you mean 'steps'?)"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.env.workers=0"],
     "config.env.workers=0: expected a whole number >= 1"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.rollout.group_size=0"],
     "config.rollout.group_size=0: expected a whole number >= 1"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.steps=-1"],
     "config.train.steps=-1: expected a whole number >= 0"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.rollout.top_p=1.5"],
     "config.rollout.top_p=1.5: expected a number in [0, 1]"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.model.remat=some"], "config.model.remat='some': expected one of"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.model.attention_block=7"],
     "config.model.attention_block=7: expected a multiple of 8 >= 8"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.train.rollout_correction=is"],
     "config.train.rollout_correction='is': expected one of 'none', 'tis', 'mis'"),
    (["--config=CONFIGS/demo.py:rft", "--workdir=run", "--config.train.zero_variance=filter"],
     "train.zero_variance='filter': method 'rft' has no group-relative advantage"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--config.env.eval_split=dev"], "env.eval_split='dev': unknown split"),
    # what the binary checks itself (absl's UsageError) is one line too, not the module's docstring
    (["--config=CONFIGS/demo.py", "--workdir=run", "stray"], "train: error: unexpected arguments: ['stray']"),
    (["--config=CONFIGS/demo.py", "--workdir=run", "--num_processes=2"],
     "train: error: --coordinator_address / --num_processes / --process_id need --multihost"),
])
def test_train_refuses_in_one_line_and_writes_nothing(tmp_path, args, message):
    args = [a.replace("CONFIGS", os.path.join(REPO, "configs")).replace("REPO", REPO) for a in args]
    before = set(os.listdir(REPO))
    rc, lines = _binary("launch.train", *args, cwd=str(tmp_path))
    assert rc == 1 and len(lines) == 1 and message in lines[0], lines
    assert os.listdir(tmp_path) == [] and set(os.listdir(REPO)) == before


def test_sentencepiece_on_a_family_without_an_expert_is_refused_before_the_environment_starts(tmp_path):
    c = tiny_config("grpo")
    c.env.family = "tau2"
    c.env.user.kind = "gold"
    with pytest.raises(ConfigError, match="tau2 has no expert"):
        build(c, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_a_failed_start_leaves_the_workdir_reusable(tmp_path):
    """A wrong model path is refused before the tokenizer is trained or config.json written; the
    corrected command then starts in the same workdir (it used to be refused as 'a different config')."""
    workdir = str(tmp_path / "run")
    bad = tiny_config("grpo")
    bad.model.update(init="pretrained", path=str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="no such directory"):
        build(bad, workdir)
    assert not os.path.exists(workdir)
    build(tiny_config("grpo"), workdir).close()
    assert {"config.json", "tokenizer.model"} <= set(os.listdir(workdir))


def test_eval_never_trains_and_refuses_a_run_without_checkpoints(tmp_path):
    workdir = str(tmp_path / "run")
    c = tiny_config("grpo")
    c.warmstart.update(steps=2, tasks=4, batch_episodes=2)
    build(c, workdir).close()  # a started run: config.json, no warm start, no checkpoint
    before = sorted(os.listdir(workdir))
    with pytest.raises(FileNotFoundError, match="has no checkpoint yet; pass --checkpoint=0"):
        eval_run(c, workdir)
    with pytest.raises(FileNotFoundError, match="no finished warm start"):
        eval_run(c, workdir, checkpoint=0)
    with pytest.raises(FileNotFoundError, match="has no checkpoint 3"):
        eval_run(c, workdir, checkpoint=3)
    assert sorted(os.listdir(workdir)) == before  # no warmstart/, no checkpoints/


def test_a_small_evaluation_covers_the_task_families():
    ids = list(range(10))
    family = {i: "a" if i < 6 else "b" if i < 9 else "c" for i in ids}
    assert stratified(ids, 4, family.get) == [0, 6, 9, 1]
    assert stratified(ids, 20, family.get) == [0, 6, 9, 1, 7, 2, 8, 3, 4, 5]


def test_eval_binary_refuses_a_directory_that_is_no_run_in_one_line(tmp_path):
    rc, lines = _binary("launch.eval", f"--config={REPO}/configs/demo.py", f"--workdir={tmp_path}/nothing",
                        cwd=str(tmp_path))
    assert rc == 1 and lines == [f"eval: error: {tmp_path}/nothing is not a run directory (no config.json); "
                                 "run launch.train first"]


def test_the_warm_start_and_evaluation_show_progress(tmp_path, capsys):
    c = tiny_config("grpo")
    c.warmstart.update(steps=2, tasks=8, batch_episodes=4)
    parts = build(c, str(tmp_path / "run"))
    try:
        warmstart(parts, progress=True)
        evaluate(parts, 0, progress=True)
    finally:
        parts.close()
    err = capsys.readouterr().err
    assert "warm start" in err and "2/2" in err
    assert "eval step 0 (episodes)" in err and "2/2" in err.split("eval step 0")[-1]


def test_verbose_shows_the_traceback_behind_the_one_line(tmp_path):
    rc, lines = _binary("launch.train", f"--config={REPO}/configs/demo.py", "--workdir=", "--verbose", cwd=str(tmp_path))
    assert rc == 1 and any("Traceback" in line for line in lines) and "--workdir is empty" in lines[-1]


def test_seq_mean_token_sum_norm_is_chosen_from_a_config():
    """It used to raise at start-up (no config field for its horizon)."""
    from cope_jax.run import run_config

    c = tiny_config("grpo")
    c.train.agg_mode = "seq-mean-token-sum-norm"
    assert run_config.loss_config(c).norm_length == c.rollout.max_len  # 0: the episode cap
    c.train.norm_length = 300
    assert run_config.loss_config(c).norm_length == 300


def test_a_run_refuses_another_config_but_not_fields_added_since(tmp_path):
    import json

    workdir = str(tmp_path / "run")
    c = tiny_config("grpo")
    build(c, workdir).close()
    path = os.path.join(workdir, "config.json")
    saved = json.load(open(path))
    del saved["rollout"]["max_fault_fraction"]  # as written before the field existed
    json.dump(saved, open(path, "w"))
    build(c, workdir).close()
    os.makedirs(os.path.join(workdir, "checkpoints", "1"))  # a result: the workdir is this config's
    c.train.learning_rate = 0.5
    with pytest.raises(ConfigError, match=r"holds a run with a different config \(train.learning_rate\)"):
        build(c, workdir)


def test_another_config_supersedes_a_failed_start_without_results(tmp_path):
    """A start that failed after config.json was written (no checkpoint, no warm start) does not bind
    the workdir: the corrected config starts there, and the failed start's files are kept aside."""
    import json

    workdir = str(tmp_path / "run")
    c = tiny_config("grpo")
    build(c, workdir).close()
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write('{"kind": "warmstart", "step": 1}\n')  # what the failed start got to log
    c.train.learning_rate = 0.5
    build(c, workdir).close()
    assert json.load(open(os.path.join(workdir, "config.json")))["train"]["learning_rate"] == 0.5
    aside = os.path.join(workdir, "superseded", "1")
    assert json.load(open(os.path.join(aside, "config.json")))["train"]["learning_rate"] == 1e-3
    assert os.path.isfile(os.path.join(aside, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))  # the new run's log starts empty


def test_a_bug_inside_the_train_step_keeps_its_traceback(tmp_path):
    """Only refusals are one line: a ValueError from inside the step (here standing in for one from
    numpy or JAX) is a bug, printed with its traceback and location."""
    code = (
        "import sys\n"
        f"sys.argv = ['train', '--config={REPO}/configs/demo.py', '--workdir=run', '--config.warmstart.steps=0',\n"
        "            '--config.train.steps=1', '--config.eval.every=0', '--config.env.workers=1',\n"
        "            '--config.rollout.tasks_per_step=2', '--config.rollout.group_size=2',\n"
        "            '--config.rollout.sampler_rows=4', '--config.train.minibatch_tasks=1']\n"
        "from cope_jax.stages import rl\n"
        "def learn(*args, **kwargs):\n"
        "    raise ValueError('operands could not be broadcast together with shapes (3,) (4,)')\n"
        "rl.learn = learn\n"
        "from launch import cli, train\n"
        "cli.run(train.main)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback (most recent call last)" in proc.stderr, proc.stderr[-2000:]
    assert "in learn" in proc.stderr and "train: error:" not in proc.stderr


def test_eval_checks_the_config_before_it_reads_the_run(tmp_path):
    """An evaluation whose result training logged answers without starting the run: its config is
    checked all the same."""
    c = tiny_config("grpo")
    c.eval.samples = 0
    with pytest.raises(ConfigError, match="config.eval.samples=0: expected a whole number >= 1"):
        eval_run(c, str(tmp_path / "nothing"))
