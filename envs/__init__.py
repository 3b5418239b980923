"""Environments: the family protocol (base), action parsing, the family registry, the worker
process pool, and the families themselves (builtin, sciworld; chaos for fault tests).

Nothing here imports JAX, cope_jax or models: pool workers may run under another interpreter.
Environment packages (scienceworld, ...) are imported lazily, inside the worker that needs them.
"""
