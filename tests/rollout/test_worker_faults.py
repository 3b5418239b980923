"""A worker lost at every moment of its life, under the rollout loop: the fault matrix.

Each case plays a small batch on chaos workers (envs/chaos.py: the built-in house, with calls and
starts slowed so a moment can be hit) and sends one worker SIGKILL or SIGSTOP while it is starting,
while its family warms up, with a reset in flight, with a step in flight, while it holds only idle
episodes, between two rollouts (holding the next batch's prefetched episodes), or while its
replacement is starting; lockstep and asynchronous runner, one worker and two. Every case must end
within the worker timeouts plus a margin, each lost episode replayed (none counted as a fault: one
loss costs one replay), no worker process left behind, and the loop must wait in `select`, not spin.
"""
import dataclasses
import os
import signal
import threading
import time

import jax
import pytest

from cope_jax.rollout.runner import RolloutConfig, RolloutRunner, RolloutStalled
from envs import chaos
from envs.pool import EnvPool
from envs.registry import get_spec, make_family
from tests.rollout.test_rollout import _runner_parts

FAMILY = make_family("chaos")
CALL_TIMEOUT, START_TIMEOUT = 1.0, 3.0
SPECS = {"chaos": dataclasses.replace(get_spec("chaos"), start_timeout=START_TIMEOUT)}
BOUND_S = 45.0  # a case's wall time: its timeouts (a start and a call) plus the rollouts, with room for a
# loaded 2-core host (a case takes 2-10 s alone; 21 s was seen beside other tests)
MOMENTS = ("starting", "warming_up", "reset_in_flight", "step_in_flight", "idle_episodes", "between_rollouts",
           "replacement_starting")


@pytest.fixture(scope="module")
def parts():
    return _runner_parts()


