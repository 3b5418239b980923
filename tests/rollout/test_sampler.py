"""The sampler against transformers (greedy `generate`, forward log-softmax) on tiny random Qwen models.

Compiles are shared: every sampler here has 4 rows, max_len 64 and prefill chunks of 16, and most
calls use all 4 rows with max_new_tokens <= 16, so a handful of shapes serve the whole file.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch

import models
from cope_jax.run.replica import SamplingReplica, decode_bytes_per_chip, decode_mesh
from cope_jax.rollout.sampler import Sampler
from cope_jax.rollout.sampling import categorical, sample_tokens
from tests.hf_fixtures import TINY_CONFIGS, hf_logits, make_tiny_hf

B, MAX_LEN = 4, 64
PROMPT_LENS = (5, 12, 2, 19)  # 19 > the prefill chunk: prefilled in two calls


def _prompts(vocab, seed=0, lens=PROMPT_LENS):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lens]


def _load(tmp_path_factory, name):
    family, kw = TINY_CONFIGS[name]
    directory = str(tmp_path_factory.mktemp(name))
    torch_model = make_tiny_hf(directory, family, **kw)
    model, cfg = models.load_hf_model(directory)
    return directory, torch_model, model, cfg


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """name -> (directory, torch model, config, sampler), built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            directory, torch_model, model, cfg = _load(tmp_path_factory, name)
            sampler = Sampler(model, batch_size=B, max_len=MAX_LEN, eos_ids=[], prefill_chunk=16)
            cache[name] = directory, torch_model, cfg, sampler
        return cache[name]
    return get


@pytest.fixture(scope="module")
def setup(loaded):
    return loaded("qwen2_untied_gqa4")


def _hf_greedy(torch_model, prompts, n):
    """transformers' greedy generate on a left-padded batch, EOS disabled: [len(prompts), n]."""
    T = max(map(len, prompts))
    ids = np.zeros((len(prompts), T), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    with torch.no_grad():
        out = torch_model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[:, T:].numpy()


def _hf_logprobs(torch_model, history, generated, temperature=1.0):
    """transformers' log-softmax of logits / temperature at each generated token, given the full
    history before it."""
    seq = np.array(list(history) + list(generated))[None]
    logp = torch.log_softmax(torch.tensor(hf_logits(torch_model, seq)[0]) / temperature, -1).numpy()
    pos = np.arange(len(history) - 1, len(seq[0]) - 1)
    return logp[pos, seq[0, pos + 1]]


@pytest.mark.parametrize("name", ["qwen2_untied_gqa4", "qwen3_untied_gqa4_hd"])
def test_greedy_equals_transformers_generate(loaded, name):
    _, torch_model, cfg, sampler = loaded(name)
    prompts = _prompts(cfg.vocab_size)
    out = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True)
    ref = _hf_greedy(torch_model, prompts, 16)
    assert out.finish_reasons == ["length"] * B
    for i in range(B):
        np.testing.assert_array_equal(out.tokens[i], ref[i])


def test_blockwise_prefill_keeps_the_greedy_tokens(loaded):
    """Prefill chunks of 16 over 64 cache slots in key blocks of 8 (the long-row path): the same
    greedy tokens as transformers."""
    directory, torch_model, cfg, _ = loaded("qwen2_untied_gqa4")
    model, _ = models.load_hf_model(directory, attention="blockwise", attention_block=8)
    sampler = Sampler(model, batch_size=B, max_len=MAX_LEN, eos_ids=[], prefill_chunk=16)
    prompts = _prompts(cfg.vocab_size, seed=3)
    out = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True)
    ref = _hf_greedy(torch_model, prompts, 16)
    for i in range(B):
        np.testing.assert_array_equal(out.tokens[i], ref[i])


def test_logprobs_are_the_sampling_policy_log_softmax(setup):
    _, torch_model, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=1)
    # the logprob is the policy's at the row's temperature (what the trainer scores), before top-k /
    # top-p; a greedy row's is at temperature 1
    temperature = [1.0, 0.7, 1.3, 0.0]
    out = sampler.generate(sampler.start(prompts), max_new_tokens=12, temperature=temperature,
                           top_p=[1.0, 1.0, 0.9, 0.8], top_k=[0, 20, 0, 0], key=jax.random.key(3))
    for i, p in enumerate(prompts):
        assert len(out.tokens[i]) == 12
        want = _hf_logprobs(torch_model, p, out.tokens[i], temperature[i] or 1.0)
        np.testing.assert_allclose(out.logprobs[i], want, atol=1e-4, rtol=0)
        if temperature[i] not in (0.0, 1.0):  # the scale shows: not the temperature-1 figure
            assert np.abs(out.logprobs[i] - _hf_logprobs(torch_model, p, out.tokens[i])).max() > 1e-2


