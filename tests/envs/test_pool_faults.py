"""EnvPool under faults: SIGKILLed and hung workers, crashing and raising environments, and no
process left behind after close, an exception, Ctrl-C in the parent, or a SIGKILLed parent.

The chaos family (envs.chaos) is the built-in env plus actions that break its worker; with
spawn_child=True each worker also starts a child process (standing in for ScienceWorld's JVM),
which must die with its worker.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dataclasses

from envs.builtin import BuiltinEnv
from envs.pool import EnvPool
from envs.registry import get_spec
from tests.paths import ROOT

FAM = BuiltinEnv()
REPO = ROOT
CHAOS = {"chaos": {"spawn_child": True}}
CONCURRENT = {"chaos": dataclasses.replace(get_spec("chaos"), concurrent_instances=True)}


def _alive(pid):
    """True while a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _all_dead(pids, within=5.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _reset(pool, ep, tid=None):
    pool.submit_reset(ep, "chaos", FAM.task_ids("test")[0] if tid is None else tid, max_rounds=20)
    (r,) = pool.wait_all(timeout=30)
    assert r.ok, r
    return r


def _drive_batch(pool, episodes, faults):
    """Run expert episodes on chaos workers; `faults` {episode: action} is sent as the 2nd step."""
    scripts = {ep: FAM.expert_actions(t) for ep, t in episodes.items()}
    for ep, fault in faults.items():
        scripts[ep].insert(1, fault)
    for ep, t in episodes.items():
        pool.submit_reset(ep, "chaos", t, max_rounds=20)
    finals = {}
    end = time.monotonic() + 60
    while len(finals) < len(episodes) and time.monotonic() < end:
        for r in pool.poll(timeout=5):
            if r.done:
                finals[r.env_key] = r
            else:
                pool.submit_step(r.env_key, scripts[r.env_key].pop(0))
    return finals


def test_sigkill_mid_episode_while_a_call_is_in_flight():
    with EnvPool({"chaos": 2}, call_timeout=30.0, family_kwargs=CHAOS) as pool:
        r = _reset(pool, "victim")
        pid, child = r.info["worker_pid"], r.info["child_pid"]
        pool.submit_step("victim", "hang")
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        (r,) = pool.wait_all(timeout=30)
        assert time.monotonic() - t < 5  # detected as a crash, not by the 30 s timeout
        assert r.error == "crashed" and r.done and not r.success and "died" in r.reason
        assert _all_dead([pid, child])
        # The next batch runs on a fresh worker.
        tids = FAM.task_ids("test")[:6]
        finals = _drive_batch(pool, {i: t for i, t in enumerate(tids)}, {})
        assert all(f.success for f in finals.values()) and len(finals) == 6
        assert pid not in pool.worker_pids() and len(pool.worker_pids()) == 2


def test_sigkill_while_episode_is_idle():
    with EnvPool({"chaos": 1}, family_kwargs=CHAOS) as pool:
        r = _reset(pool, "idle")
        os.kill(r.worker_pid, signal.SIGKILL)
        pool.poll(timeout=0.5)  # notices the death, kills the worker's group, restarts it
        assert _all_dead([r.worker_pid, r.info["child_pid"]])
        pool.submit_step("idle", "look")
        (res,) = pool.wait_all(timeout=10)
        assert res.error == "crashed" and "idle" in res.reason and not res.success
        assert _reset(pool, "next").worker_pid != r.worker_pid


@pytest.mark.parametrize("concurrent", [False, True], ids=["serial", "concurrent"])
def test_hang_past_timeout_is_killed_and_the_batch_completes(concurrent):
    tids = FAM.task_ids("test")[:8]
    episodes = {i: t for i, t in enumerate(tids)}
    with EnvPool({"chaos": 2}, envs_per_worker=2, call_timeout=1.0, family_kwargs=CHAOS,
                 specs=CONCURRENT if concurrent else None) as pool:
        before = set(pool.worker_pids())
        t = time.monotonic()
        finals = _drive_batch(pool, episodes, {3: "hang"})
        assert len(finals) == 8 and time.monotonic() - t < 20
        hung = finals[3]
        assert hung.error == "timeout" and not hung.success and "1.0s" in hung.reason
        assert 1.0 <= hung.elapsed < 5
        # Episodes that shared the hung worker fail as crashed; all others succeed.
        for ep, r in finals.items():
            assert r.success or r.error in ("timeout", "crashed"), r
        assert sum(r.success for r in finals.values()) >= 5
        assert hung.worker_pid not in pool.worker_pids()
        assert not _alive(hung.worker_pid)
        assert len(set(pool.worker_pids()) - before) == 1
        more = _drive_batch(pool, {f"m{i}": t for i, t in enumerate(tids)}, {})
        assert all(r.success for r in more.values())


def test_crash_exit_raise_and_reset_hang():
    with EnvPool({"chaos": 1}, call_timeout=1.0) as pool:
        for action, error in (("crash", "crashed"), ("exit", "crashed"), ("raise", "env_error")):
            r = _reset(pool, action)
            pool.submit_step(action, action)
            (res,) = pool.wait_all(timeout=10)
            assert res.error == error and res.done and not res.success, (action, res)
        assert "injected failure" in res.reason
        survivor = _reset(pool, "after-raise")          # an env exception spares the worker
        assert survivor.worker_pid == res.worker_pid
        pool.release("after-raise")
        pool.submit_reset("stuck", "chaos", -1)
        (res,) = pool.wait_all(timeout=10)
        assert res.kind == "reset" and res.error == "timeout"


def test_no_orphans_after_close_or_an_exception():
    pool = EnvPool({"chaos": 2}, family_kwargs=CHAOS)
    pids = []
    for ep in range(2):
        r = _reset(pool, ep)
        pids += [r.worker_pid, r.info["child_pid"]]
    assert set(pool.worker_pids()) <= set(pids)
    pool.close()
    assert _all_dead(pids)

    with pytest.raises(ZeroDivisionError):
        with EnvPool({"chaos": 1}, family_kwargs=CHAOS) as pool:
            r = _reset(pool, "x")
            pids = [r.worker_pid, r.info["child_pid"]]
            1 / 0
    assert _all_dead(pids)


_PARENT = textwrap.dedent("""
    import json, os, signal, sys, time
    from envs.pool import EnvPool
    pool = EnvPool({"chaos": 2}, call_timeout=60, family_kwargs={"chaos": {"spawn_child": True}})
    pids = []
    for ep in range(2):
        pool.submit_reset(ep, "chaos", 29)
    for r in pool.wait_all(timeout=60):
        pids += [r.worker_pid, r.info["child_pid"]]
    pool.submit_step(0, "hang")
    print(json.dumps(pids), flush=True)
    if sys.argv[1] == "sigint":
        import faulthandler  # a parent still alive after 20 s says where it is stuck
        faulthandler.dump_traceback_later(20)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started ignoring it
    pool.poll(timeout=None)   # blocks on the hung call: Ctrl-C or SIGKILL arrives here
""")


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_no_orphans_when_the_parent_is_interrupted_or_killed(how):
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, how], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        if how == "sigkill":
            proc.kill()
        err = None
        time.sleep(0.3)  # most likely blocked in poll by now (anywhere else must work too)
        for _ in range(30):  # Ctrl-C, pressed again each 2 s until the parent is gone
            if how == "sigint":
                proc.send_signal(signal.SIGINT)
            try:  # reads stderr while waiting: a full pipe cannot block it
                _, err = proc.communicate(timeout=2)
                break
            except subprocess.TimeoutExpired:
                continue
        if err is None:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the parent did not exit within 60 s of the {how}; its stderr:\n{err}")
        if how == "sigint":
            assert "KeyboardInterrupt" in err
        assert _all_dead(pids, within=5.0)
    finally:
        proc.kill()
        proc.wait()


