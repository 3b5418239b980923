"""Environment families by name: one declarative table, imported lazily.

Each entry names the family's class as a "module:Class" string, so neither the trainer nor a pool
worker imports a family (or its packages) until it is used. A family may run its workers under its
own Python interpreter (its own virtual environment: AppWorld pins pydantic 1, tau2 needs pydantic 2,
ALFWorld compiles native code): the interpreter is, in order, the `python` given to the pool, the
environment variable named by `python_env` (e.g. COPE_ENV_PYTHON_SCIWORLD=/opt/sw/bin/python), or
the trainer's own `sys.executable`.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FamilySpec:
    """How to build and run one environment family."""
    name: str
    target: str                               # "module:Class" of an envs.base.EnvFamily
    call_timeout: float = 60.0                # default per-call timeout in the pool (seconds)
    start_timeout: float = 120.0              # worker start-up (interpreter + imports)
    # a worker runs its instances' calls at once, a thread per instance: for families whose instances are
    # independent and whose calls release the GIL (ScienceWorld: one JVM per instance, reached
    # over a socket); pure-Python or shared-state families answer one call at a time
    concurrent_instances: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    # variables of the trainer's environment the workers read, beyond envs/processes.py's BASE_ENV (the
    # rest, credentials included, stay in the trainer)
    env_vars: tuple[str, ...] = ()
    # workers start in an empty directory of their own: for families that run the policy's code
    own_cwd: bool = False

    @property
    def python_env(self) -> str:
        return f"COPE_ENV_PYTHON_{self.name.upper()}"


FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec for spec in (
        FamilySpec("builtin", "envs.builtin:BuiltinEnv", call_timeout=10.0),
        FamilySpec("sciworld", "envs.sciworld:SciWorldEnv", call_timeout=60.0, concurrent_instances=True),
        # ScienceWorld stepping each task's gold path whatever the model says: the tail on the real engine
        FamilySpec("sciworld_gold", "envs.sciworld_gold:GoldSciWorldEnv", call_timeout=60.0,
                   concurrent_instances=True),
        FamilySpec("alfworld", "envs.alfworld:AlfWorldEnv", call_timeout=60.0, env_vars=("ALFWORLD_DATA",)),
        FamilySpec("webshop", "envs.webshop:WebShopEnv", call_timeout=60.0, start_timeout=300.0,
                   env_vars=("WEBSHOP_ROOT",)),
        # the policy's code runs in AppWorld's REPL inside the worker
        FamilySpec("appworld", "envs.appworld:AppWorldEnv", call_timeout=120.0,
                   start_timeout=300.0, env_vars=("APPWORLD_ROOT",), own_cwd=True),
        FamilySpec("tau2", "envs.tau2:Tau2Env", call_timeout=120.0, start_timeout=180.0,
                   env_vars=("COPE_TAU2_LOG_LEVEL",)),
        # Fault injection for the pool's tests (crash / hang / raise on command).
        FamilySpec("chaos", "envs.chaos:ChaosEnv", call_timeout=10.0),
        # Episodes of known, long-tailed lengths: the rollout's tail, measured and tested.
        # (instances independent, a call's time a sleep: they answer at once, like ScienceWorld's JVMs)
        FamilySpec("tail", "envs.tail:TailEnv", call_timeout=10.0, concurrent_instances=True),
    )
}


def get_spec(name: str) -> FamilySpec:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown environment family {name!r}; known: {sorted(FAMILIES)}") from None


def import_target(target: str):
    """The class named by a "module:Class" string."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_family(name: str, **kwargs: Any):
    """An instance of a family (static side usable at once; live side opens on reset)."""
    spec = get_spec(name)
    return import_target(spec.target)(**{**spec.kwargs, **kwargs})


def family_python(spec: FamilySpec | str, override: str | None = None) -> str:
    """The interpreter that runs this family's workers."""
    if override:
        return override
    spec = get_spec(spec) if isinstance(spec, str) else spec
    return os.environ.get(spec.python_env) or sys.executable
