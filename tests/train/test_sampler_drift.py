"""The sampler / trainer drift metric compares like with like: tokens the sampler drew at a
temperature, scored by the trainer at the same temperature with the same weights, drift ~0; the
metric still sees a real mismatch (the trainer at another temperature)."""
import dataclasses

import jax
import numpy as np
import optax
import pytest

from cope_jax.batch import batching
from cope_jax.objective import methods
from cope_jax.train import train_step
from cope_jax.rollout.sampler import Sampler
from cope_jax.rollout.trajectory import Trajectory
from models import qwen
from tests.train.test_train_step import CFG

PROMPTS = [[3, 9, 4, 12, 7], [5, 1, 2, 8, 30, 11, 6], [40, 2, 2, 9], [17, 21, 5, 5, 5, 8]]
NEW = 12


def _sampled(model, temperature):
    """Trajectories of the sampler's turns at `temperature` (two groups of two, one success each)."""
    sampler = Sampler(model, batch_size=len(PROMPTS), max_len=64, eos_ids=[], prefill_chunk=16)
    out = sampler.generate(sampler.start(PROMPTS), max_new_tokens=NEW, temperature=temperature,
                           key=jax.random.key(0))
    trajs = []
    for i, (prompt, toks, lps) in enumerate(zip(PROMPTS, out.tokens, out.logprobs)):
        action = np.r_[np.zeros(len(prompt), bool), np.ones(len(toks), bool)]
        trajs.append(Trajectory(tokens=np.r_[prompt, toks], action_mask=action, obs_mask=np.zeros_like(action),
                                sampler_logp=np.r_[np.zeros(len(prompt)), lps], success=i % 2,
                                group_id=i // 2, observations=["o"], action_spans=np.zeros((0, 2), np.int32)))
    return trajs


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_drift_is_numeric_only_at_the_sampling_temperature(temperature):
    model = qwen.create_model(CFG, seed=1)
    trajs = _sampled(model, temperature)
    spec = methods.get_method("grpo")

    def drift(trainer_temperature):
        cfg = dataclasses.replace(methods.LossConfig(), temperature=trainer_temperature, kl_coef=0.0)
        [mb], _ = batching.build_minibatches(trajs, [], spec, cfg, groups_per_minibatch=2, row_len=64,
                                             rows_per_micro=2)
        learner = train_step.Learner(model, cfg, optax.sgd(0.0))
        metrics = learner.step(learner.fill_logprobs(mb.batch))
        return float(metrics["sampler_drift_mean"]), float(metrics["sampler_drift_max"])

    mean, peak = drift(temperature)
    assert mean < 1e-5 and peak < 1e-4, (mean, peak)
    # a tiny random model's logits are nearly flat: the temperature moves them by ~0.03 nats a token
    mismatched, _ = drift(1.0 if temperature != 1.0 else 0.7)
    assert mismatched > 1e-2 and mismatched > 1000 * mean, (mismatched, mean)
