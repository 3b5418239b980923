"""Qwen2/Qwen3 NNX forward against transformers (torch CPU) on tiny random checkpoints."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import qwen
from tests.hf_fixtures import TINY_CONFIGS, hf_logits, make_tiny_hf


@pytest.fixture
def rng():
    """Each test's own tokens: a module-wide generator's draws depend on which tests ran before."""
    return np.random.RandomState(0)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    family, kw = TINY_CONFIGS[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    torch_model = make_tiny_hf(directory, family, **kw)
    model, cfg = models.load_hf_model(directory)
    return directory, torch_model, model, cfg


def _forward(model, tokens, segment_ids=None, positions=None):
    return np.asarray(nnx.jit(lambda m, t, s, p: m(t, positions=p, segment_ids=s))(
        model, jnp.asarray(tokens), None if segment_ids is None else jnp.asarray(segment_ids),
        None if positions is None else jnp.asarray(positions)))


def test_logits_match_transformers(tiny, rng):
    _, torch_model, model, cfg = tiny
    tokens = rng.randint(0, cfg.vocab_size, (3, 17))
    ref = hf_logits(torch_model, tokens)
    out = _forward(model, tokens)
    assert out.shape == (3, 17, cfg.vocab_size) and out.dtype == np.float32
    assert np.abs(ref).max() > 1.0  # the weights are large enough for errors to show
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_transformers(tiny, rng, side):
    _, torch_model, model, cfg = tiny
    lengths, T = [13, 7, 2], 13
    tokens = rng.randint(0, cfg.vocab_size, (3, T))
    mask = np.zeros((3, T), np.int32)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    if side == "left":
        mask = mask[:, ::-1].copy()
    ref = hf_logits(torch_model, tokens, mask)
    out = _forward(model, tokens, segment_ids=mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0)


def test_packed_rows_equal_sequences_alone(tiny, rng):
    _, _, model, cfg = tiny
    seqs = [rng.randint(0, cfg.vocab_size, n) for n in (9, 4, 6)]
    row = np.concatenate(seqs + [np.zeros(5, np.int64)])[None]
    seg = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(seqs)] + [np.zeros(5)])[None]
    packed = _forward(model, row, segment_ids=seg.astype(np.int32))[0]
    start = 0
    for s in seqs:
        alone = _forward(model, s[None])[0]
        np.testing.assert_allclose(packed[start:start + len(s)], alone, atol=2e-5, rtol=0)
        start += len(s)


def test_branches_see_their_prefix_of_the_trunk_only(tiny, rng):
    """A tree segment (trunk + branches continuing its prefixes) computes each branch as the
    sequence prefix + branch would alone; the trunk is unaffected by its branches."""
    _, _, model, cfg = tiny
    trunk = rng.randint(0, cfg.vocab_size, 12)
    branches = [(5, rng.randint(0, cfg.vocab_size, 4)), (9, rng.randint(0, cfg.vocab_size, 3)),
                (5, rng.randint(0, cfg.vocab_size, 2))]
    tokens = np.concatenate([rng.randint(0, cfg.vocab_size, 3), trunk] + [b for _, b in branches] + [[0, 0]])
    seg = np.r_[[1] * 3, [2] * (len(tokens) - 5), [0, 0]]
    branch_ids = np.r_[[0] * 15, np.concatenate([np.full(len(b), i + 1) for i, (_, b) in enumerate(branches)]),
                       [0, 0]]
    pos = np.r_[np.arange(3), np.arange(12), np.concatenate([p + np.arange(len(b)) for p, b in branches]), [0, 0]]
    packed = np.asarray(nnx.jit(lambda m, t, s, p, b: m.unembed(m.hidden_states(t, p, s, b)))(
        model, *(jnp.asarray(a[None], jnp.int32) for a in (tokens, seg, pos, branch_ids))))[0]
    np.testing.assert_allclose(packed[3:15], _forward(model, trunk[None])[0], atol=2e-5, rtol=0)
    start = 15
    for p, b in branches:
        alone = _forward(model, np.concatenate([trunk[:p], b])[None])[0]
        np.testing.assert_allclose(packed[start:start + len(b)], alone[p:], atol=2e-5, rtol=0)
        start += len(b)


def test_scanned_looped_and_remat_are_identical(tiny, rng):
    directory, _, model, cfg = tiny
    looped, _ = models.load_hf_model(directory, scan_layers=False)
    remat, _ = models.load_hf_model(directory, remat="full")
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 11)))
    np.testing.assert_allclose(_forward(looped, tokens), _forward(model, tokens), atol=1e-5, rtol=0)

    def loss(m, t):
        return jnp.mean(jax.nn.log_softmax(m(t))[..., 0])

    grads = [nnx.jit(nnx.grad(loss))(m, tokens) for m in (model, looped, remat)]
    flat = [jax.tree.leaves(g) for g in grads]
    for other in flat[1:]:
        for a, b in zip(flat[0], other):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_bf16_close_to_fp32(tiny):
    directory, _, model, cfg = tiny
    bf16, _ = models.load_hf_model(directory, dtype="bfloat16")
    assert bf16.layers.q_proj[...].dtype == jnp.bfloat16
    tokens = np.random.RandomState(16).randint(0, cfg.vocab_size, (2, 16))
    lp32 = jax.nn.log_softmax(_forward(model, tokens))
    lp16 = jax.nn.log_softmax(_forward(bf16, tokens))
    kl = np.sum(np.exp(lp32) * (lp32 - lp16), axis=-1)
    assert kl.max() < 1e-3, kl.max()
    assert kl.max() > 0  # really computed in bf16


def test_a_frozen_copy_computes_exactly_what_the_model_does(tiny, rng):
    """The reference policy and a host's sampler replica keep their weights in the compute dtype:
    half the memory of float32 parameters, the same outputs bit for bit (every weight is cast to
    the compute dtype where it is used), on one device and sharded over 8."""
    directory, _, _, cfg = tiny
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (4, 12)))
    for mesh in (None, models.make_mesh((1, 4, 2))):
        model, _ = models.load_hf_model(directory, dtype="bfloat16", param_dtype="float32", mesh=mesh)
        frozen = qwen.frozen_copy(model)
        pairs = list(zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(frozen, nnx.Param))))
        assert all(a.dtype == jnp.float32 and b.dtype == jnp.bfloat16 for a, b in pairs)
        assert all(a.sharding == b.sharding for a, b in pairs)
        np.testing.assert_array_equal(_forward(frozen, tokens), _forward(model, tokens))


@pytest.mark.parametrize("decode_layout", [False, True])
def test_kv_cache_prefill_decode_equals_full_forward(tiny, rng, decode_layout):
    """Stored layout (scanned stacked weights) and the decode layout (per-layer fused [out, in]
    matrices, the sampler's CPU path) both equal the full forward."""
    _, _, model, cfg = tiny
    T = 12
    tokens = rng.randint(0, cfg.vocab_size, (2, T))
    full = _forward(model, tokens)
    prompt_len = np.array([5, 3])
    cache = models.KVCache.zeros(cfg, batch=2, max_len=16)
    layer_params = model.layer_params() if decode_layout else None
    step = nnx.jit(lambda m, t, n, c, w: m.decode(t, n, c, w))
    unembed = jax.jit(lambda h: model.unembed(h, decode_layout=decode_layout))
    h, cache = step(model, jnp.asarray(tokens[:, :5]), jnp.asarray(prompt_len), cache, layer_params)
    logits = np.asarray(unembed(h))
    for b in range(2):
        np.testing.assert_allclose(logits[b, :prompt_len[b]], full[b, :prompt_len[b]], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_len)
    # one token per step; row b continues from its own length
    for _ in range(4):
        pos = np.asarray(cache.lengths)
        nxt = tokens[np.arange(2), pos][:, None]
        h, cache = step(model, jnp.asarray(nxt), jnp.ones(2, jnp.int32), cache, layer_params)
        logits = np.asarray(unembed(h))[:, 0]
        np.testing.assert_allclose(logits, full[np.arange(2), pos], atol=1e-4, rtol=0)


def test_positions_from_segments():
    seg = np.array([[0, 0, 1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(np.asarray(qwen.positions_from_segments(seg)), [[0, 1, 0, 1, 2, 0, 1, 0]])
