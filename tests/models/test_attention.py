"""Every attention implementation against `dense` (itself checked against transformers in
test_model): packed rows with several segments, padding and tree branches, GQA, a KV cache, bf16,
8 sharded devices; and the memory blockwise saves, read from the compiler."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import attention as attn
from models import loops, presets
from models import sharding as shd
from tests.hf_fixtures import hf_logits, make_tiny_hf
from tests.paths import ROOT


def _packed_row(rng, T: int):
    """A row of several segments, one a tree (trunk + two branches), then padding: (segment_ids,
    positions, branch_ids) [T]."""
    seg, pos, br = [], [], []
    sid = 0
    while len(seg) < T - 9:
        sid += 1
        n = int(rng.randint(5, 40))
        if sid == 2:  # a tree: trunk of n, branches continuing its prefixes of 3 and n - 2 tokens
            branches = [(3, 4), (n - 2, 5)]
            seg += [sid] * (n + 9)
            pos += list(range(n)) + [p + t for p, m in branches for t in range(m)]
            br += [0] * n + [1] * 4 + [2] * 5
        else:
            seg += [sid] * n
            pos += list(range(n))
            br += [0] * n
    pad = T - len(seg)
    if pad < 0:
        return _packed_row(rng, T)
    return (np.r_[seg, [0] * pad], np.r_[pos, range(pad)], np.r_[br, [0] * pad])


def _batch(seed: int, B=2, T=83):
    rng = np.random.RandomState(seed)
    rows = [_packed_row(rng, T) for _ in range(B)]
    return attn.packed_ids(*(jnp.asarray(np.stack([r[i] for r in rows]), jnp.int32) for i in range(3)))


def _qkv(seed, B, T, S, H, K, D, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (B, T, H, D), dtype), jax.random.normal(k2, (B, S, K, D), dtype),
            jax.random.normal(k3, (B, S, K, D), dtype))


def _value_and_grads(fn, q, k, v):
    w = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)  # a loss that weighs every output

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    out = jax.jit(fn)(q, k, v)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


# (implementation, tokens, block): the kernels' blocks are multiples of 128, so their rows are longer
# to span several blocks; here both kernels (TPU's, GPU's) run in Pallas interpret mode. `dense` with
# a block scores each query block against its causal prefix only
BLOCKED = [("blockwise", 83, 16), ("pallas-tpu", 300, 128), ("pallas-gpu", 300, 128), ("dense", 83, 16)]


def _blocked(implementation: str, block: int, mesh=None):
    """blockwise, dense in query blocks, or pallas with the named platform's kernel in interpret mode."""
    if implementation == "dense":
        return lambda q, k, v, ids: attn.dense(q, k, v, ids, block=block)
    kernel = None if implementation == "blockwise" else attn.Kernel(implementation.split("-")[1], True, mesh)
    return lambda q, k, v, ids: attn.blockwise(q, k, v, ids, block=block, kernel=kernel)