def test_top_k_one_is_greedy_and_sampling_is_deterministic(setup):
    _, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=2)
    greedy = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True)
    top1 = sampler.generate(sampler.start(prompts), max_new_tokens=16, top_k=1, key=5)
    a = sampler.generate(sampler.start(prompts), max_new_tokens=16, key=jax.random.key(7))
    b = sampler.generate(sampler.start(prompts), max_new_tokens=16, key=jax.random.key(7))
    c = sampler.generate(sampler.start(prompts), max_new_tokens=16, key=jax.random.key(8))
    for i in range(B):
        np.testing.assert_array_equal(top1.tokens[i], greedy.tokens[i])
        np.testing.assert_array_equal(a.tokens[i], b.tokens[i])
        np.testing.assert_array_equal(a.logprobs[i], b.logprobs[i])
    assert any(not np.array_equal(a.tokens[i], c.tokens[i]) for i in range(B))
    assert any(not np.array_equal(a.tokens[i], greedy.tokens[i]) for i in range(B))


def _chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    order = np.argsort(expected)  # pool the rare tokens into one bin so every bin expects >= 5
    cut = np.searchsorted(np.cumsum(expected[order]), 5.0) + 1
    pooled = lambda x: np.concatenate([[x[order[:cut]].sum()], x[order[cut:]]])
    return scipy.stats.chisquare(pooled(counts), pooled(expected)).pvalue


def test_temperature_one_samples_the_model_distribution(setup):
    _, torch_model, cfg, sampler = setup
    prompt = _prompts(cfg.vocab_size, seed=3, lens=(6,))[0]
    logits = hf_logits(torch_model, np.array([prompt]))[0, -1].astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    counts = np.zeros(cfg.vocab_size)
    state = sampler.start([prompt] * B)
    for it in range(200):
        out = sampler.generate(state, max_new_tokens=1, key=it)
        np.add.at(counts, [t[0] for t in out.tokens], 1)
        sampler.start([prompt] * B, state=state, rows=range(B))
    assert _chi2_pvalue(counts, probs) > 1e-3
    # the same test rejects the distribution at temperature 1.6
    hot = probs ** 0.625 / np.sum(probs ** 0.625)
    assert _chi2_pvalue(counts, hot) < 1e-3


def test_top_k_top_p_temperature_sample_the_filtered_distribution():
    """sample_tokens alone, many rows of one logit vector, against the filtered softmax in numpy."""
    V, R = 40, 20000
    logits = np.random.RandomState(0).randn(V).astype(np.float32) * 2
    draw = jax.jit(sample_tokens)
    for temperature, top_k, top_p in ((0.7, 10, 1.0), (1.0, 0, 0.6), (1.5, 25, 0.9)):
        scaled = logits.astype(np.float64) / temperature
        order = np.argsort(-scaled)
        keep = np.zeros(V, bool)
        keep[order[:top_k or V]] = True
        p = np.where(keep, np.exp(scaled - scaled.max()), 0)
        p /= p.sum()
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= top_p]] = False
        expected = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        full = lambda x: jnp.full(R, x)
        toks = np.asarray(draw(jnp.tile(logits, (R, 1)), jax.random.split(jax.random.key(1), R),
                               full(temperature), full(top_k), full(top_p), full(False)))
        counts = np.bincount(toks, minlength=V)
        assert counts[~keep].sum() == 0
        assert scipy.stats.chisquare(counts[keep], expected[keep] * R).pvalue > 1e-3


