"""python -m tests.stages.float64_demo_batch: the loss and gradients of the demo's first
mini-batch in float64, by this code and by the code before the reordering (6f9bd15: its dense
attention, one query block, scanned layers, projections differentiated by plain autodiff),
printed as one JSON line of relative differences. Run under JAX_ENABLE_X64=1 (`test_unchanged.py`)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def old_dense(q, k, v, ids, block=None):
    """6f9bd15's `models.attention.dense`: tokens before heads, the whole row in one block."""
    from models import attention as attn
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (D ** -0.5)
    s = jnp.where(attn.dense_mask(ids)[:, None, None], s, attn.NEG_INF)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H, D)


def first_minibatch(parts, trajs, examples):
    """The demo step's first mini-batch (numpy [micro, rows, L]) with old / reference log-probs."""
    from cope_jax.batch.batching import build_minibatches
    from cope_jax.train.train_step import Learner
    from cope_jax.run import run_config

    c = parts.config
    mbs, _ = build_minibatches(trajs, examples, parts.spec, parts.loss_cfg,
                               groups_per_minibatch=c.train.minibatch_tasks, row_len=c.train.row_len,
                               rows_per_micro=run_config.rows_per_micro(c, parts.mesh))
    learner = Learner(parts.model, parts.loss_cfg, parts.opt_cfg)
    filled = learner.fill_logprobs(mbs[0].batch, parts.model)
    return jax.tree.map(np.asarray, filled)


def loss_and_grads(model, batch, loss_cfg):
    from cope_jax.train import train_step
    fn = jax.jit(lambda m, b: train_step.loss_and_grads(m, b, loss_cfg)[:2])
    from models import qwen
    loss, grads = fn(model, batch)
    return float(loss), {k: np.asarray(v) for k, v in qwen.flat_params(grads).items()}


def main():
    assert jax.config.jax_enable_x64, "run with JAX_ENABLE_X64=1"
    from launch.bench import loss as bench_loss
    from models import attention as attn
    from models import linear, qwen

    parts, trajs, examples = bench_loss.demo_phase()
    try:
        cfg = parts.model.cfg.replace(dtype="float64", param_dtype="float64")
        graphdef, state = nnx.split(qwen.abstract_model(cfg))
        state = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), nnx.state(parts.model, nnx.Param))
        parts.model = nnx.merge(graphdef, state)
        batch = first_minibatch(parts, trajs, examples)
        new = loss_and_grads(parts.model, batch, parts.loss_cfg)
        old_graphdef, _ = nnx.split(qwen.abstract_model(cfg.replace(scan_layers=True, attention_block=512)))
        attn.dense = old_dense
        linear.project = lambda equation, x, w, n_in, platform: jnp.einsum(equation, x, w)
        old = loss_and_grads(nnx.merge(old_graphdef, state), batch, parts.loss_cfg)
    finally:
        parts.close()
    grads = {k: float(np.abs(new[1][k] - old[1][k]).max() / np.abs(old[1][k]).max()) for k in old[1]}
    print(json.dumps({"loss": new[0], "old_loss": old[0], "loss_rel": abs(new[0] - old[0]) / abs(old[0]),
                      "grad_rel": grads, "dtype": str(next(iter(new[1].values())).dtype),
                      "tokens": int((batch.segment_ids > 0).sum()), "terms": sorted(batch.weights)}))


if __name__ == "__main__":
    main()