@pytest.mark.parametrize("implementation,T,block", BLOCKED)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (7, 1, 128), (4, 2, 64)])
def test_blocked_implementations_equal_dense_on_packed_rows(heads, kv_heads, head_dim, implementation, T, block):
    """T not a multiple of the block, segments, a tree, padding; outputs and all three gradients
    within 1e-5."""
    ids = _batch(heads, T=T)
    q, k, v = _qkv(heads, 2, T, T, heads, kv_heads, head_dim)
    fn = _blocked(implementation, block)
    want, want_g = _value_and_grads(lambda q, k, v: attn.dense(q, k, v, ids), q, k, v)
    got, got_g = _value_and_grads(lambda q, k, v: fn(q, k, v, ids), q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for g, w in zip(got_g, want_g):
        assert np.abs(w).max() > 0.1
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (7, 1, 128)])
def test_the_gpu_backward_kernels_equal_blockwise_on_packed_rows_with_a_tree(heads, kv_heads, head_dim):
    """The GPU kernel's own backward (dK / dV and dQ passes, interpret mode) against blockwise's XLA
    backward: segments, a forecasting tree, padding, GQA; all three gradients within 1e-5."""
    T, block = 300, 128
    ids = _batch(heads + 1, T=T)
    q, k, v = _qkv(heads + 1, 2, T, T, heads, kv_heads, head_dim)
    gpu = _blocked("pallas-gpu", block)
    grad_fn = jax.grad(lambda q, k, v: jnp.sum(gpu(q, k, v, ids)), argnums=(0, 1, 2))
    assert str(jax.make_jaxpr(grad_fn)(q, k, v)).count("pallas_call") == 3  # forward, dK / dV, dQ
    want, want_g = _value_and_grads(lambda q, k, v: attn.blockwise(q, k, v, ids, block=block), q, k, v)
    got, got_g = _value_and_grads(lambda q, k, v: gpu(q, k, v, ids), q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for g, w in zip(got_g, want_g):
        assert np.abs(w).max() > 0.1
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_the_tree_mask_is_the_trunk_prefix_rule():
    """The rule itself, on a hand-written tree: branch tokens see the trunk before their first
    position and their own branch; the trunk never sees a branch."""
    seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 2, 2]])
    br = jnp.asarray([[0, 0, 0, 0, 1, 1, 2, 0, 0]])
    pos = jnp.asarray([[0, 1, 2, 3, 2, 3, 1, 0, 1]])
    mask = np.asarray(attn.dense_mask(attn.packed_ids(seg, pos, br)))[0].astype(int)
    want = np.array([[1, 0, 0, 0, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 1, 0, 0, 0, 0],  # branch 1 from position 2: trunk 0..1, itself
                     [1, 1, 0, 0, 1, 1, 0, 0, 0],
                     [1, 0, 0, 0, 0, 0, 1, 0, 0],  # branch 2 from position 1: trunk 0 only
                     [0, 0, 0, 0, 0, 0, 0, 1, 0],
                     [0, 0, 0, 0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize("implementation,block", [("blockwise", 16), ("pallas-tpu", 128), ("pallas-gpu", 128)])
def test_blocked_implementations_equal_dense_over_a_kv_cache(implementation, block):
    """The sampler's prefill: 37 queries per row at different cache offsets over 300 slots."""
    positions = jnp.asarray([np.arange(37), 250 + np.arange(37)], jnp.int32)
    ids = attn.CacheIds(positions, jnp.full((2,), 300)).mask_ids(300)
    q, k, v = _qkv(1, 2, 37, 300, 4, 2, 64)
    want = attn.dense(q, k, v, ids)
    np.testing.assert_allclose(_blocked(implementation, block)(q, k, v, ids), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation,block", [("blockwise", 8), ("pallas-tpu", 128), ("pallas-gpu", 128)])
def test_a_query_that_sees_nothing_gives_zero_and_finite_gradients(implementation, block):
    seg = jnp.asarray([[1, 1, 2, 2]])
    ids = attn.packed_ids(seg, jnp.asarray([[0, 1, 0, 1]]))
    ids = ids.replace(q_segment=ids.q_segment.at[0, 3].set(7))  # query 3's segment has no keys
    q, k, v = _qkv(2, 1, 4, 4, 2, 1, 64)
    fn = _blocked(implementation, block)
    out, grads = _value_and_grads(lambda q, k, v: fn(q, k, v, ids), q, k, v)
    np.testing.assert_array_equal(out[0, 3], 0.0)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("implementation,T,block", BLOCKED)
def test_bf16_blocked_implementations_are_as_close_to_float32_as_dense(implementation, T, block):
    ids = _batch(5, T=T)
    q, k, v = _qkv(5, 2, T, T, 4, 2, 64)
    ref = attn.dense(q, k, v, ids)
    low = [q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)]
    err_dense = np.abs(np.asarray(attn.dense(*low, ids), np.float32) - ref).max()
    err_block = np.abs(np.asarray(_blocked(implementation, block)(*low, ids), np.float32) - ref).max()
    assert 0 < err_block <= 1.5 * err_dense + 1e-3, (err_block, err_dense)


@pytest.mark.parametrize("implementation,T,block", BLOCKED)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sharded_over_eight_devices_equals_one(implementation, T, block, kv_heads):
    """Batch over fsdp, heads over tp (the model's constraints); the kernel runs in `shard_map`,
    by KV head where tp divides them (4), else by query group (2 KV heads, tp 4)."""
    mesh = models.make_mesh((1, 2, 4))
    ids = _batch(3, T=T)
    q, k, v = _qkv(3, 2, T, T, 8, kv_heads, 64)
    want, want_g = _value_and_grads(lambda q, k, v: _blocked(implementation, block)(q, k, v, ids), q, k, v)
    put = [jax.device_put(x, shd.named_sharding(("batch", "seq", "q_heads", "head_dim"), x.shape, mesh))
           for x in (q, k, v)]
    assert len(put[0].sharding.device_set) == 8 and put[0].addressable_shards[0].data.shape == (1, T, 2, 64)
    fn = _blocked(implementation, block, mesh)
    with jax.set_mesh(mesh):
        got, got_g = _value_and_grads(lambda q, k, v: fn(q, k, v, ids), *put)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_blockwise_skips_the_blocks_after_the_diagonal_and_keeps_memory_per_block():
    """The compiler's own numbers at 4,096 tokens: blockwise's temporaries are a small fraction of
    dense's (no [T, S] array), and its FLOPs about half (pairs above the diagonal never run)."""
    T, H, D = 4096, 2, 64
    ids = attn.packed_ids(jnp.ones((1, T), jnp.int32), jnp.arange(T)[None])
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, T, H, D), (1, T, H, D), (1, T, H, D)))

    def compiled(fn):
        return jax.jit(fn).lower(q, k, v).compile()

    dense = compiled(lambda q, k, v: attn.dense(q, k, v, ids))
    block = compiled(lambda q, k, v: attn.blockwise(q, k, v, ids, block=512))
    mem = [c.memory_analysis().temp_size_in_bytes for c in (dense, block)]
    assert mem[1] * 10 < mem[0], mem
    with loops.unrolled("attention"):  # one pair's cost: the unrolled-by-two program minus the rolled
        two = compiled(lambda q, k, v: attn.blockwise(q, k, v, ids, block=512))
    with loops.unrolled("attention", True):  # every pair in line: what the extrapolation must give
        flat = compiled(lambda q, k, v: attn.blockwise(q, k, v, ids, block=512))
    flops = [c.cost_analysis()["flops"] for c in (dense, block, two, flat)]
    pairs = 8 * 9 // 2
    total = flops[1] + (pairs - 1) * (flops[2] - flops[1]) / loops.trips_counted(pairs)
    assert total == pytest.approx(flops[3], rel=0.01)
    assert 0.5 < total / flops[0] < 0.6, flops  # 36 of 64 pairs