def test_concurrent_instances_answer_at_once_and_in_completion_order():
    with EnvPool({"chaos": 1}, envs_per_worker=3, call_timeout=3.0, specs=CONCURRENT) as pool:
        pid = {_reset(pool, ep).worker_pid for ep in ("a", "b", "slow")}
        assert len(pid) == 1  # one worker, three instances
        # both calls must be running at the same time for either to return (envs.chaos)
        pool.submit_step("a", "rendezvous")
        pool.submit_step("b", "rendezvous")
        got = pool.wait_all(timeout=10)
        assert sorted(r.env_key for r in got) == ["a", "b"]
        assert all(r.ok and r.observation == "Met." for r in got), got
        # an instance's quick call is answered while another instance's call is still running
        pool.submit_step("slow", "hang")
        pool.submit_step("a", "look")
        (first,) = pool.poll(timeout=2.0)
        assert first.env_key == "a" and first.ok
        (hung,) = pool.wait_all(timeout=10)
        assert hung.env_key == "slow" and hung.error == "timeout"
        # an idle episode of the killed worker fails at its next call
        pool.submit_step("b", "look")
        (lost,) = pool.wait_all(timeout=10)
        assert lost.error == "crashed" and "idle" in lost.reason


def test_resets_queued_at_a_dead_worker_start_elsewhere_and_idle_losses_name_the_pid():
    """One worker answers a call at a time: resets queued behind a hanging call never reached it.
    When it is killed they go back to the family's queue and start on a live worker (no fault);
    an episode that was idle on it fails at its next call, naming that worker's pid."""
    tids = FAM.task_ids("test")
    with EnvPool({"chaos": 2}, envs_per_worker=3, call_timeout=30.0, family_kwargs=CHAOS) as pool:
        r = _reset(pool, "hanger", tids[0])
        victim = r.worker_pid
        idle = _reset(pool, "idle", tids[1])
        if idle.worker_pid != victim:  # the least loaded worker got it: put one on the victim
            idle = _reset(pool, "idle2", tids[1])
        assert idle.worker_pid == victim
        pool.submit_step("hanger", "hang")
        for i in range(3):  # the victim's last free instance and the other worker's: queued behind the hang
            pool.submit_reset(f"new{i}", "chaos", tids[2 + i], max_rounds=20)
        time.sleep(0.3)
        queued = [e for e in ("new0", "new1", "new2") if pool._episodes[e].worker.pid == victim]
        assert queued  # the path under test: a reset waiting at the victim, never sent
        os.kill(victim, signal.SIGKILL)
        results = {r.env_key: r for r in pool.wait_all(timeout=30)}
        assert results["hanger"].error == "crashed"
        assert all(results[f"new{i}"].ok for i in range(3)), results
        assert all(results[f"new{i}"].worker_pid != victim for i in range(3))
        pool.submit_step(idle.env_key, "look")
        (lost,) = pool.wait_all(timeout=10)
        assert lost.error == "crashed" and lost.worker_pid == victim and "idle" in lost.reason
