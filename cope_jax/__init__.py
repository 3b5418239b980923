"""CoPE (co-evolving acting and forecasting) for Qwen-family language agents in JAX / Flax NNX."""