# -- through the model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_attn"))
    torch_model = make_tiny_hf(directory, "qwen3", num_attention_heads=7, num_key_value_heads=1, head_dim=32)
    return directory, torch_model


@pytest.mark.parametrize("implementation,block", [("blockwise", 8), ("pallas", 128), ("dense", 8)])
def test_model_with_a_blocked_implementation_matches_transformers_and_dense(tiny_dir, implementation, block):
    directory, torch_model = tiny_dir
    dense, cfg = models.load_hf_model(directory, attention="dense")
    block, _ = models.load_hf_model(directory, attention=implementation, attention_block=block)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 29))
    mask = np.ones((2, 29), np.int32)
    mask[1, 20:] = 0
    fwd = nnx.jit(lambda m, t, s: m(t, segment_ids=s))
    got = np.asarray(fwd(block, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask == 1], hf_logits(torch_model, tokens, mask)[mask == 1], atol=1e-4, rtol=0)

    def loss(m, t, s):
        return jnp.mean(jax.nn.log_softmax(m(t, segment_ids=s))[..., 0] * s)

    grads = [jax.tree.leaves(nnx.jit(nnx.grad(loss))(m, jnp.asarray(tokens), jnp.asarray(mask)))
             for m in (dense, block)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_prefill_through_blockwise_then_dense_decode(tiny_dir):
    """A cache prefilled with blockwise chunks (auto picks dense for the one-token steps) gives the
    full forward's logits."""
    directory, _ = tiny_dir
    model, cfg = models.load_hf_model(directory, attention="auto", attention_block=8)
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 30))
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    cache = models.KVCache.zeros(cfg, batch=2, max_len=40)
    step = nnx.jit(lambda m, t, n, c: m.decode(t, n, c))
    h, cache = step(model, jnp.asarray(tokens[:, :20]), jnp.asarray([20, 13]), cache)
    logits = np.asarray(model.unembed(h))
    np.testing.assert_allclose(logits[0], full[0, :20], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, :13], full[1, :13], atol=1e-4, rtol=0)
    h, cache = step(model, jnp.asarray(tokens[:, 20:29]), jnp.asarray([9, 9]), cache)  # a second chunk
    np.testing.assert_allclose(np.asarray(model.unembed(h))[0], full[0, 20:29], atol=1e-4, rtol=0)
    h, _ = step(model, jnp.asarray(tokens[:, 29:30]), jnp.asarray([1, 0]), cache)
    np.testing.assert_allclose(np.asarray(model.unembed(h))[0, 0], full[0, 29], atol=1e-4, rtol=0)


