"""Environments: the family protocol (base), action parsing, the family registry, the worker
process pool, and the families themselves (builtin, sciworld, alfworld, tau2, webshop, appworld;
chaos for fault tests). envs/setup/ makes the own interpreters of families whose packages cannot
share the main stack (AppWorld, WebShop).

Nothing here imports JAX, cope_jax or models: pool workers may run under another interpreter.
Environment packages (scienceworld, tau2, alfworld, ...) are imported lazily, inside the worker
that needs them.
"""
