"""The fused train step: packed micro-batches -> one AdamW update, for any registered method.

One step = one PPO mini-batch (`cope_jax/batch/batching.py`): a PackedBatch [micro, rows, L] and the loss
terms it optimizes (`cope_jax/objective/methods.py`). Inside one jitted function:

1. `lax.scan` over micro-batches. Each micro-batch runs the decoder over its packed rows, then the
   chunked per-token logprobs / entropies (`cope_jax/train/logprobs.py`; the [tokens, vocab] logits never
   exist at once), then the fused loss `sum_term coef_term * term` (`cope_jax/objective/losses.py`). The
   coefficients are a runtime input (0 for terms outside the method): every method, the
   sequential AF step and any coefficient schedule run the same executable; only the entropy
   (an extra pass over the vocabulary) is a static switch.
2. Gradients and additive metrics are summed over micro-batches. Every term is a weighted token sum
   whose weights were normalized over the whole mini-batch on the host, so the sum over
   micro-batches *is* the mini-batch loss and gradient: accumulation is exact, never an average of
   per-micro-batch means.
3. optax: clip_by_global_norm(1.0) then AdamW (method §2), through `nnx.Optimizer(model, tx, wrt=...)`
   over every parameter, or under LoRA (`QwenConfig.lora`) over the adapters only: the frozen base
   weights enter the step as an input of their own, neither differentiated nor donated.

Forward-only jitted functions give `old_logp` (the rollout parameters, before the first update of a
train batch) and `ref_logp` (the frozen reference policy) on the same packed rows.

Under a mesh the rows of each micro-batch are split over ('data', 'fsdp') (`place_batch`); params and
optimizer state keep their shardings (`models/sharding.py`) through the step (pinned out_shardings,
donated inputs).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cope_jax.train import logprobs as lp
from cope_jax.objective import losses
from cope_jax.objective.methods import TERMS, LossConfig, needing, ordered, reported
from cope_jax.batch.packing import TOKEN_FIELDS, PackedBatch
from models import loops, qwen
from models import sharding as shd


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping; method §2 defaults (constant lr). `decay_steps` > 0: a short
    linear warm-up, then cosine decay to `learning_rate * final_lr_fraction` at that step (the
    supervised warm start uses it). Otherwise `warmup_steps` > 0: a linear warm-up to a constant
    rate. A fresh AdamW state makes its first updates lr x sign(g) on every parameter (the second
    moment has seen one gradient), which at a rate that suits later steps throws a policy far off."""

    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    decay_steps: int = 0
    final_lr_fraction: float = 0.05
    warmup_steps: int = 0

    def schedule(self) -> optax.Schedule | float:
        if self.decay_steps > 1:
            return optax.warmup_cosine_decay_schedule(
                0.0, self.learning_rate, warmup_steps=max(1, self.decay_steps // 20),
                decay_steps=self.decay_steps, end_value=self.learning_rate * self.final_lr_fraction)
        if self.warmup_steps > 0 and self.decay_steps == 0:
            return optax.linear_schedule(0.0, self.learning_rate, transition_steps=self.warmup_steps)
        return self.learning_rate  # constant, or a one-step decay: no room to warm up or decay


@functools.lru_cache(maxsize=None)
def make_optimizer(cfg: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    """clip_by_global_norm then AdamW. Cached per config: optax transforms are stateless, and one
    object per config keeps equal Learners' graphdefs equal, so they share compiled steps."""
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(cfg.schedule(), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay))


def model_logprobs(model, batch: PackedBatch, cfg: LossConfig, *, with_entropy: bool, mesh=None):
    """One micro-batch [rows, L] -> (logp, entropy) [rows, L] in token coordinates."""
    hidden = model.hidden_states(batch.tokens, batch.positions, batch.segment_ids, batch.branch_ids)
    return lp.token_logprobs(hidden, model.lm_head_weight(), batch.tokens, batch.segment_ids,
                             branch_ids=batch.branch_ids,
                             temperature=cfg.temperature, chunk_tokens=cfg.logits_chunk_tokens,
                             with_entropy=with_entropy, mesh=mesh)


def _drift_sums(sampler_logp, old_logp, weight) -> dict:
    """|sampler_logp - old_logp| over the sampled tokens (weight > 0): the sampler / trainer
    mismatch (method §1), as additive sums and a max."""
    sampled = weight > 0
    diff = jnp.where(sampled, jnp.abs(sampler_logp - old_logp), 0.0)
    return {"sampler_drift_sum": diff.sum(), "sampler_drift_max": diff.max(initial=0.0),
            "sampler_drift_tokens": sampled.sum().astype(jnp.float32)}


def micro_loss(model, batch: PackedBatch, coefs: dict, cfg: LossConfig, *, on_policy: bool = False, mesh=None):
    """Fused loss of one micro-batch [rows, L]: (sum_term coefs[term] * term, additive metrics).

    `coefs` maps each term the batch carries weights for to its coefficient (`TERMS` gives its
    loss). `on_policy`: the batch was sampled from these very parameters, so the old log-probs are
    the current ones (stop-gradient) and no separate forward pass gave them.
    """
    with_entropy = bool(needing(coefs, "entropy"))
    logp, ent = model_logprobs(model, batch, cfg, with_entropy=with_entropy, mesh=mesh)
    if on_policy:
        batch = batch.replace(old_logp=jax.lax.stop_gradient(logp))
    uses_old = needing(coefs, "old_logp")
    sampled = sum(batch.weights[t] for t in uses_old) if uses_old else None  # before any correction
    corrected = {}
    if uses_old and cfg.rollout_correction != "none":
        factor, corrected = losses.rollout_correction(
            batch.old_logp, batch.sampler_logp, sampled, mode=cfg.rollout_correction,
            low=cfg.rollout_correction_low, high=cfg.rollout_correction_high)
        batch = batch.replace(weights={t: w * factor if t in uses_old else w for t, w in batch.weights.items()})
    total = jnp.zeros((), jnp.float32)
    metrics = {}
    for term in ordered(coefs):
        with jax.named_scope(f"loss_{term}"):
            value, m = TERMS[term].loss(logp, ent, batch.weights[term], batch, cfg)
        total = total + coefs[term] * value
        metrics.update(m)
    if uses_old:
        metrics.update(_drift_sums(batch.sampler_logp, batch.old_logp, sampled), **corrected)
    metrics["loss"] = total
    metrics["tokens"] = jnp.sum((batch.segment_ids > 0).astype(jnp.float32))
    return total, metrics


def loss_and_grads(model, batch: PackedBatch, cfg: LossConfig, coefs: dict | None = None, *,
                   on_policy: bool = False, mesh=None):
    """batch [micro, rows, L] -> (loss, grads (nnx.State of the trained params: all of them, or the
    LoRA adapters), additive metric sums).

    The loss is sum_term coefs[term] * term over the terms the batch carries weights for; `coefs`
    defaults to the config's (`LossConfig.coefficients`), and terms it switches off are ignored.
    Traceable (call it under jit); the step and the tests share it.
    """
    coefs = _coefficients(batch, cfg) if coefs is None else coefs
    # the trained parameters (all, or the LoRA adapters) and the rest, held constant
    graphdef, params, rest = nnx.split(model, qwen.trainable(model.cfg), ...)

    def one(p, mb):
        return micro_loss(nnx.merge(graphdef, p, rest), mb, coefs, cfg, on_policy=on_policy, mesh=mesh)

    grad_fn = jax.value_and_grad(one, has_aux=True)

    def accumulate(carry, mb):
        grads, sums = carry
        (_, metrics), g = grad_fn(params, mb)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return grads, losses.accumulate_metrics(sums, metrics)

    def body(carry, mb):
        # micro-batches without a token of these terms cost nothing: padding (a mini-batch padded
        # to a compiled size), or the other terms' rows when one term's gradient is asked alone
        carries = _carries([mb.weights[t] for t in coefs])
        return jax.lax.cond(carries, accumulate, lambda c, _: c, carry, mb), None

    like_params = functools.partial(_like_params, mesh=mesh)
    zeros = like_params(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    _, metric_shapes = jax.eval_shape(one, params, batch.micro(0))
    sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
    (grads, sums), _ = loops.scan("micro", body, (zeros, sums0), batch)
    grads = like_params(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params))
    return sums["loss"], grads, sums


def _coefficients(batch: PackedBatch, cfg: LossConfig) -> dict:
    """{term: float32 coefficient} of the batch's terms the config keeps active."""
    return {t: jnp.float32(c) for t, c in cfg.coefficients(batch.weights).items()}


def _like_params(tree, mesh):
    """Shards a params-shaped tree (the float32 gradient accumulator) like the parameters, so it
    is never replicated under FSDP."""
    if mesh is None:
        return tree
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, qwen.state_shardings(tree, mesh))