def test_the_draw_a_call_compiles_in_gives_the_tokens_of_the_general_one():
    """`draw_of` reads what the knobs need on the host; 'greedy' and 'sample' (no branch on the
    device) draw exactly the tokens of 'filter' (which serves any knobs) for knobs they cover."""
    from cope_jax.rollout.sampling import draw_of

    R, V = 64, 300
    logits = jnp.asarray(np.random.RandomState(3).randn(R, V).astype(np.float32) * 2)
    keys = jax.random.split(jax.random.key(4), R)
    draw = jax.jit(sample_tokens, static_argnames="draw")
    mixed = dict(temperature=np.where(np.arange(R) % 3 == 0, 0.0, 0.8).astype(np.float32),
                 top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32), greedy=np.arange(R) % 5 == 0)
    greedy = dict(mixed, greedy=np.ones(R, bool))
    filtered = dict(mixed, top_p=np.where(np.arange(R) == 7, 0.9, 1.0).astype(np.float32))
    assert [draw_of(**k) for k in (mixed, greedy, filtered)] == ["sample", "greedy", "filter"]
    assert draw_of(**dict(mixed, temperature=np.zeros(R, np.float32))) == "greedy"
    for knobs in (mixed, greedy):
        np.testing.assert_array_equal(np.asarray(draw(logits, keys, **knobs, draw=draw_of(**knobs))),
                                      np.asarray(draw(logits, keys, **knobs, draw="filter")))
    sampled = np.asarray(draw(logits, keys, **mixed, draw="sample"))
    assert (sampled != np.asarray(draw(logits, keys, **mixed, draw="greedy"))).any()  # the test can fail
    with pytest.raises(ValueError, match="unknown draw"):
        sample_tokens(logits, keys, **mixed, draw="nucleus")


@pytest.mark.parametrize("V, top_k", [(1000, 0), (1000, 7), (300, 130)])
def test_categorical_draws_follow_the_softmax_across_blocks(V, top_k):
    """The two-level inverse CDF over vocabularies of several blocks (not a multiple of the block),
    with excluded tokens (-inf) spread over whole blocks, never draws an excluded or padding token."""
    R = 20000
    rng = np.random.RandomState(V + top_k)
    logits = (rng.randn(V) * 2).astype(np.float32)
    if top_k:
        keep = np.zeros(V, bool)
        keep[rng.choice(V, top_k, replace=False)] = True
        logits = np.where(keep, logits, -np.inf).astype(np.float32)
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    toks = np.asarray(jax.jit(categorical)(jnp.tile(logits, (R, 1)), jax.random.split(jax.random.key(2), R)))
    assert toks.min() >= 0 and toks.max() < V
    counts = np.bincount(toks, minlength=V)
    assert counts[p == 0].sum() == 0
    assert _chi2_pvalue(counts[p > 0], p[p > 0]) > 1e-3
    # and the test can fail: the same draws are rejected against a flattened distribution
    flat = p ** 0.8 / np.sum(p ** 0.8)
    assert _chi2_pvalue(counts[p > 0], flat[p > 0]) < 1e-3


def test_stop_sequences_and_eos_end_only_their_row(setup):
    _, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=4)
    ref = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True).tokens
    # a 2-token sequence that first appears in row 0 at positions 4, 5
    stop = [int(ref[0][4]), int(ref[0][5])]
    first = lambda r: next((j + 2 for j in range(len(r) - 1) if [r[j], r[j + 1]] == stop), None)
    out = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True, stop_sequences=[stop, [cfg.vocab_size - 1] * 3])
    for i in range(B):
        end = first(ref[i].tolist())
        expect = ("stop", ref[i][:end]) if end is not None else ("length", ref[i])
        assert out.finish_reasons[i] == expect[0]
        np.testing.assert_array_equal(out.tokens[i], expect[1])
    assert out.finish_reasons[0] == "stop" and len(out.tokens[0]) <= 6
    # EOS: row 2's 8th token ends row 2 (and any row producing it earlier), after emitting it
    eos = int(ref[2][7])
    out = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True, eos_ids=[eos])
    for i in range(B):
        hits = np.flatnonzero(ref[i] == eos)
        n = hits[0] + 1 if len(hits) else 16
        assert out.finish_reasons[i] == ("eos" if len(hits) else "length")
        np.testing.assert_array_equal(out.tokens[i], ref[i][:n])


def test_multi_turn_extend_equals_prefilling_the_history(setup):
    _, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=5)
    obs = _prompts(cfg.vocab_size, seed=6, lens=(3, 1, 17, 6))
    knobs = dict(max_new_tokens=8, temperature=1.0, top_p=0.95)
    state = sampler.start(prompts)
    turn1 = sampler.generate(state, key=11, **knobs)
    assert sampler.extend(state, range(B), obs).all()
    turn2 = sampler.generate(state, key=12, **knobs)
    history = [p + t.tolist() + o for p, t, o in zip(prompts, turn1.tokens, obs)]
    np.testing.assert_array_equal(state.num_tokens(), [len(h) + 8 for h in history])
    fresh = sampler.generate(sampler.start(history), key=12, **knobs)
    for i in range(B):
        np.testing.assert_array_equal(turn2.tokens[i], fresh.tokens[i])
        np.testing.assert_allclose(turn2.logprobs[i], fresh.logprobs[i], atol=1e-5, rtol=0)


