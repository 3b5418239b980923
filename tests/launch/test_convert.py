"""launch.convert: HF -> Orbax -> HF is byte-exact and loads in transformers; bad input changes nothing."""
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from cope_jax.run.checkpoint import TrainCheckpointer
from launch import convert
from models import hf_io
from tests.hf_fixtures import TINY_CONFIGS, hf_logits, make_tiny_hf
from tests.paths import ROOT

# case -> (tiny config, dtype, source max_shard_size (None = one file), export max_shard_size)
CASES = {
    "qwen2_tied_fp32_single": ("qwen2_tied_mha", torch.float32, None, "5GB"),
    "qwen2_untied_bf16_multi": ("qwen2_untied_gqa4", torch.bfloat16, "100KB", "100KB"),
    "qwen3_untied_fp32_multi": ("qwen3_untied_gqa4_hd", torch.float32, "150KB", "150KB"),
    "qwen3_tied_bf16_single": ("qwen3_tied_mha_hd", torch.bfloat16, None, "5GB"),
}
# stand-ins for a real tokenizer: the converter must carry them over byte for byte
SIDE_FILES = {"tokenizer_config.json": b'{"model_max_length": 512}\n', "merges.txt": b"#version: 0.2\nh e\n",
              "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}"}


def _make_source(directory, case):
    name, dtype, src_shard, _ = CASES[case]
    family, kw = TINY_CONFIGS[name]
    torch_model = make_tiny_hf(directory, family, seed=len(case), dtype=dtype, **kw)
    if src_shard:  # re-save as several files with an index, as large hub checkpoints come
        os.remove(os.path.join(directory, "model.safetensors"))
        torch_model.to(dtype).save_pretrained(directory, max_shard_size=src_shard)
        torch_model.float()
    for fn, content in SIDE_FILES.items():
        with open(os.path.join(directory, fn), "wb") as f:
            f.write(content)
    return torch_model


def _tensors(directory):
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(safetensors.numpy.load_file(path))
    return out


def _snapshot(path):
    """Everything under `path` (None if absent), to prove a failed run changed nothing."""
    if not os.path.lexists(path):
        return None
    out = {}
    for root, _, files in os.walk(path):
        for fn in files:
            with open(os.path.join(root, fn), "rb") as f:
                out[os.path.relpath(os.path.join(root, fn), path)] = f.read()
    return out


def _leftovers(parent):
    return [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n]


def _roundtrip(case, base):
    src, orbax_dir, out = str(base / "hf"), str(base / "orbax"), str(base / "export")
    torch_model = _make_source(src, case)
    to_orbax = convert.convert("hf_to_orbax", src, orbax_dir)
    to_hf = convert.convert("orbax_to_hf", orbax_dir, out, max_shard_size=CASES[case][3])
    return case, src, orbax_dir, out, torch_model, (to_orbax, to_hf)


@pytest.fixture(scope="module", params=sorted(CASES))
def roundtrip(request, tmp_path_factory):
    return _roundtrip(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3_multi(tmp_path_factory):
    return _roundtrip("qwen3_untied_fp32_multi", tmp_path_factory.mktemp("mesh"))


@pytest.fixture(scope="module")
def qwen2_bf16_multi(tmp_path_factory):
    return _roundtrip("qwen2_untied_bf16_multi", tmp_path_factory.mktemp("train"))


def test_roundtrip_tensors_are_byte_identical(roundtrip):
    case, src, _, out, _, (to_orbax, to_hf) = roundtrip
    dtype = str(CASES[case][1]).removeprefix("torch.")
    assert to_orbax["dtype"] == to_hf["dtype"] == dtype  # default: keep the source dtype
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    assert ("lm_head.weight" in b) == ("untied" in case)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def test_export_loads_in_transformers_with_identical_logits(roundtrip):
    _, src, _, out, torch_model, _ = roundtrip
    # both loaded the same way (a bf16 model kept in memory has bf16-rounded RoPE buffers, a loaded one not)
    original, exported = (transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
                                                                            dtype=torch.float32).eval()
                          for d in (src, out))
    assert type(exported) is type(torch_model)
    tokens = np.random.RandomState(0).randint(0, torch_model.config.vocab_size, (2, 13))
    ref = hf_logits(original, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_equal(hf_logits(exported, tokens), ref)
    src_cfg, out_cfg = (transformers.AutoConfig.from_pretrained(d, local_files_only=True) for d in (src, out))
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "dtype"):
        assert getattr(out_cfg, field) == getattr(src_cfg, field), field
    head_dim = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in (src_cfg, out_cfg)]
    assert head_dim[0] == head_dim[1]
    assert out_cfg.rope_parameters["rope_theta"] == src_cfg.rope_parameters["rope_theta"]


