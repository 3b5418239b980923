"""The TPU and GPU launch scripts: syntax, usage errors, and the commands they would run (--dry-run;
gcloud and GPUs are not available here)."""
import os
import shlex
import subprocess

import pytest
from tests.paths import ROOT

REPO = ROOT
TPU, GPU = os.path.join(REPO, "launch/tpu/pod.sh"), os.path.join(REPO, "launch/gpu/run.sh")
FLAGS = ["--config=configs/sciworld.py:cope", "--workdir=/mnt/runs/sci cope", "--config.mesh=(1,-1,1)"]


def _run(*args):
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", [TPU, GPU])
def test_scripts_parse(script):
    assert _run("-n", script).returncode == 0


@pytest.mark.parametrize("args", [(TPU,), (TPU, "bogus"), (TPU, "create", "pod"), (TPU, "train", "pod", "zone"),
                                  (TPU, "train", "pod", "zone", "--"), (GPU,), (GPU, "train", "--num_hosts=2", "--", "x"),
                                  (GPU, "train", "--coordinator=h:1", "--num_hosts=2", "--host_id=2", "--", "x"),
                                  (GPU, "train", "--config=x")])
def test_wrong_arguments_print_usage(args):
    out = _run(*args)
    assert out.returncode == 2 and out.stdout == "" and "--dry-run" in out.stderr


def test_tpu_train_runs_the_same_command_on_every_worker():
    out = _run(TPU, "--dry-run", "train", "my-pod", "us-central2-b", "--", *FLAGS)
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in argv
    remote = shlex.split(next(a for a in argv if a.startswith("--command=")).split("=", 1)[1])
    assert remote[remote.index("&&") + 1:] == [".venv/bin/python", "-m", "launch.train", "--multihost", *FLAGS]


def test_tpu_create_and_setup_commands():
    out = _run(TPU, "--dry-run", "create", "my-pod", "us-central2-b", "v5p-32")
    assert shlex.split(out.stdout)[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "my-pod"]
    assert "--accelerator-type=v5p-32" in out.stdout
    out = _run(TPU, "--dry-run", "setup", "my-pod", "us-central2-b")
    assert out.returncode == 0 and "requirements-tpu.txt" in out.stdout and out.stdout.count("--worker=all") == 3


def test_gpu_host_of_a_multi_host_run():
    out = _run(GPU, "--dry-run", "train", "--coordinator=10.0.0.2:7777", "--num_hosts=2", "--host_id=1", "--", *FLAGS)
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout) == ["env", "JAX_PLATFORMS=cuda", ".venv/bin/python", "-m", "launch.train", "--multihost",
                                       "--coordinator_address=10.0.0.2:7777", "--num_processes=2", "--process_id=1",
                                       *FLAGS]
    single = shlex.split(_run(GPU, "--dry-run", "eval", "--", *FLAGS).stdout)
    assert single == ["env", "JAX_PLATFORMS=cuda", ".venv/bin/python", "-m", "launch.eval", *FLAGS]


def test_accelerator_requirements_pin_the_same_jax():
    pinned = next(l for l in open(os.path.join(REPO, "requirements.txt")) if l.startswith("jax=="))
    version = pinned.strip().split("==")[1]
    for kind, extra in (("tpu", "tpu"), ("gpu", "cuda12")):
        lines = open(os.path.join(REPO, f"requirements-{kind}.txt")).read().split("\n")
        assert f"jax[{extra}]=={version}" in lines and "-r requirements.txt" in lines
    assert f"jax-cuda12-pjrt=={version}" in open(os.path.join(REPO, "requirements-gpu-compiler.txt")).read().split("\n")
    assert "-r requirements-tpu.txt" in open(os.path.join(REPO, "requirements-dev.txt")).read().split("\n")