def test_idle_rows_and_reused_rows_are_unaffected(setup):
    _, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=7)
    ref = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True).tokens
    state = sampler.start(prompts)
    part = sampler.generate(state, rows=[3, 1], max_new_tokens=16, greedy=True)  # rows 0, 2 idle
    assert part.rows == [3, 1]
    np.testing.assert_array_equal(part.tokens[0], ref[3])
    np.testing.assert_array_equal(part.tokens[1], ref[1])
    # a finished episode's row starts a new one: row 3 restarts with row 0's prompt
    sampler.free(state, [3])
    sampler.start([prompts[0]], state=state)
    rest = sampler.generate(state, rows=[0, 2, 3], max_new_tokens=16, greedy=True).tokens
    for got, want in zip(rest, (ref[0], ref[2], ref[0])):
        np.testing.assert_array_equal(got, want)


def test_streamed_turns_reach_the_caller_as_they_end(setup):
    """on_finish hands each row over when its turn ends, while longer turns are still decoding, and
    streaming does not change a token."""
    _, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=12)
    max_new = [2, 7, 16, 11]
    ref = sampler.generate(sampler.start(prompts), max_new_tokens=max_new, key=13)
    state = sampler.start(prompts)
    seen = []

    def on_finish(i, tokens, logprobs, reason):
        seen.append((i, tokens, logprobs, reason))

    out = sampler.generate(state, max_new_tokens=max_new, key=13, on_finish=on_finish, stream_every=4)
    assert [s[0] for s in seen] == [0, 1, 3, 2]  # ends at steps 2, 7, 11, 16: chunks 1, 2, 3, 4
    for i, tokens, logprobs, reason in seen:
        assert reason == "length" == out.finish_reasons[i] == ref.finish_reasons[i]
        for got in (tokens, out.tokens[i]):
            np.testing.assert_array_equal(got, ref.tokens[i])
        np.testing.assert_allclose(logprobs, ref.logprobs[i], rtol=1e-6)
    # in one chunk, the turns are handed over together, in request order
    order = []
    sampler.generate(sampler.start(prompts), max_new_tokens=max_new, key=13, stream_every=16,
                     on_finish=lambda i, *_: order.append(i))
    assert order == [0, 1, 2, 3]
    assert state.num_tokens().tolist() == [len(p) + n for p, n in zip(prompts, max_new)]
    with pytest.raises(ValueError, match="stream_every"):
        sampler.generate(state, max_new_tokens=2, key=1, on_finish=on_finish, stream_every=0)


def test_context_full_never_truncates(setup):
    _, _, cfg, sampler = setup
    long = _prompts(cfg.vocab_size, seed=8, lens=(MAX_LEN - 3, 4, MAX_LEN + 1, MAX_LEN))
    state = sampler.start(long)
    assert state.full.tolist() == [False, False, True, False]
    out = sampler.generate(state, max_new_tokens=16, greedy=True)
    assert out.finish_reasons == ["context_full", "length", "context_full", "context_full"]
    assert [len(t) for t in out.tokens] == [3, 16, 0, 0]
    assert state.num_tokens()[0] == MAX_LEN
    # an observation that does not fit is refused, and the row only reports context_full
    fits = sampler.extend(state, [0, 1], [[1], [2] * (MAX_LEN - 20 + 1)])
    assert fits.tolist() == [False, False]
    assert sampler.extend(state, [1], [[2] * (MAX_LEN - 20 - 2)]).tolist() == [False]  # row 1 is now full
    out = sampler.generate(state, rows=[0, 1], max_new_tokens=4, greedy=True)
    assert out.finish_reasons == ["context_full"] * 2 and [len(t) for t in out.tokens] == [0, 0]