@pytest.fixture
def hard_stop():
    """A hang fails the test (after 90 s) instead of the suite."""
    def stop(*_):
        raise TimeoutError("hung: still running after 90 s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(90)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


class Probe:
    """The pool as the runner sees it, counting the runner's waits on it."""

    def __init__(self, pool):
        self.pool, self.waits = pool, 0
        self.signaller = None  # looks for its moment after each wait too, once armed

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def poll(self, timeout=0.0):
        self.waits += timeout != 0.0
        return self._looked(self.pool.poll(timeout))

    def wait_all(self, timeout=None):
        self.waits += 1
        return self._looked(self.pool.wait_all(timeout))

    def _looked(self, results):
        # a moment that lasts only while the runner decodes (a worker holding idle episodes) is seen
        # for sure here, between a wait and the decode, where the signaller's thread may miss it
        if self.signaller is not None:
            self.signaller.look()
        return results


def _workers(pool):
    """(pid, state, stderr fd, inflight kinds, held instances, queued) per live worker, read from another
    thread (retried while the pool's thread changes them)."""
    for _ in range(100):
        try:
            return [(w.pid, w.state, w.process.stderr.fileno(), [r.kind for r in list(w.inflight.values())],
                     w.held(), len(w.queue)) for w in list(pool._workers) if w.process is not None and w.state != "dead"]
        except (RuntimeError, AttributeError, ValueError):
            time.sleep(0.001)
    return []


def _warming(fd) -> bool:
    try:
        return chaos.WARMING.encode() in os.pread(fd, 1 << 16, 0)
    except OSError:
        return False


CONDITIONS = {  # moment -> whether a worker (its `_workers` row) is in it
    "starting": lambda w: w[1] == "starting",
    "warming_up": lambda w: w[1] == "starting" and _warming(w[2]),
    "reset_in_flight": lambda w: "reset" in w[3],
    "step_in_flight": lambda w: "step" in w[3],
    "idle_episodes": lambda w: w[1] == "idle" and w[4] > 0 and not w[3] and not w[5],
}


class Signaller(threading.Thread):
    """Sends `sig` to the first worker found in `moment`; for replacement_starting, SIGKILLs the first
    worker with a step in flight, then sends `sig` to its replacement while that one starts. Records
    every worker pid it saw. Its thread looks every 5 ms; `look` is also called from the runner's
    thread (`Probe`)."""

    def __init__(self, pool, moment, sig):
        super().__init__(daemon=True)
        self.pool, self.seen, self.hit, self.stop = pool, set(), [], threading.Event()
        self.steps = [("step_in_flight", signal.SIGKILL), ("starting", sig)] \
            if moment == "replacement_starting" else [(moment, sig)]
        self.lock = threading.Lock()

    def look(self) -> None:
        """One look at the workers: signals the first one in the next step's moment."""
        with self.lock:
            workers = _workers(self.pool)
            self.seen.update(w[0] for w in workers)
            if not self.steps:
                return
            moment, sig = self.steps[0]
            target = next((w for w in workers if w[0] not in self.hit and CONDITIONS[moment](w)), None)
            if target is not None:
                os.kill(target[0], sig)
                self.hit.append(target[0])
                self.steps.pop(0)

    def run(self):
        while not self.stop.wait(0.005):
            self.look()


def _alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for good (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("sync", [True, False], ids=["lockstep", "async"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_worker_lost_at_any_moment_costs_a_replay_never_a_hang(parts, monkeypatch, hard_stop, moment, sig, sync,
                                                                 workers):
    chat, sampler = parts
    warm = moment in ("starting", "warming_up", "replacement_starting")
    monkeypatch.setenv(chaos.WARM_UP_SECONDS, "0.3" if warm else "0")
    tasks = FAMILY.task_ids("train")
    batch = [(tasks[i // 2], i // 2) for i in range(4)]  # two groups of two
    t0 = time.monotonic()
    with EnvPool({"chaos": workers}, envs_per_worker=4, call_timeout=CALL_TIMEOUT, specs=SPECS,
                 family_kwargs={"chaos": {"reset_delay": 0.1, "step_delay": 0.1}},
                 env_vars={"chaos": (chaos.WARM_UP_SECONDS,)}) as pool:
        probe = Probe(pool)
        runner = RolloutRunner(sampler, probe, "chaos", FAMILY, chat,
                               RolloutConfig(max_rounds=2, max_turn_tokens=4, sync=sync))
        signaller = Signaller(pool, "idle_episodes" if moment == "between_rollouts" else moment, sig)

        def arm():
            signaller.start()
            probe.signaller = signaller

        if moment != "between_rollouts":
            arm()
        # the next batch's resets are prefetched where the moment is between two rollouts (elsewhere
        # the worker hit might hold only those, and this batch would lose nothing)
        first, stats = runner.run(batch, jax.random.key(0), prefetch=batch if moment == "between_rollouts" else ())
        if moment == "between_rollouts":  # the next batch's resets were answered: its episodes sit idle
            deadline = time.monotonic() + 5
            while pool.can_progress() and time.monotonic() < deadline:
                pool._pump(0.05)  # the answers wait in the pool for the next run
            arm()
            while not signaller.hit and time.monotonic() < deadline:
                time.sleep(0.01)
            second, more = runner.run(batch, jax.random.key(1))
            first, stats.replays = first + second, stats.replays + more.replays
        elapsed = time.monotonic() - t0
        signaller.stop.set()
        signaller.join()
    assert signaller.hit, f"the moment {moment} never came"
    assert elapsed < BOUND_S, elapsed
    assert [t.finish_reason for t in first if t.finish_reason.startswith("env_")] == []
    if moment not in ("starting", "warming_up"):  # a loss at start costs nothing: its resets move on
        assert stats.replays >= 1
    assert probe.waits <= 20 * elapsed + 20, (probe.waits, elapsed)  # waits in select, no spinning
    time.sleep(0.2)
    assert not [pid for pid in signaller.seen if _alive(pid)]


def test_a_pool_that_cannot_progress_is_one_line_naming_where_each_call_is(parts, hard_stop):
    """Resets waiting for instances that idle episodes of another caller hold: the rollout stops at once
    with an error naming the workers and what waits, instead of spinning."""
    chat, sampler = parts
    tasks = FAMILY.task_ids("train")
    with EnvPool({"chaos": 1}, envs_per_worker=2, call_timeout=CALL_TIMEOUT, specs=SPECS) as pool:
        for i in range(2):  # someone else's episodes hold both instances
            pool.submit_reset(("other", i), "chaos", tasks[0], max_rounds=3)
        pool.wait_all()
        runner = RolloutRunner(sampler, pool, "chaos", FAMILY, chat, RolloutConfig(max_rounds=3, sync=True))
        t0 = time.monotonic()
        with pytest.raises(RolloutStalled) as e:
            runner.run([(tasks[1], 0)], jax.random.key(0))
        assert time.monotonic() - t0 < 15  # at once: no deadline is waited for
    message = str(e.value)
    assert "\n" not in message and message.startswith("rollout stalled: 1 episodes live, nothing to decode")
    assert "(none can arrive)" in message and "(chaos, idle, 2/2 instances held)" in message
    assert message.endswith("1 resets waiting for an instance")


@pytest.mark.parametrize("sync", [True, False], ids=["lockstep", "async"])
def test_replays_are_not_starved_by_the_next_batchs_prefetched_resets(parts, hard_stop, sync):
    """Four instances, this batch's four episodes in them and the next batch's four resets queued behind:
    a worker lost while its episodes sit idle frees two instances, which the queued prefetch takes before
    the replays are submitted. The prefetch is released so the replays run (before, the run waited
    forever), and the next batch resets afresh."""
    chat, sampler = parts
    tasks = FAMILY.task_ids("train")
    batch = [(tasks[i // 2], i // 2) for i in range(4)]
    with EnvPool({"chaos": 2}, envs_per_worker=2, call_timeout=CALL_TIMEOUT, specs=SPECS) as pool:
        probe = Probe(pool)
        runner = RolloutRunner(sampler, probe, "chaos", FAMILY, chat,
                               RolloutConfig(max_rounds=2, max_turn_tokens=4, sync=sync))
        signaller = Signaller(pool, "idle_episodes", signal.SIGKILL)
        signaller.start()
        probe.signaller = signaller
        trajs, stats = runner.run(batch, jax.random.key(0), prefetch=batch)
        signaller.stop.set()
        signaller.join()
        assert signaller.hit and stats.replays >= 1
        assert [t.finish_reason for t in trajs if t.finish_reason.startswith("env_")] == []
        more, _ = runner.run(batch, jax.random.key(1))
        assert len(more) == 4 and not [t for t in more if t.finish_reason.startswith("env_")]