def test_side_files_and_sharded_layout(roundtrip):
    case, src, orbax_dir, out, _, _ = roundtrip
    for d in (orbax_dir, out):
        for fn in (*SIDE_FILES, "generation_config.json"):
            with open(os.path.join(src, fn), "rb") as f1, open(os.path.join(d, fn), "rb") as f2:
                assert f1.read() == f2.read(), (d, fn)
    limit = hf_io.parse_size(CASES[case][3])
    files = sorted(glob.glob(os.path.join(out, "*.safetensors")))
    index_path = os.path.join(out, "model.safetensors.index.json")
    if CASES[case][2] is None:
        assert [os.path.basename(f) for f in files] == ["model.safetensors"]
        assert not os.path.exists(index_path)
        return
    assert len(files) > 1 and os.path.basename(files[0]) == f"model-00001-of-{len(files):05d}.safetensors"
    with open(index_path) as f:
        index = json.load(f)
    tensors = _tensors(out)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for path in files:
        held = safetensors.numpy.load_file(path)
        assert {index["weight_map"][k] for k in held} == {os.path.basename(path)}
        assert len(held) == 1 or sum(t.nbytes for t in held.values()) <= limit


def test_export_from_eight_device_mesh_equals_single_device(qwen3_multi, tmp_path):
    case, src, _, out, _, _ = qwen3_multi
    mesh = models.make_mesh((1, 2, 4))
    sharded_orbax, sharded_out = str(tmp_path / "orbax_mesh"), str(tmp_path / "export_mesh")
    convert.convert("hf_to_orbax", src, sharded_orbax, mesh=mesh)
    convert.convert("orbax_to_hf", sharded_orbax, sharded_out, max_shard_size=CASES[case][3])
    assert _snapshot(sharded_out) == _snapshot(out)  # every file, byte for byte
    # and the Orbax params restore straight into shards of yet another mesh
    model, cfg = models.load_model(sharded_orbax, mesh=models.make_mesh((1, 8, 1)))
    q = model.layers.q_proj[...]
    assert q.sharding.spec == P(None, "fsdp", None, None)
    assert q.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size // 8, cfg.num_heads, cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(models.load_model(src)[0].layers.q_proj[...]))


def test_training_checkpoint_params_export_to_hf(qwen2_bf16_multi, tmp_path):
    _, src, _, _, _, _ = qwen2_bf16_multi
    model, _ = models.load_model(src)
    with TrainCheckpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(7, {"params": nnx.state(model, nnx.Param), "rng": jax.random.key(0)},
                  data_state={"next_index": 3}, config={"method": "cope"})
        ckpt.wait()
        step_dir = ckpt.step_dir(7)
    out = str(tmp_path / "policy")
    with pytest.raises(ValueError, match="config_dir"):
        convert.convert("orbax_to_hf", step_dir, out)
    assert not os.path.exists(out)
    convert.convert("orbax_to_hf", step_dir, out, config_dir=src)
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert os.path.isfile(os.path.join(out, "merges.txt"))


# -- bad input: a clear error and the destination untouched ------------------------------------------------
def _rewrite_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _missing_tensor(d, other):
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def _wrong_shape(d, other):
    _rewrite_tensors(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)}))


def _qwen3_weights_qwen2_config(d, other):
    shutil.copyfile(os.path.join(other, "model.safetensors"), os.path.join(d, "model.safetensors"))


def _truncated(d, other):
    path = os.path.join(d, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)


BAD_SOURCES = {
    "missing_tensor": (_missing_tensor, r"missing: model\.layers\.1\.mlp\.up_proj\.weight"),
    "wrong_shape": (_wrong_shape, r"k_proj\.weight' has shape \(8, 64\), config expects \(16, 64\)"),
    "qwen3_weights_qwen2_config": (_qwen3_weights_qwen2_config, r"another model family"),
    "truncated": (_truncated, r"truncated safetensors file"),
}