def _batch_sharding(shape, mesh):
    """Rows (axis 0 of [rows, L], axis 1 of [micro, rows, L]) split over the batch axes."""
    axes = ("batch",) if len(shape) == 2 else (None, "batch")
    return shd.named_sharding(axes + (None,) * (len(shape) - len(axes)), shape, mesh)


def place_batch(batch: PackedBatch, mesh=None) -> PackedBatch:
    """Batch [micro, rows, L] (or [rows, L]) -> device arrays, rows split over the batch axes.
    Arrays already placed that way are not moved."""
    def put(a):
        if mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, _batch_sharding(np.shape(a), mesh))
    return jax.tree.map(put, batch)


def abstract_batch(shape: tuple[int, int, int], terms, mesh=None) -> PackedBatch:
    """A PackedBatch of abstract [micro, rows, L] arrays with weights of `terms`, laid out as
    `place_batch` places them."""
    sharding = None if mesh is None else _batch_sharding(shape, mesh)

    def leaf(name):
        return jax.ShapeDtypeStruct(shape, np.dtype(TOKEN_FIELDS.get(name, np.int32)), sharding=sharding)

    fields = {f.name: leaf(f.name) for f in dataclasses.fields(PackedBatch) if f.name != "weights"}
    return PackedBatch(**fields, weights={t: leaf("old_logp") for t in terms})