def test_unknown_implementation_is_a_config_error():
    with pytest.raises(models.ConfigError, match="attention must be one of"):
        presets.preset_config("Qwen3-8B", attention="flash")


def test_auto_takes_a_kernel_on_tpu_and_gpu_and_dense_for_one_block():
    assert attn.choose("auto", 4096, 4096, 128, 512, True, "tpu") == "pallas"
    assert attn.choose("auto", 4096, 4096, 128, 512, True, "gpu") == "pallas"
    assert attn.choose("auto", 4096, 4096, 96, 512, True, "gpu") == "blockwise"  # Triton: power-of-two heads
    assert attn.choose("auto", 4096, 4096, 128, 512, True, "cpu") == "blockwise"
    assert attn.choose("auto", 1, 4096, 128, 512, False, "tpu") == "dense"
    assert attn.choose("auto", 300, 300, 128, 512, True, "tpu") == "dense"
    assert attn.choose("auto", 4096, 4096, 96, 512, True, "tpu") == "blockwise"  # head_dim not a lane divisor
    assert attn.choose("pallas", 4096, 4096, 128, 200, True, "tpu") == "blockwise"  # blocks not whole lanes
    assert attn.choose("pallas", 4096, 4096, 128, 512, True, "cpu") == "pallas"  # interpret mode


