"""LoRA adapters (models/lora.py) on the model: a fresh adapter changes nothing, the merged export
is what the unmerged model computes and transformers loads it, the decode layout merges them, and a
bad LoRA setting is refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

import models
from launch.convert import convert
from models import hf_io, lora, orbax_io, qwen
from tests.hf_fixtures import hf_logits, make_tiny_hf

TOKENS = np.random.RandomState(0).randint(0, 160, (2, 12)).astype(np.int32)


def _base(tmp_path, family="qwen2", **kw):
    make_tiny_hf(str(tmp_path / "hf"), family, **kw)
    model, _ = models.load_hf_model(str(tmp_path / "hf"), dtype="float32")
    return model


def _perturbed(model, scale=0.1, seed=1):
    """The adapters moved off zero (a trained state): B random too."""
    adapters = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    nnx.update(model, jax.tree.map(lambda a: a + scale * jax.random.normal(next(keys), a.shape, a.dtype), adapters))
    return model


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fresh_adapters_leave_the_logits_identical(tmp_path, family):
    base = _base(tmp_path, family, num_attention_heads=8, num_key_value_heads=2)
    want = np.asarray(base(TOKENS))
    adapted = qwen.with_adapters(base, lora.LoraConfig(rank=4, alpha=16))
    names = set(qwen.flat_params(adapted)) - set(qwen.flat_params(base))
    assert names == {f"layers/{p}{s}" for p in lora.PROJECTIONS for s in lora.SUFFIXES}
    assert np.array_equal(np.asarray(adapted(TOKENS)), want)
    assert adapted.layers.q_proj_lora_a[...].shape == (3, 64, 4)
    assert adapted.layers.o_proj_lora_b[...].shape == (3, 4, 64)
    assert np.abs(np.asarray(adapted.layers.q_proj_lora_a[...])).max() > 0  # A random, B zero
    assert np.abs(np.asarray(adapted.layers.q_proj_lora_b[...])).max() == 0


def test_base_weights_are_stored_in_the_compute_dtype_and_adapters_in_float32(tmp_path):
    make_tiny_hf(str(tmp_path / "hf"), "qwen3")
    base, _ = models.load_hf_model(str(tmp_path / "hf"), dtype="bfloat16")
    adapted = qwen.with_adapters(base, lora.LoraConfig(rank=2), param_dtype="float32")
    dtypes = {k: v.dtype for k, v in qwen.flat_params(adapted).items()}
    assert {dtypes[k] for k in dtypes if lora.is_adapter(k)} == {jnp.dtype("float32")}
    assert {dtypes[k] for k in dtypes if not lora.is_adapter(k)} == {jnp.dtype("bfloat16")}


def test_merged_export_equals_the_unmerged_forward_and_transformers_loads_it(tmp_path):
    base = _base(tmp_path, "qwen2", num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    adapted = _perturbed(qwen.with_adapters(base, lora.LoraConfig(rank=4, alpha=8,
                                                                 targets=("q_proj", "v_proj", "down_proj"))))
    unmerged = np.asarray(adapted(TOKENS))
    assert np.abs(unmerged - np.asarray(base(TOKENS))).max() > 0.1  # the adapters matter
    hf_io.save_hf(adapted, str(tmp_path / "merged"), carry_from=str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    np.testing.assert_allclose(hf_logits(hf, TOKENS), unmerged, rtol=1e-4, atol=1e-4)
    ours, _ = models.load_hf_model(str(tmp_path / "merged"), dtype="float32")
    np.testing.assert_allclose(np.asarray(ours(TOKENS)), unmerged, rtol=1e-5, atol=1e-5)


def test_the_decode_layout_and_a_frozen_copy_merge_the_adapters(tmp_path):
    adapted = _perturbed(qwen.with_adapters(_base(tmp_path), lora.LoraConfig(rank=3)))
    want = np.asarray(adapted(TOKENS))
    cache = models.KVCache.zeros(adapted.cfg, 2, 16)
    n = np.full((2,), TOKENS.shape[1], np.int32)
    h, _ = adapted.decode(TOKENS, n, cache, layer_params=adapted.layer_params())
    np.testing.assert_allclose(np.asarray(adapted.unembed(h, decode_layout=True)), want, rtol=1e-4, atol=1e-4)
    h, _ = adapted.decode(TOKENS, n, cache)  # the stored layout: adapters applied unmerged
    np.testing.assert_allclose(np.asarray(adapted.unembed(h)), want, rtol=1e-5, atol=1e-5)
    copy = qwen.frozen_copy(adapted)
    assert copy.cfg.lora is None and not any(lora.is_adapter(k) for k in qwen.flat_params(copy))
    np.testing.assert_allclose(np.asarray(copy(TOKENS)), want, rtol=1e-5, atol=1e-5)


def test_the_base_view_shares_the_base_arrays(tmp_path):
    base = _base(tmp_path)
    want = np.asarray(base(TOKENS))
    adapted = _perturbed(qwen.with_adapters(base, lora.LoraConfig(rank=2)))
    view = qwen.base_view(adapted)
    assert view.layers.q_proj[...] is adapted.layers.q_proj[...]  # no copy
    assert np.array_equal(np.asarray(view(TOKENS)), want)


def test_convert_writes_a_lora_orbax_model_merged(tmp_path):
    """orbax_to_hf of a model directory saved from a LoRA model: merged safetensors."""
    base = _base(tmp_path)
    adapted = _perturbed(qwen.with_adapters(base, lora.LoraConfig(rank=2)))
    orbax_io.save_orbax(adapted, str(tmp_path / "orbax"), carry_from=str(tmp_path / "hf"))
    convert("orbax_to_hf", str(tmp_path / "orbax"), str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    np.testing.assert_allclose(hf_logits(hf, TOKENS), np.asarray(adapted(TOKENS)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "rank=0: expected a whole number >= 1"),
    (dict(rank=-2), "rank=-2"),
    (dict(rank=4, targets=("q_proj", "x_proj")), "unknown projection 'x_proj'"),
    (dict(rank=4, targets=()), "empty"),
    (dict(rank=4, alpha=-1.0), "alpha=-1.0"),
])
def test_a_bad_lora_setting_is_refused(kwargs, message):
    with pytest.raises(lora.LoraConfigError, match=message):
        lora.LoraConfig(**kwargs)