def abstract_train_state(model_cfg: qwen.QwenConfig, opt_cfg: OptimizerConfig, mesh):
    """(graphdef, abstract state) of a Learner's (model, optimizer) on `mesh`, laid out as the
    Learner lays them out; nothing is allocated. (Under LoRA the state includes the frozen base:
    `nnx.split` by `qwen.frozen` parts it as the Learner does.)"""
    def build():
        model = qwen.Qwen(model_cfg, rngs=nnx.Rngs(0), mesh=mesh)
        return model, nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=qwen.trainable(model_cfg))

    graphdef, state = nnx.split(nnx.eval_shape(build))
    shardings = qwen.state_shardings(state, mesh)
    return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def _train_step(graphdef, state, batch, coefs, frozen=None, *, cfg, on_policy, mesh):
    model, optimizer = nnx.merge(graphdef, state) if frozen is None else nnx.merge(graphdef, frozen, state)
    _, grads, sums = loss_and_grads(model, batch, cfg, coefs, on_policy=on_policy, mesh=mesh)
    metrics = losses.finalize_metrics(sums)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics |= _term_grad_norms(model, batch, cfg, coefs, grads, on_policy=on_policy, mesh=mesh)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer), nnx.Not(qwen.frozen(model.cfg))), metrics


def _term_grad_norms(model, batch, cfg, coefs, grads, *, on_policy, mesh) -> dict:
    """{grad_norm_<term>} of the asked terms (`cfg.grad_norm_terms`), each from its own pass over the
    rows, except that when the asked terms are all the batch's terms the last one's gradient is the
    total minus the others' (the loss is linear in its terms: one pass fewer, exact up to rounding)."""
    asked = [t for t in cfg.grad_norm_terms if t in coefs]
    derived = asked.pop() if len(asked) > 1 and set(asked) == set(coefs) else None  # condition first
    norms, rest = {}, grads
    for term in asked:
        _, term_grads, _ = loss_and_grads(model, batch, cfg, {term: coefs[term]}, on_policy=on_policy, mesh=mesh)
        norms[f"grad_norm_{term}"] = optax.tree.norm(term_grads)
        if derived:
            rest = jax.tree.map(lambda r, g: r.astype(jnp.float32) - g.astype(jnp.float32), rest, term_grads)
    if derived:
        norms[f"grad_norm_{derived}"] = optax.tree.norm(rest)
    return norms


