"""EnvPool on the built-in env: asynchronous batches, instances and queueing, caller errors,
per-family interpreters, and the rule that envs/ never imports JAX or the model."""

import ast
import stat
import sys
import time
from pathlib import Path

import pytest

from envs.builtin import INVALID, BuiltinEnv
from envs.pool import EnvPool
from envs.registry import FAMILIES, FamilySpec, make_family
from tests.paths import ROOT

FAM = BuiltinEnv()


def _run_experts(pool, episodes):
    """Drive episodes {episode: task_id} with expert actions; returns final results."""
    scripts = {ep: FAM.expert_actions(tid) for ep, tid in episodes.items()}
    for ep, tid in episodes.items():
        pool.submit_reset(ep, "builtin", tid, max_rounds=20)
    finals = {}
    deadline = time.monotonic() + 60
    while len(finals) < len(episodes) and time.monotonic() < deadline:
        for r in pool.poll(timeout=5):
            assert r.ok, r
            if r.done:
                finals[r.env_key] = r
            else:
                pool.submit_step(r.env_key, scripts[r.env_key].pop(0))
    return finals


def test_batch_larger_than_instances_completes():
    tids = FAM.task_ids("test")[:24]
    with EnvPool({"builtin": 2}, envs_per_worker=3) as pool:
        finals = _run_experts(pool, {f"ep{i}": t for i, t in enumerate(tids)})
        assert len(finals) == 24 and all(r.success and r.score == 1.0 for r in finals.values())
        assert len({r.worker_pid for r in finals.values()}) == 2  # both workers were used
        assert pool.outstanding() == 0


def test_poll_does_not_block_and_results_carry_info():
    with EnvPool({"builtin": 1}) as pool:
        tid = FAM.task_ids("test")[0]
        pool.submit_reset("a", "builtin", tid)
        t = time.monotonic()
        first = pool.poll(timeout=0)
        assert time.monotonic() - t < 0.2
        results = first + pool.wait_all(timeout=30)
        (r,) = results
        assert r.kind == "reset" and r.observation.startswith("Task: ") and not r.done
        assert r.info["task_id"] == tid and r.info["family"] == FAM.task_family(tid)
        pool.submit_step("a", None)  # an unparseable reply still costs a round
        (r,) = pool.wait_all(timeout=30)
        assert r.observation == INVALID and r.info["rounds"] == 1 and r.info["invalid"]


def test_release_frees_the_instance_for_a_waiting_reset():
    a, b = FAM.task_ids("test")[:2]
    with EnvPool({"builtin": 1}, envs_per_worker=1) as pool:
        pool.submit_reset("a", "builtin", a)
        pool.submit_reset("b", "builtin", b)
        got = pool.wait_all(timeout=30)
        assert [r.env_key for r in got] == ["a"]  # b waits for an instance
        assert pool.outstanding() == 1
        pool.release("a")
        got = pool.wait_all(timeout=30)
        assert [r.env_key for r in got] == ["b"]
        with pytest.raises(KeyError):
            pool.submit_step("a", "look")


def test_release_drops_a_result_not_yet_polled():
    a, b = FAM.task_ids("test")[:2]
    with EnvPool({"builtin": 1}, envs_per_worker=2) as pool:
        pool.submit_reset("a", "builtin", a)
        pool.submit_reset("b", "builtin", b)
        deadline = time.monotonic() + 30
        while len(pool._ready) < 2 and time.monotonic() < deadline:
            pool._pump(0.1)  # both results reach the pool, neither is polled yet
        pool.release("a")  # e.g. a prefetched reset whose batch did not come
        assert [r.env_key for r in pool.poll(0.0)] == ["b"]
        with pytest.raises(KeyError):
            pool.submit_step("a", "look")


