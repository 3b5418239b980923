"""The train step under LoRA: gradients reach only the adapters and are the chain rule of the full
model's weight gradient, the frozen base is untouched (and is the reference policy), and the step
on 8 fake devices equals one device."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from cope_jax.batch import batching
from cope_jax.objective import methods
from cope_jax.train import train_step
from models import lora, qwen

CFG = models.QwenConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
LORA = lora.LoraConfig(rank=4, alpha=8)
LOSS = methods.LossConfig(kl_coef=0.05, entropy_coef=0.02, logits_chunk_tokens=16)
ROW_LEN = 64


def _batch(with_ref=True):
    rng = np.random.RandomState(3)
    tokens = [rng.randint(1, 64, n) for n in (40, 33, 27, 50)]
    actions = [np.arange(len(t)) % 3 == 2 for t in tokens]
    advantages = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    terms = ("pg", "kl", "entropy") if with_ref else ("pg",)
    segs = batching.sequence_segments(tokens, actions, advantages, terms, LOSS, row_len=ROW_LEN)
    batch, stats = batching.pack_minibatch(segs, terms, ROW_LEN, rows_per_micro=2)
    return batching.MiniBatch(batch=batch, stats=stats, groups=(0,), num_trajectories=len(tokens), num_examples=0)


def _adapted(mesh=None, perturb=True):
    """A LoRA model whose B is off zero (so A gets a gradient too)."""
    model = qwen.with_adapters(models.create_model(CFG, seed=0, mesh=mesh), LORA)
    if perturb:
        adapters = nnx.state(model, nnx.LoRAParam)
        moved = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(7), a.shape, a.dtype), adapters)
        nnx.update(model, moved if mesh is None else jax.device_put(moved, qwen.state_shardings(moved, mesh)))
    return model


def _flat(state):
    return {qwen.param_path(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(state)}


def test_gradients_reach_only_the_adapters_and_follow_the_chain_rule():
    model = _adapted()
    batch = _batch(with_ref=False).batch
    cfg = dataclasses.replace(LOSS, kl_coef=0.0, entropy_coef=0.0)
    loss, grads, _ = jax.jit(lambda m, b: train_step.loss_and_grads(m, b, cfg, on_policy=True))(model, batch)
    got = _flat(grads)
    assert set(got) == {f"layers/{p}{s}" for p in LORA.targets for s in lora.SUFFIXES}
    # independent: the full model on the merged weights W' = W + s A B; dL/dB = s A^T dL/dW',
    # dL/dA = s dL/dW' B^T (per layer, over the projection's input / output axes)
    merged = qwen.frozen_copy(model)
    merged_loss, full, _ = jax.jit(lambda m, b: train_step.loss_and_grads(m, b, cfg, on_policy=True))(merged, batch)
    np.testing.assert_allclose(float(loss), float(merged_loss), rtol=1e-5)
    full, params = _flat(full), qwen.flat_params(model)
    for proj in LORA.targets:
        ins = len(lora.PROJECTION_AXES[proj][0])
        g = full[f"layers/{proj}"].reshape(CFG.num_layers, -1, *full[f"layers/{proj}"].shape[1 + ins:])
        g = g.reshape(CFG.num_layers, g.shape[1], -1)  # [L, in, out]
        a = np.asarray(params[f"layers/{proj}_lora_a"]).reshape(CFG.num_layers, g.shape[1], LORA.rank)
        b = np.asarray(params[f"layers/{proj}_lora_b"]).reshape(CFG.num_layers, LORA.rank, g.shape[2])
        want_a = LORA.scale * np.einsum("lio,lro->lir", g, b)
        want_b = LORA.scale * np.einsum("lio,lir->lro", g, a)
        scale = max(np.abs(want_a).max(), np.abs(want_b).max())
        assert scale > 1e-4
        np.testing.assert_allclose(got[f"layers/{proj}_lora_a"].reshape(want_a.shape), want_a, atol=2e-3 * scale)
        np.testing.assert_allclose(got[f"layers/{proj}_lora_b"].reshape(want_b.shape), want_b, atol=2e-3 * scale)


def test_a_step_moves_only_the_adapters_and_the_reference_is_the_base():
    model = _adapted(perturb=False)
    base_before = {k: np.asarray(v) for k, v in qwen.flat_params(model).items() if not lora.is_adapter(k)}
    learner = train_step.Learner(model, LOSS, train_step.OptimizerConfig(learning_rate=1e-2))
    moments = [a for a in jax.tree.leaves(nnx.state(learner.optimizer)) if a.ndim > 0]
    assert sum(a.size for a in moments) == 2 * sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    ref = qwen.base_view(model)
    batch = learner.fill_logprobs(_batch().batch, ref, on_policy=True)
    for _ in range(2):
        metrics = learner.step(batch, on_policy=True)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["kl"]) > 0  # the adapters moved off the base
    after = qwen.flat_params(model)
    for k, v in base_before.items():
        assert np.array_equal(np.asarray(after[k]), v), k  # frozen, and never donated
    assert np.abs(np.asarray(model.layers.q_proj_lora_b[...])).max() > 0
    assert ref.layers.q_proj[...] is model.layers.q_proj[...]
    ref_again = learner.logprobs(_batch().batch, ref)
    np.testing.assert_array_equal(np.asarray(ref_again), np.asarray(batch.ref_logp))


@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 2, 2)])
def test_a_lora_step_on_8_devices_equals_one_device(shape):
    mesh = models.make_mesh(shape)
    single, sharded = _adapted(), _adapted(mesh)
    assert sharded.layers.q_proj_lora_b[...].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp", None)
    assert sharded.layers.q_proj_lora_a[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert sharded.layers.q_proj[...].dtype == jnp.float32 == sharded.layers.q_proj_lora_a[...].dtype
    opt = optax.sgd(1.0)  # the update is the gradient (AdamW's first step would be its sign)
    before = _flat(nnx.state(single, nnx.LoRAParam))
    batch = _batch()
    ref_single = qwen.base_view(single)
    m_single = train_step.Learner(single, LOSS, opt).train([batch], ref_single)[0]
    with jax.set_mesh(mesh):
        ref_sharded = qwen.base_view(sharded)
        m_sharded = train_step.Learner(sharded, LOSS, opt, mesh=mesh).train([batch], ref_sharded)[0]
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        np.testing.assert_allclose(m_sharded[key], m_single[key], rtol=1e-5, atol=1e-6)  # pg ~ 0 on policy
    got, want = _flat(nnx.state(sharded, nnx.LoRAParam)), _flat(nnx.state(single, nnx.LoRAParam))
    scale = max(np.abs(want[k] - before[k]).max() for k in want)
    assert scale > 1e-4
    for k in want:
        np.testing.assert_allclose(got[k] - before[k], want[k] - before[k], rtol=1e-4, atol=1e-5 * scale)


def test_lora_steps_learn_a_batch():
    """Behaviour: supervised steps through the adapters alone raise the batch's likelihood."""
    model = _adapted(perturb=False)
    rng = np.random.RandomState(4)
    tokens = [rng.randint(1, 64, n) for n in (30, 41)]
    actions = [np.arange(len(t)) > 4 for t in tokens]
    cfg = methods.LossConfig(rft_coef=1.0, logits_chunk_tokens=16)
    segs = batching.sequence_segments(tokens, actions, np.ones(2, np.float32), ("rft",), cfg, row_len=ROW_LEN)
    batch, _ = batching.pack_minibatch(segs, ("rft",), ROW_LEN, rows_per_micro=2)
    learner = train_step.Learner(model, cfg, train_step.OptimizerConfig(learning_rate=1e-2))
    losses = [float(learner.step(batch)["loss"]) for _ in range(12)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.95 * losses[0], losses