@pytest.fixture(scope="module")
def good_sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("good")
    qwen2, qwen3 = str(base / "qwen2"), str(base / "qwen3")
    make_tiny_hf(qwen2, "qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
    make_tiny_hf(qwen3, "qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                 tie_word_embeddings=True)
    return qwen2, qwen3


def _existing_dst(path):
    os.makedirs(path)
    with open(os.path.join(path, "precious.txt"), "w") as f:
        f.write("an earlier export")


@pytest.mark.parametrize("dst_state", ["absent", "existing+overwrite"])
@pytest.mark.parametrize("bad", sorted(BAD_SOURCES))
def test_bad_source_fails_and_leaves_destination_untouched(good_sources, tmp_path, bad, dst_state):
    make_bad, message = BAD_SOURCES[bad]
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(good_sources[0], src)
    make_bad(src, good_sources[1])
    if dst_state != "absent":
        _existing_dst(dst)
    before = _snapshot(dst)
    with pytest.raises(models.CheckpointError, match=message):
        convert.convert("hf_to_orbax", src, dst, overwrite=dst_state != "absent")
    assert _snapshot(dst) == before and not _leftovers(str(tmp_path))


def test_orbax_params_not_matching_config(good_sources, tmp_path):
    orbax_dir, dst = str(tmp_path / "orbax"), str(tmp_path / "dst")
    convert.convert("hf_to_orbax", good_sources[0], orbax_dir)
    cfg_path = os.path.join(orbax_dir, "config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    hf["intermediate_size"] += 8
    with open(cfg_path, "w") as f:
        json.dump(hf, f)
    with pytest.raises(models.CheckpointError, match=r"'layers/up_proj' has shape \(3, 64, 112\), config expects"):
        convert.convert("orbax_to_hf", orbax_dir, dst)
    assert not os.path.exists(dst) and not _leftovers(str(tmp_path))
    with pytest.raises(ValueError, match="is an orbax model directory, but --mode=hf_to_orbax"):
        convert.convert("hf_to_orbax", orbax_dir, dst)


def test_non_empty_destination_needs_overwrite(good_sources, tmp_path):
    dst = str(tmp_path / "dst")
    _existing_dst(dst)
    before = _snapshot(dst)
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert.convert("hf_to_orbax", good_sources[0], dst)
    assert _snapshot(dst) == before
    convert.convert("hf_to_orbax", good_sources[0], dst, overwrite=True)
    assert sorted(os.listdir(dst)) == ["config.json", "generation_config.json", "params"]
    os.makedirs(tmp_path / "empty")  # an empty directory is fine without --overwrite
    convert.convert("hf_to_orbax", good_sources[0], str(tmp_path / "empty"))
    assert not _leftovers(str(tmp_path))


def test_failure_while_writing_keeps_the_old_destination(good_sources, tmp_path, monkeypatch):
    orbax_dir, dst = str(tmp_path / "orbax"), str(tmp_path / "dst")
    convert.convert("hf_to_orbax", good_sources[1], orbax_dir)
    _existing_dst(dst)
    before = _snapshot(dst)
    calls = []
    real_write = hf_io.write_safetensors

    def failing_write(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("No space left on device")
        real_write(path, tensors, metadata)

    monkeypatch.setattr(hf_io, "write_safetensors", failing_write)
    with pytest.raises(OSError, match="No space left"):
        convert.convert("orbax_to_hf", orbax_dir, dst, max_shard_size="20KB", overwrite=True)
    assert len(calls) == 2 and _snapshot(dst) == before and not _leftovers(str(tmp_path))


def test_binary_exit_status_and_messages(good_sources, tmp_path):
    src, dst, out = str(tmp_path / "src"), str(tmp_path / "orbax"), str(tmp_path / "hf")
    shutil.copytree(good_sources[0], src)
    _truncated(src, None)
    cmd = [sys.executable, "-m", "launch.convert", "--mode=hf_to_orbax", f"--src={src}", f"--dst={dst}"]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "convert: error:" in bad.stderr and "truncated safetensors file" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not os.path.exists(dst)
    convert.convert("hf_to_orbax", good_sources[0], dst)
    cmd = [sys.executable, "-m", "launch.convert", "--mode=orbax_to_hf", f"--src={dst}", f"--dst={out}",
           "--dtype=bfloat16", "--max_shard_size=30KB"]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert not [line for line in ok.stderr.splitlines() if line.startswith("I")], ok.stderr  # no library INFO
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["dtype"] == "bfloat16" and "model.safetensors.index.json" in summary["files"]
    ref = _tensors(good_sources[0])
    got = _tensors(out)
    for name, value in ref.items():  # fp32 -> bf16 is the usual round-to-nearest-even cast
        np.testing.assert_array_equal(got[name], value.astype(got[name].dtype))
