"""The rollout: the tokenizer and chat format on ids, the sampler, the rollout loop and its
trajectories."""
