"""`python -m launch.generate` as a user runs it: a subprocess on a tiny HF / Orbax model directory."""
import json
import os
import subprocess
import sys

import pytest
import torch

import models
from cope_jax.rollout.chat import ChatFormat
from cope_jax.rollout.tokenizer import load_tokenizer
from models.orbax_io import save_orbax
from tests.hf_fixtures import make_tiny_hf, write_hf_tokenizer_dir
from tests.paths import ROOT



def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 over the real Qwen vocabulary, with the built-in tokenizer's files beside it."""
    directory = str(tmp_path_factory.mktemp("tiny_chat"))
    torch_model = make_tiny_hf(directory, "qwen2", vocab_size=151936, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    write_hf_tokenizer_dir(directory, "qwen2.5")
    return directory, torch_model


def test_chat_greedy_matches_transformers_and_decodes_text(model_dir):
    directory, torch_model = model_dir
    rc, lines, err = _run(f"--model={directory}", "--prompt=Open the door.", "--chat", "--greedy",
                          "--max_new_tokens=6", "--num_samples=2")
    assert rc == 0, err
    tok = load_tokenizer("qwen2.5")
    prompt = ChatFormat(tok, "qwen2.5").render([{"role": "user", "content": "Open the door."}],
                                               add_generation_prompt=True)
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                   eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id)[0, len(prompt):].tolist()
    assert [line["sample"] for line in lines] == [0, 1]
    for line in lines:
        assert line["prompt_tokens"] == len(prompt)
        assert line["ids"] == ref
        assert line["text"] == tok.decode(ref)
        assert line["finish_reason"] == ("eos" if ref[-1] in tok.eos_ids else "length")


def test_orbax_directory_and_prompt_ids_with_sampling(model_dir, tmp_path):
    directory, _ = model_dir
    model, _ = models.load_model(directory)
    orbax_dir = str(tmp_path / "orbax")
    save_orbax(model, orbax_dir, carry_from=directory)
    args = (f"--model={orbax_dir}", "--prompt_ids=1,2,3", "--temperature=0.8", "--top_p=0.9",
            "--max_new_tokens=5", "--num_samples=3", "--seed=4")
    rc, lines, err = _run(*args)
    assert rc == 0, err
    assert len(lines) == 3 and all(len(line["ids"]) == 5 for line in lines)
    assert len({tuple(line["ids"]) for line in lines}) > 1  # independent samples


@pytest.mark.parametrize("args, message", [
    (["--prompt=hi"], "--model"),
    (["--model=/nonexistent/dir", "--prompt=hi"], "existing model directory"),
    (["--model=MODEL"], "prompt"),
    (["--model=MODEL", "--prompt=hi", "--temperature=-1"], "temperature"),
    (["--model=MODEL", "--prompt=hi", "--top_p=1.5"], "top_p"),
    (["--model=MODEL", "--prompt_ids=1,x"], "comma-separated integers"),
    (["--model=MODEL", "--prompt_ids=1,2", "--chat"], "--chat needs a text --prompt"),
    (["--model=MODEL", "--prompt_ids=" + ",".join(["5"] * 600), "--max_new_tokens=4"],
     "the prompt (600 tokens) plus --max_new_tokens=4 exceeds the model's context of 512 tokens"),
    (["--model=MODEL", "--prompt_ids=" + ",".join(["5"] * 500), "--max_new_tokens=20"],
     "use --max_new_tokens<=12"),
])
def test_bad_flags_fail_with_one_line(model_dir, args, message):
    directory, _ = model_dir
    rc, lines, err = _run(*[a.replace("MODEL", directory) for a in args])
    assert rc == 1 and not lines
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_damaged_orbax_directory_is_one_line_naming_it(model_dir, tmp_path):
    """An array file cut in half (a kill mid-copy): one line naming the directory and the short
    file, rc 1, no traceback, no TensorStore spec dump."""
    directory, _ = model_dir
    model, _ = models.load_model(directory)
    orbax_dir = str(tmp_path / "orbax")
    save_orbax(model, orbax_dir, carry_from=directory)
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(orbax_dir, "params")) for f in fs]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    rc, lines, err = _run(f"--model={orbax_dir}", "--prompt_ids=1,2,3", "--max_new_tokens=2")
    assert rc == 1 and lines == [] and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"generate: error: {orbax_dir}: the Orbax params are unreadable: "), err
    assert "TensorStore details" not in err and "is not valid for value of size" in err, err