def _carries(weights) -> jax.Array:
    """Whether a micro-batch holds a token any of these per-term weights weighs (padding
    micro-batches and the rows of other terms do not: the step and the forward passes skip them)."""
    return functools.reduce(jnp.logical_or, [jnp.any(w != 0) for w in weights])


def _logprobs(graphdef, params, batch, *, cfg, mesh):
    model = nnx.merge(graphdef, params)

    def one(mb):
        return jax.lax.cond(_carries(mb.weights.values()),
                            lambda mb: model_logprobs(model, mb, cfg, with_entropy=False, mesh=mesh)[0],
                            lambda mb: jnp.zeros(mb.tokens.shape, jnp.float32), mb)

    return loops.map("micro", one, batch)


# Compiled functions are cached on their static inputs, so Learners of the same model, method and
# optimizer config (e.g. a second run in one process) reuse the executables.
@functools.lru_cache(maxsize=64)
def _compiled_step(graphdef, cfg, on_policy, mesh, sharding_leaves, sharding_treedef):
    shardings = jax.tree.unflatten(sharding_treedef, sharding_leaves)
    fn = functools.partial(_train_step, graphdef, cfg=cfg, on_policy=on_policy, mesh=mesh)
    return jax.jit(fn, donate_argnums=0, out_shardings=(shardings, None))


@functools.lru_cache(maxsize=64)
def _compiled_logprobs(graphdef, cfg, mesh):
    return jax.jit(functools.partial(_logprobs, graphdef, cfg=cfg, mesh=mesh))


def step_program(graphdef, state_shardings, cfg: LossConfig, mesh, on_policy: bool = False):
    """The jitted train step: (state, batch [micro, rows, L], coefs {term: coefficient}[, frozen]) ->
    (state, metrics); the batch's weights and `coefs` name the same terms. `state` (donated) is
    everything the step updates; under LoRA the frozen base weights come apart as `frozen`
    (`qwen.frozen`), read and never donated (the reference policy reads the same arrays)."""
    leaves, treedef = jax.tree.flatten(state_shardings)
    return _compiled_step(graphdef, cfg.device_part(), on_policy, mesh, tuple(leaves), treedef)


def logprobs_program(graphdef, cfg: LossConfig, mesh):
    """The jitted forward-only pass: (params, batch [micro, rows, L]) -> logp [micro, rows, L]."""
    return _compiled_logprobs(graphdef, cfg.device_part(), mesh)