def test_parameter_updates_reach_the_next_call(setup):
    """An optimizer step replaces the model's arrays; the next turn must use them (the CPU path
    keeps an unrolled copy of the weights, which has to be re-made)."""
    _, torch_model, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=10)
    model = sampler.model
    before = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True).tokens
    original = model.lm_head[...]
    model.lm_head[...] = -original  # what an optimizer step does: a new array in the Param
    try:
        after = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True).tokens
    finally:
        model.lm_head[...] = original
    with torch.no_grad():
        torch_model.lm_head.weight.neg_()
        try:
            ref = _hf_greedy(torch_model, prompts, 16)
        finally:
            torch_model.lm_head.weight.neg_()
    for i in range(B):
        np.testing.assert_array_equal(after[i], ref[i])
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_sharded_scanned_greedy_equals_single_device_unrolled(setup):
    directory, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=9)
    ref = sampler.generate(sampler.start(prompts), max_new_tokens=16, greedy=True).tokens
    mesh = models.make_mesh((2, 2, 2))
    model, _ = models.load_hf_model(directory, mesh=mesh)
    # the accelerator configuration: scanned layers over the stacked weights (CPU unrolls them)
    sharded = Sampler(model, batch_size=B, max_len=MAX_LEN, eos_ids=[], prefill_chunk=16, unroll_layers=False)
    state = sharded.start(prompts)
    assert len(state.cache.k.sharding.device_set) == 8
    out = sharded.generate(state, max_new_tokens=16, greedy=True)
    streamed = []
    sharded.generate(sharded.start(prompts), max_new_tokens=16, greedy=True, stream_every=5,
                     on_finish=lambda i, tokens, *_: streamed.append((i, tokens)))
    assert sorted(i for i, _ in streamed) == list(range(B))
    for i, tokens in streamed:
        np.testing.assert_array_equal(tokens, ref[i])
    # the cache stays on its sharding across donated calls: batch over data x fsdp, kv heads over tp
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, "tp"))
    assert state.cache.k.sharding.is_equivalent_to(want, 5)
    for i in range(B):
        np.testing.assert_array_equal(out.tokens[i], ref[i])


@pytest.mark.parametrize("shape", [(1, 2, 4), (1, 4, 2), (2, 2, 2)])
def test_every_mesh_samples_the_single_device_tokens(setup, shape):
    """The sampler on a mesh of that shape, and on the decode mesh a `SamplingReplica` of a policy
    trained on it lays out, samples the single-device tokens (temperature 1, one key) with the same
    log-probs up to float32 reduction order; rows left idle change nothing for the others."""
    directory, _, cfg, sampler = setup
    prompts = _prompts(cfg.vocab_size, seed=11)
    ref = sampler.generate(sampler.start(prompts), max_new_tokens=16, temperature=1.0, key=3)
    mesh = models.make_mesh(shape)
    model, _ = models.load_hf_model(directory, mesh=mesh)
    replica = SamplingReplica(model, mesh, rows=B, max_len=MAX_LEN)
    # 8 heads over tp=8 (KV heads replicated): each chip reads an eighth of every projection
    assert replica.mesh.devices.shape == (1, 1, 8) and replica.model is not model
    q = replica.model.layers.q_proj[...]
    assert tuple(q.sharding.spec)[:3] == (None, None, "tp") and q.dtype == jnp.float32
    for policy in (model, replica.model):
        s = Sampler(policy, batch_size=B, max_len=MAX_LEN, eos_ids=[], prefill_chunk=16, unroll_layers=False)
        out = s.generate(s.start(prompts), max_new_tokens=16, temperature=1.0, key=3)
        for i in range(B):
            np.testing.assert_array_equal(out.tokens[i], ref.tokens[i])
            np.testing.assert_allclose(out.logprobs[i], ref.logprobs[i], atol=2e-5)
    rows = [3, 1]
    part = s.generate(s.start(prompts), rows=rows, max_new_tokens=16, temperature=1.0,
                      key=jax.random.split(jax.random.key(5), 2))
    alone = sampler.generate(sampler.start(prompts), rows=rows, max_new_tokens=16, temperature=1.0,
                             key=jax.random.split(jax.random.key(5), 2))
    for got, want in zip(part.tokens, alone.tokens):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [None, (2, 2, 2)])