def test_caller_mistakes_raise():
    tid = FAM.task_ids("test")[0]
    with pytest.raises(ValueError, match="envs_per_worker"):
        EnvPool({"builtin": 1}, envs_per_worker=0)
    pool = EnvPool({"builtin": 1})
    assert pool.capacity("builtin") == 1 and pool.capacity("sciworld") == 0
    with pytest.raises(KeyError):
        pool.submit_step("nobody", "look")
    with pytest.raises(ValueError):
        pool.submit_reset("x", "sciworld", 0)   # no workers for that family
    pool.submit_reset("x", "builtin", tid)
    with pytest.raises(ValueError):
        pool.submit_reset("x", "builtin", tid)  # still live
    pool.wait_all(timeout=30)
    pool.submit_step("x", "look")
    with pytest.raises(RuntimeError):
        pool.submit_step("x", "look")           # a call already in flight
    pool.close()
    pool.close()                                # idempotent
    with pytest.raises(RuntimeError):
        pool.poll()


def _wrapper(tmp_path, name):
    marker = tmp_path / f"{name}.used"
    script = tmp_path / f"{name}-python"
    script.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "{sys.executable}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), marker


def test_family_runs_under_its_own_interpreter(tmp_path, monkeypatch):
    explicit, marker1 = _wrapper(tmp_path, "explicit")
    via_env, marker2 = _wrapper(tmp_path, "env")
    monkeypatch.setenv(FAMILIES["builtin"].python_env, via_env)
    tids = FAM.task_ids("test")[:3]
    with EnvPool({"builtin": 1}, python={"builtin": explicit}) as pool:
        assert all(r.success for r in _run_experts(pool, dict(enumerate(tids))).values())
    assert marker1.exists() and not marker2.exists()
    with EnvPool({"builtin": 1}) as pool:
        assert all(r.success for r in _run_experts(pool, dict(enumerate(tids))).values())
    assert marker2.exists()


def test_broken_interpreter_or_family_fails_requests_not_the_caller(tmp_path):
    spec = FamilySpec("broken", "envs.no_such_module:Nope")
    dying = tmp_path / "dying-python"
    dying.write_text("#!/bin/sh\necho 'no such venv' >&2\nexit 1\n")
    dying.chmod(0o755)
    with EnvPool({"builtin": 1}, python={"builtin": str(dying)}) as pool:
        pool.submit_reset("a", "builtin", 0)
        (r,) = pool.wait_all(timeout=30)
        assert r.error == "start_failed" and "no such venv" in r.reason
    with EnvPool({"builtin": 1}, python={"builtin": "/nonexistent/python3"}) as pool:
        pool.submit_reset("a", "builtin", 0)
        (r,) = pool.wait_all(timeout=30)
        assert r.error == "start_failed" and r.done and not r.success
    with EnvPool({"broken": 1}, specs={"broken": spec}) as pool:
        pool.submit_reset("a", "broken", 0)
        (r,) = pool.wait_all(timeout=60)
        assert r.error == "start_failed" and "no_such_module" in r.reason


def test_family_kwargs_reach_the_workers():
    with EnvPool({"builtin": 1}, family_kwargs={"builtin": {"num_test": 3}}) as pool:
        pool.submit_reset("a", "builtin", 5)
        (r,) = pool.wait_all(timeout=30)
        assert r.ok
    assert make_family("builtin", num_test=3).task_ids("test") == FAM.task_ids("test")[:3]


def test_envs_never_import_jax_or_the_model():
    """Workers may run under another interpreter: envs/ depends on the stdlib (and, lazily,
    on its environment packages) only."""
    allowed_lazy = {"py4j", "scienceworld", "tau2", "loguru", "alfworld", "textworld",
                    "web_agent_site", "gym", "appworld"}
    for path in Path(ROOT, "envs").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in {"envs", "__future__"} \
                    or top in allowed_lazy, (path.name, name)
                if top in allowed_lazy:  # only inside functions, never at module level
                    assert node not in tree.body, (path.name, name)


def test_release_withdraws_a_reset_still_waiting_for_an_instance():
    a, b = FAM.task_ids("test")[:2]
    with EnvPool({"builtin": 1}) as pool:
        pool.submit_reset("a", "builtin", a)
        pool.submit_reset("b", "builtin", b)
        pool.release("b")
        assert [r.env_key for r in pool.wait_all(timeout=30)] == ["a"]
        assert pool.outstanding() == 0
        pool.release("a")
        pool.submit_reset("b", "builtin", b)  # the id is free again
        assert [r.env_key for r in pool.wait_all(timeout=30)] == ["b"]
