"""Parameters really sharded on 8 fake CPU devices, and sharded logits equal single-device logits."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from models import sharding as shd
from tests.hf_fixtures import make_tiny_hf

MESHES = {"fsdp2_tp4": (1, 2, 4), "fsdp8": (1, 8, 1)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3_shard"))
    make_tiny_hf(d, "qwen3", num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                 tie_word_embeddings=False)
    return d


def _logits(model, tokens, mesh=None):
    tokens = shd.shard_batch(tokens, mesh)
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def test_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_loaded_params_are_sharded_and_logits_match(checkpoint, mesh_name):
    shape = MESHES[mesh_name]
    mesh = models.make_mesh(shape)
    ref_model, cfg = models.load_hf_model(checkpoint)
    model, _ = models.load_hf_model(checkpoint, mesh=mesh)
    fsdp, tp = shape[1], shape[2]
    q = model.layers.q_proj[...]
    expected = P(None, "fsdp", "tp", None) if tp > 1 else P(None, "fsdp", None, None)
    assert q.sharding.spec == expected
    # every device holds only its block of q_proj
    assert len(q.addressable_shards) == 8
    assert q.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size // fsdp,
                                                  cfg.num_heads // tp, cfg.head_dim)
    emb = model.embed[...]
    assert emb.sharding.spec == (P("tp", "fsdp") if tp > 1 else P(None, "fsdp"))
    assert emb.addressable_shards[0].data.shape == (cfg.vocab_size // tp, cfg.hidden_size // fsdp)
    down = model.layers.down_proj[...]
    assert down.addressable_shards[0].data.size == down.size // 8
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (8, 12))
    with jax.set_mesh(mesh):
        sharded = _logits(model, tokens, mesh)
    np.testing.assert_allclose(sharded, _logits(ref_model, tokens), atol=1e-5, rtol=0)


def test_random_init_is_created_sharded():
    cfg = models.QwenConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    mesh = models.make_mesh((1, 2, 4))
    model = models.create_model(cfg, mesh=mesh, seed=3)
    single = models.create_model(cfg, seed=3)
    up = model.layers.up_proj[...]
    assert up.sharding.spec == P(None, "fsdp", "tp")
    # 2 KV heads cannot split over tp=4: that dim falls back to replication, the rest stays sharded
    assert model.layers.k_proj[...].sharding.spec == P(None, "fsdp", None, None)
    np.testing.assert_array_equal(np.asarray(up), np.asarray(single.layers.up_proj[...]))


def test_logical_rules_drop_only_non_dividing_axes():
    mesh = models.make_mesh((2, 2, 2))
    assert shd.logical_to_spec(("batch", "seq"), (8, 5), mesh) == P(("data", "fsdp"), None)
    assert shd.logical_to_spec(("batch", "seq"), (2, 5), mesh) == P("data", None)
    assert shd.logical_to_spec(("vocab", "embed"), (6, 4), mesh) == P("tp", "fsdp")
    assert shd.logical_to_spec(("vocab", "embed"), (5, 4), mesh) == P(None, "fsdp")
    with pytest.raises(KeyError):
        shd.logical_to_spec(("nonsense",), (4,), mesh)


@pytest.mark.parametrize("tx", ["adamw", "adafactor"])
def test_an_optimizer_state_is_laid_out_like_its_parameters_whatever_the_transform(tx):
    """AdamW's moments take their parameter's layout (found by the path they end with); a factored
    optimizer's statistics, shaped otherwise, are replicated instead of refused."""
    import optax

    from models import qwen

    cfg = models.QwenConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6,
                            tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
    mesh = shd.make_mesh((1, 2, 4))

    def build():
        model = qwen.Qwen(cfg, rngs=nnx.Rngs(0), mesh=mesh)
        return model, nnx.Optimizer(model, getattr(optax, tx)(1e-3), wrt=nnx.Param)

    _, state = nnx.split(nnx.eval_shape(build))
    layout = {qwen.param_path(p): s.spec for p, s in
              jax.tree_util.tree_leaves_with_path(qwen.state_shardings(state, mesh))}
    q_proj = layout["0/layers/q_proj"]
    assert q_proj == P(None, "fsdp", "tp", None)
    moments = [k for k in layout if k.startswith("1/") and k.endswith("/layers/q_proj")]
    if tx == "adamw":
        assert len(moments) == 2 and all(layout[k] == q_proj for k in moments)  # mu and nu
    else:
        assert all(layout[k] == P() for k in moments if len(layout[k]) != 4)
        assert any(spec == P() for k, spec in layout.items() if k.startswith("1/"))
