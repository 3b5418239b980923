"""The fused step against an independent full-logits implementation written here, for every method;
invariance to packing and micro-batching; both af modes; the sharded step on 8 fake devices."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from cope_jax.batch import batching
from cope_jax.objective import advantages, methods
from cope_jax.train import logprobs, train_step
from cope_jax.objective.advantages import forecast_weights
from cope_jax.batch.packing import pad_micro
from cope_jax.rollout.trajectory import ForecastExample, Trajectory

CFG = models.QwenConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
# large coefficients so every term visibly moves loss and gradients; small chunks so the logits
# path really runs several chunks (2 rows x 8 positions over rows of 64)
LOSS = methods.LossConfig(temperature=0.8, kl_coef=0.05, entropy_coef=0.02, af_coef=0.3, echo_coef=0.2,
                          rft_coef=1.0, logits_chunk_tokens=16)
ROW_LEN, ROWS, MICRO = 64, 2, 8
# reference term columns
PG, KL, ENT, AF, RFT, ECHO = range(6)
SUCCESS = {0: [1, 0, 0], 1: [0, 0, 0], 2: [1, 1, 0], 3: [1, 1, 1]}


def _trajectory(rng, group, success):
    tokens, action, obs, observations = list(rng.randint(1, 64, 4)), [0] * 4, [0] * 4, []
    while len(tokens) < 22 + rng.randint(0, 14):
        n_obs, n_act = rng.randint(3, 7), rng.randint(2, 6)
        tokens += list(rng.randint(1, 64, n_obs + n_act))
        obs += [1] * n_obs + [0] * n_act
        action += [0] * n_obs + [1] * n_act
        observations.append(str(rng.randint(0, 3)))
    return Trajectory(tokens=tokens, action_mask=action, obs_mask=obs, success=success, group_id=group,
                      observations=observations, action_spans=[[0, 0]] * (len(observations) - 1))


def _dataset():
    rng = np.random.RandomState(0)
    trajs = [_trajectory(rng, g, y) for g, ys in SUCCESS.items() for y in ys]
    w = forecast_weights([t.success for t in trajs], [t.group_id for t in trajs])
    exs = []
    for i, t in enumerate(trajs):
        # 1-3 examples per successful trajectory, sharing its history (packed as one tree)
        for step in range(t.success * (1 + i % 3)):
            cut, n_target = rng.randint(8, 20), rng.randint(3, 6)
            tokens = np.concatenate([t.tokens[:cut], rng.randint(1, 64, 3 + n_target)])
            mask = np.r_[np.zeros(cut + 3), np.ones(n_target)]
            exs.append(ForecastExample(tokens=tokens, target_mask=mask, weight=w[i], group_id=t.group_id,
                                       source=i, step=step, prefix_len=cut))
    return trajs, exs


TRAJS, EXAMPLES = _dataset()
SEQS = [t.tokens for t in TRAJS] + [e.tokens for e in EXAMPLES]
T_MAX = max(len(s) for s in SEQS)


def _padded(arrays, dtype):
    out = np.zeros((len(arrays), T_MAX), dtype)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return out


TOKENS = _padded(SEQS, np.int32)
VALID = _padded([np.ones(len(s)) for s in SEQS], np.int32)
# loss tokens of each column (position 0 has no prediction)
_no_first = lambda m: np.where(np.arange(T_MAX) > 0, m, 0).astype(bool)
ACTION = _no_first(_padded([t.action_mask for t in TRAJS] + [np.zeros(len(e)) for e in EXAMPLES], bool))
OBS = _no_first(_padded([t.obs_mask for t in TRAJS] + [np.zeros(len(e)) for e in EXAMPLES], bool))
TARGET = _no_first(_padded([np.zeros(len(t)) for t in TRAJS] + [e.target_mask for e in EXAMPLES], bool))


def reference_token_sums(model, adv, old, ref):
    """[S, 6]: per sequence, the token sums of each term's per-token loss, from full logits over
    right-padded rows (no packing, no chunking)."""
    z = model(jnp.asarray(TOKENS), segment_ids=jnp.asarray(VALID)) / LOSS.temperature
    logp_all = jax.nn.log_softmax(z, axis=-1)
    pred = jnp.take_along_axis(logp_all[:, :-1], jnp.asarray(TOKENS)[:, 1:, None], axis=-1)[..., 0]
    lp = jnp.pad(pred, ((0, 0), (1, 0)))  # lp[:, t] = log p(token t | tokens < t)
    ent = jnp.pad(-jnp.sum(jnp.exp(logp_all) * logp_all, -1)[:, :-1], ((0, 0), (1, 0)))
    ratio = jnp.exp(lp - old)
    a = adv[:, None]
    pg = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - LOSS.clip_low, 1 + LOSS.clip_high))
    k = ref - lp
    kl = jnp.clip(jnp.exp(k) - k - 1, -10, 10)
    cols = [(pg, ACTION), (kl, ACTION), (ent, ACTION), (-lp, TARGET), (-lp, ACTION), (-lp, OBS)]
    return jnp.stack([jnp.sum(jnp.where(m, v, 0.0), axis=1) for v, m in cols], axis=1), lp


GRAPHDEF, BASE_STATE = nnx.split(models.create_model(CFG, seed=0))


def fresh_model():
    """A new model with the base weights (own buffers: Learners donate theirs)."""
    return nnx.merge(GRAPHDEF, jax.tree.map(jnp.copy, BASE_STATE))


@jax.jit
def reference_loss_and_grads(params, coef, adv, old, ref):
    def loss(p):
        sums, lp = reference_token_sums(nnx.merge(GRAPHDEF, p), adv, old, ref)
        return jnp.sum(coef * sums), lp
    (value, lp), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, grads, lp


def reference_coefficients(spec, cfg, traj_ids, example_ids, group_traj_ids=None):
    """[S, 6] weights of the token sums: method §2-4 written out literally for one mini-batch whose
    trajectory rows are `traj_ids`; the AF normalizer counts the groups of `group_traj_ids`
    (default: traj_ids)."""
    coef = np.zeros((len(SEQS), 6))
    n_act = {i: ACTION[i].sum() for i in traj_ids}
    G = len(traj_ids)
    per_mode = {"token-mean": lambda i: 1 / sum(n_act.values()),
                "seq-mean-token-mean": lambda i: 1 / (G * n_act[i]),
                "seq-mean-token-sum": lambda i: 1 / G,
                "seq-mean-token-sum-norm": lambda i: 1 / (G * cfg.norm_length)}[cfg.aggregation]
    terms = spec.terms
    for i in traj_ids:
        a = per_mode(i)
        coef[i, PG] = a if "pg" in terms else 0
        coef[i, KL] = cfg.kl_coef * a if "kl" in terms else 0
        coef[i, ENT] = -cfg.entropy_coef * a if "entropy" in terms else 0
        coef[i, RFT] = cfg.rft_coef * a if "rft" in terms else 0
        coef[i, ECHO] = cfg.echo_coef / sum(OBS[j].sum() for j in traj_ids) if "echo" in terms else 0
    group_traj_ids = traj_ids if group_traj_ids is None else group_traj_ids
    groups = {TRAJS[i].group_id for i in group_traj_ids}
    success_groups = {TRAJS[i].group_id for i in group_traj_ids if TRAJS[i].success}
    for j in example_ids:
        e, s = EXAMPLES[j], len(TRAJS) + j
        if cfg.af_normalization == "paper_exact":
            coef[s, AF] = cfg.af_coef * e.weight / len(groups)
        else:
            coef[s, AF] = cfg.af_coef * e.weight / (TARGET[s].sum() * len(success_groups))
    return coef


def _params(model):
    return nnx.state(model, nnx.Param)


@jax.jit
def _packed_loss_and_grads(params, batch, coefs):
    return train_step.loss_and_grads(nnx.merge(GRAPHDEF, params), batch, LOSS.device_part(), coefs)


def packed_loss_and_grads(params, batch, cfg=LOSS):
    """The packed step's loss over the terms the batch carries, with `cfg`'s coefficients."""
    coefs = {t: jnp.float32(c) for t, c in cfg.coefficients(batch.weights).items()}
    return _packed_loss_and_grads(params, batch, coefs)


def _fill(batch, name, per_sequence, index_to_seq):
    """Writes per-sequence token values into the packed trajectory rows via seq_index / positions
    (forecasting rows, which no old / reference logprob reaches, keep theirs)."""
    out = np.array(getattr(batch, name))
    idx, pos = np.asarray(batch.seq_index), np.asarray(batch.positions)
    for k in np.unique(idx[(idx >= 0) & (idx < len(index_to_seq))]):
        sel = idx == k
        out[sel] = per_sequence[index_to_seq[k]][pos[sel]]
    return batch.replace(**{name: out})


@pytest.fixture(scope="module")
def setup():
    model = fresh_model()
    params = _params(model)
    zeros = jnp.zeros(TOKENS.shape, jnp.float32)
    _, _, lp = reference_loss_and_grads(params, jnp.zeros((len(SEQS), 6)), jnp.zeros(len(SEQS)), zeros, zeros)
    rng = np.random.RandomState(1)
    # old/ref policies near the current one: some ratios leave [0.8, 1.2] on both sides
    old = np.asarray(lp) + 0.25 * rng.randn(*TOKENS.shape).astype(np.float32)
    ref = np.asarray(lp) + 0.3 * rng.randn(*TOKENS.shape).astype(np.float32)
    return model, params, old, ref


def _example_id(example):
    """Index in EXAMPLES of an example or of a copy of it (another `source` numbering)."""
    return next(j for j, e in enumerate(EXAMPLES)
                if e.step == example.step and e.group_id == example.group_id and np.array_equal(e.tokens, example.tokens))


def _packed(spec, cfg, old, ref, trajs=TRAJS, examples=EXAMPLES, row_len=ROW_LEN, rows=ROWS, micro=MICRO,
            groups_per_minibatch=len(SUCCESS)):
    exs = list(examples) if spec.forecast_kind else []
    mbs, _ = batching.build_minibatches(trajs, exs, spec, cfg, groups_per_minibatch=groups_per_minibatch,
                                        row_len=row_len, rows_per_micro=rows)
    out = []
    for mb in mbs:
        members = set(mb.groups)
        kept = [TRAJS.index(t) for t in trajs
                if t.group_id in members and (spec.trajectories == "all" or t.success)]
        ex_ids = [_example_id(e) for e in exs if e.group_id in members] if "af" in mb.terms else []
        if mb.terms == ("af",):
            kept, ex_ids = [], [_example_id(e) for e in exs]
        b = mb.batch if micro is None else pad_micro(mb.batch, micro)
        b = _fill(_fill(b, "old_logp", old, kept), "ref_logp", ref, kept)
        out.append((b, mb.terms, kept, ex_ids))
    return out


def _assert_grads_close(got, want, rtol=1e-5):
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    scale = max(float(jnp.max(jnp.abs(w))) for w in flat_want)
    assert scale > 1e-3
    for g, w in zip(flat_got, flat_want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-6 * scale)


CASES = [(m, {}) for m in methods.METHODS] + [
    ("grpo", {"aggregation": "token-mean"}), ("grpo", {"aggregation": "seq-mean-token-sum"}),
    ("grpo", {"aggregation": "seq-mean-token-sum-norm", "norm_length": 48}),
    ("cope", {"af_normalization": "paper_exact"})]


@pytest.mark.parametrize("name,overrides", CASES, ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                                                      for m, o in CASES])
def test_step_equals_full_logits_reference(setup, name, overrides):
    model, params, old, ref = setup
    spec = methods.get_method(name)
    cfg = dataclasses.replace(LOSS, **overrides)
    [(batch, terms, kept, ex_ids)] = _packed(spec, cfg, old, ref)
    adv, _ = advantages.compute_advantages(spec, TRAJS, cfg)
    adv_seq = np.zeros(len(SEQS), np.float32)
    adv_seq[:len(TRAJS)] = adv
    coef = reference_coefficients(spec, cfg, kept, ex_ids)
    want_loss, want_grads, _ = reference_loss_and_grads(params, jnp.asarray(coef, jnp.float32), adv_seq, old, ref)
    assert terms == cfg.active_terms(spec.terms)
    loss, grads, sums = packed_loss_and_grads(params, batch, cfg)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _assert_grads_close(grads, want_grads)
    for term, col in (("pg", PG), ("af", AF), ("rft", RFT), ("echo", ECHO)):
        if term in terms:  # each term really contributes
            assert np.abs(coef[:, col]).sum() > 0 and f"{term}_loss" in sums
    if "pg" in terms:
        assert 0 < float(sums["pg_clipped"]) < float(sums["pg_tokens"])


def _regroup_rows(batch, seed):
    """The same packed rows dealt into micro-batches in another order."""
    M, R, L = batch.shape
    perm = np.random.RandomState(seed).permutation(M * R)
    return jax.tree.map(lambda a: np.asarray(a).reshape(M * R, L)[perm].reshape(M, R, L), batch)


def test_chunked_logprobs_match_full_logits():
    """Odd lengths (chunks padded), packed segments, temperature: values and both gradients."""
    rng = np.random.RandomState(3)
    B, T, E, V = 3, 13, 8, 37
    h = jnp.asarray(rng.randn(B, T, E), jnp.float32)
    w = jnp.asarray(rng.randn(V, E), jnp.float32)
    tokens = jnp.asarray(rng.randint(0, V, (B, T)))
    seg = jnp.asarray([[1] * 5 + [2] * 8, [1] * 13, [1] * 7 + [0] * 6])
    g_lp, g_ent = (jnp.asarray(rng.randn(B, T), jnp.float32) for _ in range(2))

    def chunked(h, w):
        lp, ent = logprobs.token_logprobs(h, w, tokens, seg, temperature=0.7, chunk_tokens=4 * B)
        return jnp.sum(lp * g_lp) + jnp.sum(ent * g_ent), (lp, ent)

    def full(h, w):
        logp_all = jax.nn.log_softmax(h @ w.T / 0.7, axis=-1)
        pred = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)[:, :-1]
        valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        lp = jnp.pad(jnp.where(valid, pred, 0), ((0, 0), (1, 0)))
        ent = jnp.pad(jnp.where(valid, ent, 0), ((0, 0), (1, 0)))
        return jnp.sum(lp * g_lp) + jnp.sum(ent * g_ent), (lp, ent)

    (v1, out1), g1 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(h, w)
    (v2, out2), g2 = jax.jit(jax.value_and_grad(full, argnums=(0, 1), has_aux=True))(h, w)
    for a, b in zip(out1 + g1, out2 + g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.asarray(out1[0])[2, 7:].max() == 0 and np.asarray(out1[0])[0, 5] == 0  # padding, segment start


def test_packing_and_micro_batching_invariance(setup):
    _, params, old, ref = setup
    spec = methods.get_method("cope")
    base, terms, _, _ = _packed(spec, LOSS, old, ref)[0]
    flipped = [dataclasses.replace(e, source=len(TRAJS) - 1 - e.source) for e in EXAMPLES[::-1]]
    reordered = _packed(spec, LOSS, old, ref, trajs=TRAJS[::-1], examples=flipped)[0][0]
    longer = _packed(spec, LOSS, old, ref, row_len=2 * ROW_LEN, rows=1, micro=None)[0][0]
    variants = [reordered, _regroup_rows(base, 0), longer]
    assert not np.array_equal(reordered.tokens, base.tokens)
    assert (np.asarray(base.branch_ids) >= 2).any()  # forecasting examples packed as trees
    # some hang on their own trajectory's row: one segment with policy tokens and branches
    seg, branch, pg = (np.asarray(a).reshape(-1, ROW_LEN) for a in (base.segment_ids, base.branch_ids, base.weights["pg"]))
    assert any((branch[r][seg[r] == s] > 0).any() and (pg[r][seg[r] == s] > 0).any()
               for r in range(len(seg)) for s in set(seg[r]) - {0})
    # fewer, longer rows, one per micro-batch: every micro-batch holds a different token set
    assert longer.shape[1:] == (1, 2 * ROW_LEN) and longer.num_micro * 2 * ROW_LEN < base.tokens.size
    want_loss, want_grads, _ = packed_loss_and_grads(params, base)
    for batch in variants:
        loss, grads, _ = packed_loss_and_grads(params, batch)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        _assert_grads_close(grads, want_grads)


# big steps, and eps = 1 makes the first AdamW update ~ lr * g / (|g| + 1): updated parameters
# then reflect the gradients elementwise (not just their signs)
OPT = train_step.OptimizerConfig(learning_rate=0.5, eps=1.0)


def test_optimizer_schedule_warms_up_then_decays():
    cfg = train_step.OptimizerConfig(learning_rate=2.0, decay_steps=100, final_lr_fraction=0.05)
    lr = cfg.schedule()
    values = [float(lr(i)) for i in range(101)]
    assert values[0] == 0.0 and values[5] == pytest.approx(2.0)  # warm-up: 5% of the steps
    assert all(a >= b for a, b in zip(values[5:], values[6:]))  # then only down
    assert values[100] == pytest.approx(0.1)
    assert train_step.OptimizerConfig(learning_rate=2.0).schedule() == 2.0  # default: constant
    warm = train_step.OptimizerConfig(learning_rate=2.0, warmup_steps=4).schedule()  # RL: warm-up only
    assert [float(warm(i)) for i in (0, 2, 4, 50)] == pytest.approx([0.0, 1.0, 2.0, 2.0])
    # a one-step cosine run (warmstart.steps=1) takes that step at the learning rate
    assert train_step.OptimizerConfig(learning_rate=2.0, decay_steps=1).schedule() == 2.0
    # the optimizer follows it: the first step (lr 0) leaves the parameters where they are
    tx = train_step.make_optimizer(cfg)
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)


def _padded_minibatches(spec, cfg):
    """Mini-batches of two groups, padded to MICRO micro-batches (one shape: shared executables)."""
    mbs, _ = batching.build_minibatches(TRAJS, EXAMPLES, spec, cfg, groups_per_minibatch=2,
                                        row_len=ROW_LEN, rows_per_micro=ROWS)
    for mb in mbs:
        mb.batch = pad_micro(mb.batch, MICRO)
    return mbs


def test_af_modes_joint_and_sequential(setup):
    _, params0, _, _ = setup
    spec = methods.get_method("cope")
    ref_model = fresh_model()
    # joint: one step per mini-batch (2 groups each), GRPO and AF in the same loss
    joint_model = fresh_model()
    learner = train_step.Learner(joint_model, LOSS, OPT)
    mbs = _padded_minibatches(spec, LOSS)
    metrics = learner.train(mbs, ref_model)
    assert len(metrics) == 2 and int(learner.optimizer.step[...]) == 2
    assert all(m["af_loss"] > 0 and m["pg_tokens"] > 0 for m in metrics)
    # first step's loss = the reference over groups 0 and 1 at the initial parameters (old = current)
    logp = np.asarray(learner.logprobs(mbs[0].batch, ref_model))
    _, _, lp0 = reference_loss_and_grads(params0, jnp.zeros((len(SEQS), 6)), jnp.zeros(len(SEQS)),
                                         jnp.zeros(TOKENS.shape), jnp.zeros(TOKENS.shape))
    lp0 = np.asarray(lp0)
    kept = [i for i, t in enumerate(TRAJS) if t.group_id in (0, 1)]
    ex_ids = [j for j, e in enumerate(EXAMPLES) if e.group_id in (0, 1)]
    adv, _ = advantages.compute_advantages(spec, TRAJS, LOSS)
    adv_seq = np.r_[adv, np.zeros(len(EXAMPLES))].astype(np.float32)
    coef = reference_coefficients(spec, LOSS, kept, ex_ids)
    want, _, _ = reference_loss_and_grads(params0, jnp.asarray(coef, jnp.float32), adv_seq, lp0, lp0)
    np.testing.assert_allclose(metrics[0]["loss"], float(want), rtol=1e-5)
    # the packed forward-only logp equals the reference logp on every trajectory token
    packed = _fill(mbs[0].batch.replace(old_logp=np.zeros_like(logp)), "old_logp", lp0, kept)
    index = np.asarray(packed.seq_index)
    real = (index >= 0) & (index < len(kept)) & (np.asarray(packed.branch_ids) == 0)
    assert real.sum() == sum(len(TRAJS[i]) for i in kept)
    np.testing.assert_allclose(logp[real], np.asarray(packed.old_logp)[real], atol=2e-5)

    # sequential: the GRPO mini-batches, then one AF step on every example with the same AdamW state
    seq_cfg = dataclasses.replace(LOSS, af_mode="sequential")
    seq_model = fresh_model()
    learner = train_step.Learner(seq_model, seq_cfg, OPT)
    mbs = _padded_minibatches(spec, seq_cfg)
    assert [m.terms for m in mbs] == [("pg", "kl", "entropy")] * 2 + [("af",)]
    filled = [learner.fill_logprobs(mb.batch, ref_model) for mb in mbs]
    for batch in filled[:2]:
        m = learner.step(batch)
        assert "af_loss" not in m
    params2 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), _params(seq_model))  # uncommitted, as params0
    opt_state2 = jax.tree.map(np.array, nnx.as_pure(learner.optimizer.opt_state))
    m = learner.step(filled[2])
    assert int(learner.optimizer.step[...]) == 3 and set(m) >= {"af_loss", "grad_norm"} and "pg_loss" not in m
    # the AF step = AdamW (continuing the moments) on lambda * L_AF over all groups at params2
    coef = reference_coefficients(spec, seq_cfg, [], list(range(len(EXAMPLES))), range(len(TRAJS)))
    zeros = jnp.zeros(TOKENS.shape)
    af_loss, af_grads, _ = reference_loss_and_grads(params2, jnp.asarray(coef, jnp.float32),
                                                    jnp.zeros(len(SEQS)), zeros, zeros)
    np.testing.assert_allclose(float(m["loss"]), float(af_loss), rtol=1e-5)
    tx = train_step.make_optimizer(OPT)
    updates, _ = tx.update(nnx.as_pure(af_grads), opt_state2, nnx.as_pure(params2))
    want = optax.apply_updates(nnx.as_pure(params2), updates)
    moved = 0.0
    for got, w, before in zip(jax.tree.leaves(nnx.as_pure(_params(seq_model))), jax.tree.leaves(want),
                              jax.tree.leaves(nnx.as_pure(params2))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), atol=2e-5, rtol=0)
        moved = max(moved, float(np.abs(np.asarray(got) - before).max()))
    assert moved > 1e-3


def test_old_and_ref_logprobs_only_on_policy_micro_batches():
    """Trajectories are packed first, the forecasting examples that do not fit on their trajectory's
    row after them in their own micro-batches; the forward-only passes run on the micro-batches with
    policy tokens only and leave 0 in the rest, which no loss term reads."""
    spec = methods.get_method("cope")
    # short rows: some examples hang on their trajectories' rows, the others need rows of their own
    mbs, _ = batching.build_minibatches(TRAJS, EXAMPLES, spec, LOSS, groups_per_minibatch=len(SUCCESS),
                                        row_len=36, rows_per_micro=2)
    batch, n_traj = mbs[0].batch, mbs[0].num_trajectories
    idx = np.asarray(batch.seq_index)
    kinds = [set((idx[m][idx[m] >= 0] >= n_traj).tolist()) for m in range(batch.num_micro)]
    assert kinds == sorted(kinds, key=lambda k: True in k) and all(len(k) == 1 for k in kinds)
    with_policy = [m for m, k in enumerate(kinds) if k == {False}]
    assert with_policy == list(range(6)) and batch.num_micro == 9  # so the passes run on 6, skip 3
    learner = train_step.Learner(fresh_model(), LOSS, OPT)
    filled = learner.fill_logprobs(batch, fresh_model())
    full = np.asarray(learner.logprobs(batch))  # every term's weights: every micro-batch runs
    for name in ("old_logp", "ref_logp"):
        got = np.asarray(getattr(filled, name))
        np.testing.assert_allclose(got[:6], full[:6], atol=1e-6)
        assert not got[6:].any() and full[6:].any()
    # and the step reads them only where policy tokens are: same loss as with every pass run
    complete = filled.replace(old_logp=full, ref_logp=full)
    a, _, _ = packed_loss_and_grads(_params(fresh_model()), filled)
    b, _, _ = packed_loss_and_grads(_params(fresh_model()), complete)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


@pytest.mark.parametrize("shape,row_axes", [((1, 2, 4), "fsdp"), ((2, 2, 2), "data")])
def test_sharded_step_equals_single_device(setup, shape, row_axes):
    # (2, 2, 2): the rows split over data only (2 rows), the parameters over fsdp and tp as before
    _, _, old, ref = setup
    spec = methods.get_method("cope")
    [(batch, terms, _, _)] = _packed(spec, LOSS, old, ref)
    mesh = models.make_mesh(shape)
    single = fresh_model()
    sharded = models.create_model(CFG, seed=0, mesh=mesh)
    assert sharded.lm_head[...].sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")
    before = [np.asarray(a) for a in jax.tree.leaves(_params(single))]
    with jax.set_mesh(mesh):
        placed = train_step.place_batch(batch, mesh)
        assert placed.tokens.sharding.spec[1] == row_axes  # rows split over the batch axes
        m_sharded = train_step.Learner(sharded, LOSS, OPT, mesh=mesh).step(placed)
    m_single = train_step.Learner(single, LOSS, OPT).step(batch)
    for key in ("loss", "pg_loss", "af_loss", "kl", "entropy", "grad_norm"):
        np.testing.assert_allclose(float(m_sharded[key]), float(m_single[key]), rtol=1e-5)
    assert sharded.layers.q_proj[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp", None)
    deltas = []
    for a, b, p0 in zip(jax.tree.leaves(_params(sharded)), jax.tree.leaves(_params(single)), before):
        deltas.append((np.asarray(a) - p0, np.asarray(b) - p0))
    scale = max(np.abs(d).max() for _, d in deltas)
    assert scale > 1e-2
    for got, want in deltas:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


def test_grpo_steps_favour_successful_rollouts(setup):
    # Behaviour, not parity: a few GRPO steps must raise the likelihood of the actions of rollouts
    # that succeeded in their group and lower that of those that failed (a sign error cannot pass).
    model = fresh_model()
    spec, cfg = methods.METHODS["grpo"], dataclasses.replace(LOSS, kl_coef=0.0, entropy_coef=0.0)
    trajs = [t for t in TRAJS if t.group_id in (0, 2)]    # mixed groups: both have a signal

    def action_logp(m):
        out = []
        for t in trajs:
            logits = m(jnp.asarray([t.tokens], jnp.int32)) / cfg.temperature
            logp = jax.nn.log_softmax(logits[0, :-1], -1)
            lp = jnp.take_along_axis(logp, jnp.asarray(t.tokens[1:])[:, None], -1)[:, 0]
            out.append(float(jnp.sum(lp * jnp.asarray(t.action_mask[1:]))))
        return np.array(out)

    before = action_logp(model)
    learner = train_step.Learner(model, cfg, train_step.OptimizerConfig(learning_rate=3e-3))
    for _ in range(3):
        mbs, _ = batching.build_minibatches(trajs, [], spec, cfg, groups_per_minibatch=2, row_len=ROW_LEN,
                                            rows_per_micro=ROWS)
        learner.train(mbs)
    delta = action_logp(model) - before
    won = np.array([t.success for t in trajs], bool)
    assert (delta[won] > 0).all() and (delta[~won] < 0).all(), (delta, won)


def test_a_zero_coefficient_switches_kl_and_entropy_off_with_their_metrics():
    """kl_coef 0: no reference pass, so no KL metric (it used to report a KL against zeros, near the
    clamp); entropy_coef 0: no entropy pass, so no entropy metric (it used to report 0)."""
    spec = methods.get_method("grpo")
    for kl, ent, want in ((1e-3, 1e-3, {"kl", "entropy"}), (0.0, 1e-3, {"entropy"}), (0.0, 0.0, set())):
        cfg = dataclasses.replace(LOSS, kl_coef=kl, entropy_coef=ent)
        mbs, _ = batching.build_minibatches(TRAJS, [], spec, cfg, groups_per_minibatch=len(SUCCESS),
                                            row_len=ROW_LEN, rows_per_micro=ROWS)
        learner = train_step.Learner(fresh_model(), cfg, OPT)
        [metrics] = learner.train(mbs, fresh_model() if kl else None)  # kl 0: no reference model needed
        assert {k for k in metrics if k in ("kl", "entropy")} == want, metrics
        if kl:
            assert 0 <= metrics["kl"] < 1e-3  # the policy is its own reference at the first step


def test_one_policy_minibatch_takes_old_logprobs_in_the_step_with_the_same_numbers():
    """One mini-batch sampled from the current parameters: `train` skips the old-log-prob pass
    (old = current, stop-gradient, inside the step) and gives the numbers of the separate pass."""
    spec = methods.get_method("cope")
    mbs, _ = batching.build_minibatches(TRAJS, EXAMPLES, spec, LOSS, groups_per_minibatch=len(SUCCESS),
                                        row_len=ROW_LEN, rows_per_micro=ROWS)
    assert len(mbs) == 1
    ref_model = fresh_model()
    separate = train_step.Learner(fresh_model(), LOSS, OPT)
    want = separate.step(separate.fill_logprobs(mbs[0].batch, ref_model))
    skipping = train_step.Learner(fresh_model(), LOSS, OPT)
    passes = []
    forward = skipping.logprobs
    skipping.logprobs = lambda batch, model=None: passes.append(model) or forward(batch, model)
    [got] = skipping.train(mbs, ref_model)
    assert passes == [ref_model]  # the reference pass only
    assert got["ppo_kl"] == 0 and got["pg_clip_frac"] == 0  # ratio exactly 1
    for key in ("loss", "pg_loss", "kl", "entropy", "af_loss", "grad_norm", "sampler_drift_mean",
                "sampler_drift_max"):
        np.testing.assert_allclose(got[key], float(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    for a, b in zip(jax.tree.leaves(_params(separate.model)), jax.tree.leaves(_params(skipping.model))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_token_ids_and_advantages_to_a_step_with_any_optax_transform():
    """The researcher's path: sequences of ids + action masks + advantages -> a packed batch ->
    loss_and_grads, and a step with a user-supplied optax transform (plain SGD here)."""
    rng = np.random.RandomState(5)
    tokens = [rng.randint(1, 64, n) for n in (20, 31, 17)]
    actions = [np.arange(len(t)) % 4 == 3 for t in tokens]
    advantages = np.array([1.0, -1.0, 0.5], np.float32)
    cfg = dataclasses.replace(LOSS, kl_coef=0.0, entropy_coef=0.0)
    segs = batching.sequence_segments(tokens, actions, advantages, ("pg",), cfg, row_len=ROW_LEN)
    batch, _ = batching.pack_minibatch(segs, ("pg",), ROW_LEN, rows_per_micro=2)
    model = fresh_model()
    params0 = jax.tree.map(np.asarray, nnx.as_pure(_params(model)))
    loss, grads, _ = jax.jit(lambda m, b: train_step.loss_and_grads(m, b, cfg, on_policy=True))(model, batch)
    # ratio 1 on every token, seq-mean-token-mean: each sequence's weights sum to 1/3
    assert float(loss) == pytest.approx(-advantages.mean(), rel=1e-6)
    metrics = train_step.Learner(model, cfg, optax.sgd(0.1)).step(batch, on_policy=True)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
    for p, p0, g in zip(jax.tree.leaves(nnx.as_pure(_params(model))), jax.tree.leaves(params0),
                        jax.tree.leaves(nnx.as_pure(grads))):
        np.testing.assert_allclose(np.asarray(p), p0 - 0.1 * np.asarray(g), atol=1e-6)


@pytest.mark.parametrize("others", [True, False], ids=["kl_entropy", "pg_af_only"])
def test_per_term_gradient_norms_equal_a_direct_computation(setup, others, monkeypatch):
    """grad_norm_pg / grad_norm_af: the norm of each term's own gradient (coefficient included),
    against the full-logits reference with only that term's column. With KL and entropy on, each
    asked term has its own pass; with pg and af the only terms, af's is the total minus pg's."""
    _, params, _, _ = setup
    spec = methods.get_method("cope")
    cfg = dataclasses.replace(LOSS, grad_norm_terms=("af", "pg"))
    if not others:
        cfg = dataclasses.replace(cfg, kl_coef=0.0, entropy_coef=0.0)
    mbs, _ = batching.build_minibatches(TRAJS, EXAMPLES, spec, cfg, groups_per_minibatch=len(SUCCESS),
                                        row_len=ROW_LEN, rows_per_micro=ROWS)
    passes = []
    real = train_step.loss_and_grads
    monkeypatch.setattr(train_step, "loss_and_grads", lambda *a, **k: passes.append(a[3]) or real(*a, **k))
    learner = train_step.Learner(fresh_model(), cfg, OPT)
    [metrics] = learner.train(mbs, fresh_model())  # one mini-batch: old = current logp
    assert len(passes) == (3 if others else 2)  # traced once: the total, then one per term not derived
    _, _, lp0 = reference_loss_and_grads(params, jnp.zeros((len(SEQS), 6)), jnp.zeros(len(SEQS)),
                                         jnp.zeros(TOKENS.shape), jnp.zeros(TOKENS.shape))
    adv, _ = advantages.compute_advantages(spec, TRAJS, cfg)
    adv_seq = np.r_[adv, np.zeros(len(EXAMPLES))].astype(np.float32)
    coef = reference_coefficients(spec, cfg, list(range(len(TRAJS))), list(range(len(EXAMPLES))))
    norms = {}
    for term, col in (("pg", PG), ("af", AF), ("all", slice(None))):
        only = np.zeros_like(coef)
        only[:, col] = coef[:, col]
        _, grads, _ = reference_loss_and_grads(params, jnp.asarray(only, jnp.float32), adv_seq, lp0, lp0)
        norms[term] = float(optax.tree.norm(grads))
    assert norms["pg"] > 0 and norms["af"] > 0
    np.testing.assert_allclose(metrics["grad_norm_pg"], norms["pg"], rtol=1e-4)
    np.testing.assert_allclose(metrics["grad_norm_af"], norms["af"], rtol=1e-4)
    np.testing.assert_allclose(metrics["grad_norm"], norms["all"], rtol=1e-4)
    assert "grad_norm_kl" not in metrics
