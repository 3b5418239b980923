"""The TPU and GPU launch scripts: syntax, usage errors, and the commands they would run (--dry-run;
gcloud and GPUs are not available here)."""
import os
import shlex
import subprocess

import pytest
from tests.paths import ROOT

REPO = ROOT
TPU, GPU = os.path.join(REPO, "launch/tpu/pod.sh"), os.path.join(REPO, "launch/gpu/run.sh")
ACCEPT = os.path.join(REPO, "launch/gpu/accept.sh")
FLAGS = ["--config=configs/sciworld.py:cope", "--workdir=/mnt/runs/sci cope", "--config.mesh=(1,-1,1)"]


def _run(*args):
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", [TPU, GPU, ACCEPT])
def test_scripts_parse(script):
    assert _run("-n", script).returncode == 0


@pytest.mark.parametrize("args", [(TPU,), (TPU, "bogus"), (TPU, "create", "pod"), (TPU, "train", "pod", "zone"),
                                  (TPU, "train", "pod", "zone", "--"), (GPU,), (GPU, "train", "--num_hosts=2", "--", "x"),
                                  (GPU, "train", "--coordinator=h:1", "--num_hosts=2", "--host_id=2", "--", "x"),
                                  (GPU, "train", "--config=x"), (ACCEPT,), (ACCEPT, "bogus"), (ACCEPT, "wheels", "x")])
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


def test_gpu_accept_carries_the_pinned_packages_the_image_lacks_and_runs_the_quick_size():
    """`wheels` downloads exactly requirements.txt's pins (and two pinned needs of grain) for the
    image's Python; `run` installs them from .whl alone and runs every section at the quick size,
    and refuses at once without wheels."""
    out = _run(ACCEPT, "--dry-run", "wheels")
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:4] == ["python3", "-m", "pip", "download"] and "--python-version" in argv and "3.12" in argv
    pins = set(open(os.path.join(REPO, "requirements.txt")).read().split())
    specs = argv[argv.index(".whl") + 1:]
    assert {"grain==0.2.18", "tensorboardX==2.6.5"} <= set(specs) and "array-record==0.8.6" in specs
    assert all(s in pins for s in specs if not s.startswith(("array-record", "portpicker"))), specs
    out = _run(ACCEPT, "--dry-run", "run", "--out=/tmp/a")
    install, accept = (shlex.split(line) for line in out.stdout.splitlines())
    assert "--no-index" in install and install[-1] == ".whl/*.whl"
    assert accept == ["python3", "-m", "launch.accept", "--size=quick", "--out=/tmp/a"]
    out = subprocess.run(["bash", ACCEPT, "run"], capture_output=True, text=True, timeout=30,
                         cwd=os.path.join(REPO, "launch"))
    if not os.path.isdir(os.path.join(REPO, ".whl")):
        assert out.returncode == 2 and "accept.sh wheels" in out.stderr