def test_a_groups_prompt_is_prefilled_once_and_samples_as_prefilled_per_row(setup, monkeypatch, shape):
    """Rows starting with the same prompt (a group of three, 19 tokens: two prefill chunks, and one
    other) share one prefill, on one device and with rows split over 4 of 8 devices; tokens and
    log-probs equal starting each row on its own (one `start` per row: nothing to share)."""
    import cope_jax.rollout.sampler as sampler_module

    directory, _, cfg, sampler = setup
    if shape is not None:
        model, _ = models.load_hf_model(directory, mesh=models.make_mesh(shape))
        sampler = Sampler(model, batch_size=B, max_len=MAX_LEN, eos_ids=[], prefill_chunk=16, unroll_layers=False)
    group, other = _prompts(cfg.vocab_size, seed=13, lens=(19, 7))
    prompts = [group, group, other, group]
    alone = sampler.init_state()
    for row, p in enumerate(prompts):
        sampler.start([p], alone, rows=[row])
    want = sampler.generate(alone, max_new_tokens=16, temperature=1.0, key=3)
    prefilled = []  # per prefill call: the rows it appended tokens to

    def counting(*args, **kwargs):
        prefilled.append(int((np.asarray(args[7]) > 0).sum()))
        return prefill(*args, **kwargs)
    prefill = sampler_module.prefill
    monkeypatch.setattr(sampler_module, "prefill", counting)
    state = sampler.start(prompts)
    assert prefilled == [2, 1]  # the two distinct prompts, then the long one's second chunk
    np.testing.assert_array_equal(state.cached, [18, 18, 6, 18])
    got = sampler.generate(state, max_new_tokens=16, temperature=1.0, key=3)
    for i in range(B):
        np.testing.assert_array_equal(got.tokens[i], want.tokens[i])
        np.testing.assert_allclose(got.logprobs[i], want.logprobs[i], atol=2e-5)  # float32 sum order
    # the rows started from the shared prompt go on like any other: a turn appended to one of them
    fits = sampler.extend(state, [1], [[5, 6, 7]])
    assert fits.all() and state.cached[1] == 18 + 16 + 3


def test_the_replica_follows_the_policy_after_refresh(setup):
    directory, _, cfg, _ = setup
    mesh = models.make_mesh((1, 8, 1))
    model, _ = models.load_hf_model(directory, mesh=mesh)
    replica = SamplingReplica(model, mesh, rows=B, max_len=MAX_LEN)
    before = np.asarray(replica.model.lm_head[...])
    model.lm_head[...] = -model.lm_head[...]
    np.testing.assert_array_equal(np.asarray(replica.model.lm_head[...]), before)  # a copy, not a view
    replica.refresh()
    np.testing.assert_array_equal(np.asarray(replica.model.lm_head[...]), -before)
    assert tuple(replica.model.lm_head[...].sharding.spec)[:2] == ("tp", None)


@pytest.mark.parametrize("preset, rows, want", [
    ("Qwen2.5-7B-Instruct", 32, (2, 1, 4)),  # 28 heads: tp 4 of 8 chips, rows over the other 2
    ("Qwen3-8B", 32, (1, 1, 8)),             # 32 heads, 8 KV heads: everything over tp
])
def test_the_decode_mesh_reads_each_weight_once_per_tp_group(preset, rows, want):
    from models.presets import preset_config
    cfg = preset_config(preset)
    mesh = decode_mesh(cfg, jax.devices()[:8], rows, 16384)
    assert mesh.devices.shape == want
    for t in (1, 2, 4, 8):
        if cfg.num_heads % t == 0 and t != want[2]:
            other = models.make_mesh((8 // t, 1, t))
            assert decode_bytes_per_chip(cfg, other, rows, 16384) >= decode_bytes_per_chip(cfg, mesh, rows, 16384)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5, key=0), "temperature"),
    (dict(top_p=0.0, key=0), "top_p"),
    (dict(top_k=-1, key=0), "top_k"),
    (dict(max_new_tokens=0, key=0), "max_new_tokens"),
    (dict(temperature=[1.0, 1.0], key=0), "one value per row"),  # 3 live rows
    (dict(temperature=1.0), "PRNG key"),
    (dict(rows=[0, 0], greedy=True), "repeat"),
    (dict(rows=[9], greedy=True), "out of range"),
    (dict(stop_sequences=[[]], greedy=True), "empty stop"),
])
def test_bad_arguments_raise_clear_errors(setup, kwargs, message):
    _, _, cfg, sampler = setup
    state = sampler.start(_prompts(cfg.vocab_size, lens=(3, 3, 3)))
    with pytest.raises(ValueError, match=message):
        sampler.generate(state, **kwargs)
    with pytest.raises(ValueError, match="free"):
        sampler.generate(state, rows=[3], greedy=True)
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.start([[]], state=state)
    with pytest.raises(ValueError, match="outside"):
        sampler.extend(state, [0], [[cfg.vocab_size]])
