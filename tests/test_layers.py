"""The package tree is the data flow: a `cope_jax` package imports only packages below it (function-
level imports included), and `models/` imports neither `cope_jax` nor `envs`."""
import ast
import os

import pytest

from tests.paths import ROOT

# bottom to top: trajectories come out of the rollout; the objective (the method's pure functions:
# advantages, losses, the registry of terms and methods) is read by the host's batch preparation
# (NumPy) and the device's train step (JAX); a run wires them, its stages drive the run, the planner
# compiles the run's programs
LAYERS = ("rollout", "objective", "batch", "train", "run", "stages", "plan")


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


def _back_imports(layer: str, paths) -> list[str]:
    """`path imports name` for each import in `paths` (modules of `layer`) of a layer above it or of launch/."""
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    bad = []
    for path in paths:
        for name in _imports(path):
            parts = name.split(".")
            if (parts[0] == "cope_jax" and len(parts) > 1 and parts[1] in above) or parts[0] == "launch":
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_a_package_imports_only_packages_below_it(layer):
    bad = _back_imports(layer, _modules(os.path.join("cope_jax", layer)))
    assert not bad, bad


@pytest.mark.parametrize("source", ["from cope_jax.train import train_step",
                                    "from cope_jax.train.train_step import Learner",
                                    "def f():\n    import cope_jax.stages.rl",
                                    "from cope_jax import run"])
def test_a_back_import_is_caught_even_inside_a_function(tmp_path, source):
    """The host side (batch/) importing the device side, a stage or a run: each one is reported."""
    module = tmp_path / "back.py"
    module.write_text(source + "\n")
    assert _back_imports("batch", [str(module)]) == [f"{os.path.relpath(module, ROOT)} imports "
                                                     f"{_imports(str(module)).pop()}"]


def test_models_import_neither_cope_jax_nor_envs():
    bad = [f"{os.path.relpath(p, ROOT)} imports {n}" for p in _modules("models") for n in _imports(p)
           if n.split(".")[0] in ("cope_jax", "envs", "launch")]
    assert not bad, bad
