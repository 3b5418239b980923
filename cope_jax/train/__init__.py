"""The device side: the chunked log-prob pass and the jitted train step (the Learner), JAX programs
on the training mesh."""
