"""The stages of a run, each a function of the `Components` that `cope_jax/run/build.py` makes:
`warmstart.py` (supervised, on expert demonstrations), `rl.py` (the method's RL loop, checkpointed
and resumable) and `evaluate.py`. `loop.py` holds what they share: playing episodes and the step loop."""
