"""The package tree is the data flow: a `cope_jax` package imports only packages below it (function-
level imports included), and `models/` imports neither `cope_jax` nor `envs`."""
import ast
import os

import pytest

from tests.paths import ROOT

# bottom to top: trajectories come out of the rollout, learning consumes them, a run wires both,
# its stages drive the run, the planner compiles the run's programs
LAYERS = ("rollout", "learning", "run", "stages", "plan")


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "cope_jax" else {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _modules(folder: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def test_every_cope_jax_module_lives_in_a_layer():
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "cope_jax")) if f.endswith(".py") and f != "__init__.py")
    packages = sorted(d for d in os.listdir(os.path.join(ROOT, "cope_jax"))
                      if os.path.isfile(os.path.join(ROOT, "cope_jax", d, "__init__.py")))
    assert top == [] and packages == sorted(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_package_imports_only_packages_below_it(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    bad = []
    for path in _modules(os.path.join("cope_jax", layer)):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "cope_jax" and len(parts) > 1 and parts[1] in above:
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
            if parts[0] == "launch":
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad


def test_models_import_neither_cope_jax_nor_envs():
    bad = [f"{os.path.relpath(p, ROOT)} imports {n}" for p in _modules("models") for n in _imports(p)
           if n.split(".")[0] in ("cope_jax", "envs", "launch")]
    assert not bad, bad