def _committed(tree, mesh=None):
    """The same arrays committed to their current shardings (no copy when they already are):
    jit keys executables on committedness, so the policy and a freshly created reference model
    would otherwise compile the same forward twice. Under a mesh, leaves created off the mesh
    (e.g. the optimizer's step counter) are replicated on it."""
    def target(a):
        if mesh is not None and not isinstance(a.sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return a.sharding
    return jax.device_put(tree, jax.tree.map(target, tree))


class Learner:
    """The policy, its optimizer state and the compiled steps of one run.

    `train(minibatches, ref_model)` runs one train batch sampled from the current parameters: the
    old / reference log-probs of every mini-batch first (so `old_logp` is the rollout policy for
    all of them), then one optimizer step per mini-batch. `optimizer`: an `OptimizerConfig`
    (clipping + AdamW, method §2) or any optax transform.
    """

    def __init__(self, model, cfg: LossConfig,
                 optimizer: OptimizerConfig | optax.GradientTransformation = OptimizerConfig(), *, mesh=None):
        self.model = model
        self.cfg = cfg
        self.mesh = mesh
        tx = make_optimizer(optimizer) if isinstance(optimizer, OptimizerConfig) else optimizer
        self.optimizer = nnx.Optimizer(model, tx, wrt=qwen.trainable(model.cfg))
        self._frozen = qwen.frozen(model.cfg)
        self._graphdef, frozen, state = nnx.split((model, self.optimizer), self._frozen, ...)
        # committed now, so the step's outputs (pinned to the same shardings) hit the executable
        # compiled for its first inputs
        for part in (frozen, state):
            part = _committed(part) if mesh is None else jax.device_put(part, qwen.state_shardings(part, mesh))
            nnx.update((model, self.optimizer), part)
        self._shardings = jax.tree.map(lambda a: a.sharding, self._state())

    def step_program(self, on_policy: bool = False):
        """The compiled step (`step_program`) of this learner's state."""
        return step_program(self._graphdef, self._shardings, self.cfg, self.mesh, on_policy)

    # -- public API --------------------------------------------------------------------------------
    def step(self, batch: PackedBatch, *, on_policy: bool = False) -> dict[str, jax.Array]:
        """One optimizer step on a placed or host batch [micro, rows, L] over the terms it carries
        weights for; returns its metrics. `on_policy`: no update since the batch was sampled, so
        its old log-probs are the current ones, taken inside the step (`fill_logprobs` skips them)."""
        batch = self._active(batch)
        coefs = _coefficients(batch, self.cfg)
        frozen = nnx.state((self.model, self.optimizer), self._frozen) if self.model.cfg.lora is not None else None
        new_state, metrics = self.step_program(on_policy)(self._state(), place_batch(batch, self.mesh), coefs, frozen)
        nnx.update((self.model, self.optimizer), new_state)
        return {k: v for k, v in metrics.items() if reported(k, coefs)}

    def _state(self):
        """What the step updates (and donates): the model and optimizer less the frozen base."""
        return nnx.state((self.model, self.optimizer), nnx.Not(self._frozen))

    def _active(self, batch: PackedBatch) -> PackedBatch:
        """The batch without the weights of terms the config switches off."""
        active = self.cfg.active_terms(batch.weights)
        return batch.replace(weights={t: batch.weights[t] for t in active})

    def logprobs(self, batch: PackedBatch, model=None) -> jax.Array:
        """Forward-only logp [micro, rows, L] of `model` (default: the policy) on the packed rows;
        0 in the micro-batches without a token the batch's terms weigh (they are not run)."""
        model = self.model if model is None else model
        fn = logprobs_program(nnx.graphdef(model), self.cfg, self.mesh)
        return fn(_committed(nnx.state(model, nnx.Param)), place_batch(batch, self.mesh))

    def fill_logprobs(self, batch: PackedBatch, ref_model=None, *, on_policy: bool = False) -> PackedBatch:
        """Places a host batch and adds what its terms need: old_logp (the current policy's; not
        with `on_policy`, where the step takes them) and ref_logp (`ref_model`'s). The log-probs
        stay on the devices, in the batch's sharding (on several hosts no host holds all of them).

        Each pass runs only on the micro-batches holding tokens of the terms that read its field
        (trajectory rows, not forecasting rows); the rest stays 0.
        """
        batch = self._active(batch)
        models = {"old_logp": None if on_policy else self.model, "ref_logp": ref_model}
        wanted = {f: needing(batch.weights, f) for f in models if not (f == "old_logp" and on_policy)}
        batch = place_batch(batch, self.mesh)
        for field, terms in wanted.items():
            if not terms:
                continue
            if models[field] is None:
                raise ValueError(f"the {' / '.join(terms)} term needs a reference model")
            readers = batch.replace(weights={t: batch.weights[t] for t in terms})
            batch = batch.replace(**{field: self.logprobs(readers, models[field])})
        return batch

    def train(self, minibatches, ref_model=None) -> list[dict]:
        """One train batch: `minibatches` (`cope_jax.batch.batching.MiniBatch`es, in order), sampled from
        the current parameters. When only the first reads old log-probs (one policy mini-batch, one
        epoch), they are the parameters' own at its step: it runs `on_policy`, without that pass."""
        with_old = [i for i, mb in enumerate(minibatches) if needing(self.cfg.active_terms(mb.terms), "old_logp")]
        on_policy = with_old == [0]
        filled = [self.fill_logprobs(mb.batch, ref_model, on_policy=on_policy and i == 0)
                  for i, mb in enumerate(minibatches)]
        # every step dispatched before any metric is read: the host never waits between steps
        metrics = [self.step(batch, on_policy=on_policy and i == 0) for i, batch in enumerate(filled)]
        return [{k: float(v) for k, v in m.items()} for m in jax.device_get(metrics)]