@pytest.mark.parametrize("topology,call", [("v5p-8", "tpu_custom_call"), ("8xH100", "triton")])
def test_the_kernel_compiles_for_its_accelerator(topology, call):
    """Compiled ahead of time by the real TPU / CUDA compiler (no accelerator here) under a mesh of
    the target's devices, the forward and its gradient: auto takes the platform's kernel (one custom
    call per device), its working set stays per block, and (TPU) the compiler counts the kernel's
    FLOPs from its cost estimate."""
    from cope_jax.plan import targets

    devices = targets.devices(targets.get_target(topology))
    mesh = models.make_mesh((1, len(devices) // 2, 2), devices=devices)
    B, T, H, K, D = 4, 4096, 4, 2, 128
    qkv = [jax.ShapeDtypeStruct((B, T, n, D), jnp.bfloat16, sharding=shd.named_sharding(
        ("batch", "seq", "q_heads", "head_dim"), (B, T, n, D), mesh)) for n in (H, K, K)]
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=shd.named_sharding(("batch", None), (B, T), mesh))

    def forward(q, k, v, seg, pos, br):
        return attn.attention(q, k, v, attn.packed_ids(seg, pos, br), implementation="auto", block=512, mesh=mesh)

    lowered = jax.jit(forward).lower(*qkv, ids, ids, ids)
    assert call in lowered.as_text()
    compiled = lowered.compile()
    rows = B // (len(devices) // 2)
    q_bytes = rows * T * (H // 2) * D * 2  # a device's share of q
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * q_bytes  # blockwise's loop holds > 4
    if topology.startswith("v"):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        pairs = 8 * 9 // 2  # 4,096 tokens in blocks of 512: the pairs on and below the diagonal
        per_device = rows * (H // 2) * pairs * 512 * 512 * D * 4  # q.k and p.v of every pair
        assert per_device <= cost["flops"] < 1.1 * per_device
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    lowered = grads.lower(*qkv, ids, ids, ids)
    # the GPU backward is two kernels of its own (dK / dV, dQ) beside the forward; the TPU's is XLA
    kernels = lowered.as_text().count(call)
    assert kernels == (3 if call == "triton" else 1), kernels
    lowered.compile()


def test_the_attention_bench_puts_blockwise_next_to_dense():
    """`launch.bench --suite=attention` at one short row: a line per implementation run on this
    backend (no kernel off TPU) and a ratio line read from the compiler's memory."""
    import json
    import subprocess
    import sys

    root = ROOT
    out = subprocess.run([sys.executable, "-m", "launch.bench", "--suite=attention", "--attention_tokens=1024",
                          "--attention_repeats=1"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    runs = {x["implementation"]: x for x in lines if "kind" not in x}
    assert set(runs) == {"dense", "blockwise"} and all(x["seconds"] > 0 for x in runs.values())
    (ratio,) = [x for x in lines if x.get("kind") == "ratio"]
    assert ratio["implementation"] == "blockwise"
    assert ratio["temp_ratio"] == pytest.approx(runs["blockwise"]["temp_gb"] / runs["dense"]["temp_gb"], abs=1e-3)
    assert ratio["temp_ratio"] < 0.5


@pytest.mark.parametrize("T,block", [(1, 64), (37, 64), (5, 300), (1, 512)])
def test_the_cache_loop_equals_dense_over_the_filled_slots(T, block):
    """Rows at different lengths in a window of 300 slots (blocks of 64: the last one overlaps the
    one before), one row appending nothing: every query that counts gets dense's output."""
    S = 300
    filled = np.array([40, 300, 0, 170])
    positions = jnp.asarray(np.maximum(filled - T, 0)[:, None] + np.arange(T)[None], jnp.int32)
    ids = attn.CacheIds(positions, jnp.asarray(filled, jnp.int32))
    q, k, v = _qkv(4, 4, T, S, 4, 2, 64)
    want = np.asarray(attn.dense(q, k, v, ids.mask_ids(S)))
    got = np.asarray(jax.jit(lambda q, k, v: attn.cache_loop(q, (k[None], v[None]), 0, ids, block=block)[0])(q, k, v))
    used = filled > 0
    np.testing.assert_allclose(got[used], want[used], atol=1e-5, rtol=0)


def _decode_case(seed, B, S, H, K, D, L=3):
    """A decode step's q [B, 1, H, D] over a stacked cache of L layers, rows at different fills
    (the third appends nothing: its output is unused)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, 1, H, D))
    k, v = (jax.random.normal(key, (L, B, S, K, D)) for key in ks[1:])
    filled = np.array([40, S, 0, 170, 1, 65, 128, 7][:B])
    ids = attn.CacheIds(jnp.asarray(np.maximum(filled - 1, 0)[:, None], jnp.int32), jnp.asarray(filled, jnp.int32))
    return q, (k, v), ids, filled > 0


@pytest.mark.parametrize("B,S,H,K", [(4, 256, 7, 1), (2, 1024, 4, 2), (8, 256, 8, 4)])
def test_the_gpu_decode_kernel_equals_the_cache_loop(B, S, H, K):
    """Pallas interpret mode, a traced layer of a stacked cache, key splits (a split past a row's
    fill does nothing, one holds the row's last slot), query groups padded to Triton's 16 rows:
    every row that appends a token gets the cache loop's output."""
    q, kv, ids, used = _decode_case(B + K, B, S, H, K, 64)
    want = np.asarray(attn.cache_loop(q, kv, 1, ids, block=64)[0])
    got = np.asarray(jax.jit(lambda q, kv, layer: attn.gpu_decode(q, kv, layer, ids, interpret=True))(
        q, kv, jnp.int32(1)))
    assert got.shape == q.shape
    np.testing.assert_allclose(got[used], want[used], atol=1e-5, rtol=0)


def test_the_gpu_decode_kernel_sharded_over_eight_devices_equals_one():
    """Rows over fsdp, KV heads over tp where they divide: each device decodes its rows and heads
    of the cache where it lies."""
    mesh = models.make_mesh((1, 2, 4))
    q, kv, ids, used = _decode_case(5, 8, 256, 8, 4, 64)
    want = np.asarray(attn.gpu_decode(q, kv, 2, ids, interpret=True))
    kv = tuple(jax.device_put(a, shd.named_sharding(attn.CACHE_AXES, a.shape, mesh)) for a in kv)
    assert kv[0].addressable_shards[0].data.shape == (3, 4, 256, 1, 64)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(lambda q, kv: attn.gpu_decode(q, kv, 2, ids, mesh=mesh, interpret=True))(q, kv))
    np.testing.assert_allclose(got[used], want[used], atol=1e-5, rtol=0)


def test_the_cache_loop_reads_only_the_longest_rows_blocks():
    """The loop's trip count is the longest row's filled blocks: a row at 100 slots of a 4,096-slot
    window runs one block (the body counted once by the compiler), and changing the blocks past it
    changes nothing."""
    S, block = 4096, 128
    q, k, v = _qkv(2, 2, 1, S, 4, 2, 64)
    ids = attn.CacheIds(jnp.asarray([[99], [20]], jnp.int32), jnp.asarray([100, 21], jnp.int32))
    fn = jax.jit(lambda q, k, v: attn.cache_loop(q, (k[None], v[None]), 0, ids, block=block)[0])
    want = np.asarray(fn(q, k, v))
    noise = jnp.zeros_like(k).at[:, 128:].set(jnp.nan)
    np.testing.assert_array_equal(np.asarray(fn(q, k + noise, v + noise)), want)
