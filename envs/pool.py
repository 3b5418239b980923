"""Environment worker processes with an asynchronous API that survives crashes and hangs.

The rollout loop keeps many episodes in flight while the sampler decodes: it submits resets and
steps, which are sent to worker *processes* at once, and later collects whatever has finished with
`poll`. Workers are separate interpreters (envs/processes.py: started, spoken to in JSON lines and
killed there), so a family can run under its own virtual environment (envs.registry.family_python).
This module schedules: which worker holds which episode, which call goes next, and what a lost
worker means for the episodes it held.

Failure model: every request has a deadline (the family's call timeout). A worker that dies
(SIGKILL, segfault, exit) or misses a deadline is killed with its whole process group (its JVMs
too) and replaced by a fresh one; the episode whose call failed gets an EnvResult with
`error='crashed'|'timeout'`, done=True, success=False and a `reason`; other episodes living on the
same worker fail the same way at their next call. Resets the lost worker had not been sent yet go
back to the family's queue (nothing of them had started). An exception inside an environment
fails only that episode (`error='env_error'`). The rollout loop replays episodes lost to a worker
(cope_jax/rollout/runner.py). `poll` never raises for environment faults, so a batch always
completes; caller mistakes (stepping an unknown episode) do raise.

No orphans: `close()` (also run by the context manager, at interpreter exit and from `__del__`) kills
every worker's process group.

    with EnvPool({"sciworld": 4}) as pool:
        pool.submit_reset("ep0", "sciworld", task_id=12, max_rounds=20)
        for r in pool.poll(timeout=1.0): ...
        pool.submit_step("ep0", "look around")

Each worker holds `envs_per_worker` environment instances, i.e. that many live episodes; resets
beyond the free instances wait in a queue and start as episodes finish or are released. A worker
answers one call at a time, unless its family has `concurrent_instances` (FamilySpec): then every
instance has a call in flight at once (ScienceWorld: each instance's JVM works while the others do).
An EnvPool is driven from one thread (the rollout loop); it starts no threads of its own.
"""

from __future__ import annotations

import atexit
import collections
import selectors
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

from envs.processes import BASE_ENV, WorkerGone, WorkerProcess, worker_env
from envs.registry import FamilySpec, family_python, get_spec

_MAX_START_FAILURES = 3          # consecutive failed starts before a family is declared broken
_CLOSE_GRACE = 2.0               # seconds a worker gets to exit cleanly on close()


@dataclass
class EnvResult:
    """Outcome of one reset or step. `error` is None on success, else 'crashed', 'timeout',
    'env_error' or 'start_failed'; an errored result is terminal (done=True, success=False)."""
    env_key: Hashable
    kind: str                                  # 'reset' | 'step'
    observation: str = ""
    score: float = 0.0                         # raw environment score (last known on error)
    done: bool = False
    success: bool = False                      # the label Y (method §5), meaningful when done
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    reason: str = ""
    elapsed: float = 0.0                       # seconds from submit to result
    worker_pid: int | None = None
    replayed: list[str] | None = None          # a reset with actions: the observations it replayed

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Request:
    kind: str
    env_key: Hashable
    payload: dict[str, Any]
    submitted: float
    sent: float = 0.0                          # when it went to the worker (its deadline starts)
    calls: int = 1                             # environment calls it makes: its deadline is that many


@dataclass
class _Episode:
    """Where a live episode is: the worker and instance holding its environment (None and -1 while
    its reset waits for one), and the state of its calls."""
    family: str
    worker: "_Worker | None" = None
    instance: int = -1
    busy: bool = True                          # a call of it has no answer yet
    score: float = 0.0
    lost: str | None = None                    # set when its worker died while it was idle
    lost_pid: int | None = None                # that worker's pid
    released: bool = False


class _Worker:
    """A worker's schedule (owned by EnvPool): the episode each of its instances holds, the calls
    queued for it and those it is answering, and its process (None before the first start)."""

    def __init__(self, family: str, instances: int) -> None:
        self.family = family
        self.instances: list[Hashable | None] = [None] * instances
        self.queue: collections.deque[_Request] = collections.deque()
        self.inflight: dict[int, _Request] = {}  # instance -> request the worker is answering
        self.process: WorkerProcess | None = None
        self.state = "dead"                    # starting | idle | dead
        self.started_at = 0.0
        self.start_failures = 0

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def free_instance(self) -> int:
        return self.instances.index(None) if None in self.instances else -1

    def held(self) -> int:
        return sum(e is not None for e in self.instances)


_LIVE_POOLS: "weakref.WeakSet[EnvPool]" = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class EnvPool:
    """Asynchronous pool of environment worker processes (see module docstring).

    Args:
      workers: family name -> number of worker processes, e.g. {"builtin": 2, "sciworld": 4}.
      envs_per_worker: environment instances (concurrent episodes) per worker.
      call_timeout: seconds per reset/step; a float for all families or a dict by family
        (default: the family's FamilySpec.call_timeout).
      python: family -> interpreter path (default: envs.registry.family_python).
      family_kwargs: family -> constructor kwargs of its EnvFamily.
      env_vars: family -> more variables of this process's environment its workers get (BASE_ENV).
      specs: extra or replacement FamilySpecs by name (e.g. a family defined outside envs/).
    """

    def __init__(self, workers: Mapping[str, int], *, envs_per_worker: int = 1,
                 call_timeout: float | Mapping[str, float] | None = None,
                 python: Mapping[str, str] | None = None,
                 family_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                 env_vars: Mapping[str, tuple[str, ...]] | None = None,
                 specs: Mapping[str, FamilySpec] | None = None) -> None:
        if envs_per_worker < 1:
            raise ValueError(f"envs_per_worker={envs_per_worker}: need at least one environment per worker")
        self._specs = {name: (specs or {}).get(name) or get_spec(name) for name in workers}
        self._timeouts = {
            name: (call_timeout.get(name, spec.call_timeout) if isinstance(call_timeout, Mapping)
                   else call_timeout if call_timeout is not None else spec.call_timeout)
            for name, spec in self._specs.items()}
        self._python = {name: family_python(spec, (python or {}).get(name))
                        for name, spec in self._specs.items()}
        self._kwargs = {name: {**spec.kwargs, **dict((family_kwargs or {}).get(name, {}))}
                        for name, spec in self._specs.items()}
        self._env_vars = {name: BASE_ENV + spec.env_vars + tuple((env_vars or {}).get(name, ()))
                          for name, spec in self._specs.items()}
        self._cwds: dict[str, str] = {}  # family -> its workers' own directory (FamilySpec.own_cwd)
        self._episodes: dict[Hashable, _Episode] = {}
        self._waiting: dict[str, collections.deque[_Request]] = {
            name: collections.deque() for name in workers}
        self._broken: dict[str, str] = {}
        self._ready: list[EnvResult] = []
        self._sel = selectors.DefaultSelector()
        self._closed = False
        self._workers: list[_Worker] = []
        _LIVE_POOLS.add(self)
        for name, count in workers.items():
            if count < 1:
                raise ValueError(f"{name}: need at least one worker")
            for _ in range(count):
                w = _Worker(name, envs_per_worker)
                self._workers.append(w)
                self._spawn(w)

    # ---- public API -------------------------------------------------------------------------
    def submit_reset(self, env_key: Hashable, family: str, task_id: int,
                     max_rounds: int | None = None, actions: Sequence[str | None] = ()) -> None:
        """Start the episode `env_key` on task `task_id`; its first observation comes back from poll().
        `actions`: steps the worker replays right after the reset, in the same call (a parked
        episode caught up); the result is the last one's, with every observation in `replayed`."""
        self._check_open()
        if family not in self._specs:
            raise ValueError(f"no workers for family {family!r}")
        if env_key in self._episodes:
            raise ValueError(f"episode {env_key!r} is still live or has a call in flight")
        self._episodes[env_key] = _Episode(family)
        payload = {"op": "reset", "task_id": int(task_id), "max_rounds": max_rounds}
        if actions:
            payload["actions"] = list(actions)
        req = _Request("reset", env_key, payload, time.monotonic(), calls=1 + len(actions))
        if family in self._broken:
            self._fail(req, "start_failed", self._broken[family])
            return
        self._waiting[family].append(req)
        self._assign_waiting(family)

    def submit_step(self, env_key: Hashable, action: str | None) -> None:
        """Send one action (None = unparseable reply) to a live episode."""
        self._check_open()
        ep = self._episodes.get(env_key)
        if ep is None or ep.released:
            raise KeyError(f"episode {env_key!r} is not live (finished or never started)")
        if ep.busy:
            raise RuntimeError(f"episode {env_key!r} already has a call in flight")
        ep.busy = True
        req = _Request("step", env_key, {"op": "step", "action": action}, time.monotonic())
        if ep.lost is not None:
            self._fail(req, "crashed", ep.lost, ep.lost_pid)
            return
        req.payload["instance"] = ep.instance
        ep.worker.queue.append(req)
        self._dispatch(ep.worker)

    def release(self, env_key: Hashable) -> None:
        """End an episode early (e.g. the round limit was hit); frees its instance. A result of it not
        yet returned by poll() is dropped."""
        ep = self._episodes.get(env_key)
        if ep is None or ep.released:
            return
        ep.released = True
        self._ready = [r for r in self._ready if r.env_key != env_key]
        if ep.worker is None:  # its reset still waits for an instance: withdraw it
            queue = self._waiting[ep.family]
            for req in [r for r in queue if r.env_key == env_key]:
                queue.remove(req)
            self._episodes.pop(env_key, None)
        elif not ep.busy:
            self._end_episode(env_key)
        # A busy episode ends when the answer to its call arrives (and is dropped).

    def poll(self, timeout: float | None = 0.0) -> list[EnvResult]:
        """Results finished so far; waits up to `timeout` seconds for at least one (None: until
        one arrives or none can arrive without a new submit). Waiting also notices dead workers."""
        self._check_open()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump(0.0)
            if self._ready or (end is None and not self.can_progress()):
                break
            now = time.monotonic()
            if end is not None and now >= end:
                break
            wait = self._next_deadline() - now
            if end is not None:
                wait = min(wait, end - now)
            self._pump(max(0.0, min(wait, 0.5)))
            if self._ready:
                break
        out, self._ready = self._ready, []
        return out

    def wait_all(self, timeout: float | None = None) -> list[EnvResult]:
        """Poll until no result can arrive without a new submit (or `timeout`); returns them all.
        Resets waiting for an instance held by an idle episode stay queued."""
        end = None if timeout is None else time.monotonic() + timeout
        out: list[EnvResult] = []
        while self.can_progress() or self._ready:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            out += self.poll(timeout=left)
        return out + self.poll(0.0)

    def outstanding(self) -> int:
        """Calls submitted whose results poll() has not returned yet."""
        queued = sum(len(w.queue) + len(w.inflight) for w in self._workers)
        return queued + sum(len(q) for q in self._waiting.values()) + len(self._ready)

    def can_progress(self) -> bool:
        """Whether a result can still arrive without the caller doing anything: a call is at a
        worker (sent, or queued behind another or behind the worker's start). A reset waiting for
        an instance held by an idle episode cannot: that episode must end or be released first."""
        return any(w.inflight or w.queue for w in self._workers)

    def quiet_limit(self) -> float:
        """The longest a healthy pool goes without a result while it can progress: a replacement
        worker's start, then the longest call's deadline (a worker answers within its deadline or is
        lost; a reset replaying actions has one deadline per call it makes)."""
        calls = max((r.calls for w in self._workers for r in [*w.inflight.values(), *w.queue]), default=1)
        return max(self._specs[w.family].start_timeout + calls * self._timeouts[w.family] for w in self._workers)

    def describe(self) -> str:
        """Where every outstanding call is, in one line (for an error message)."""
        now = time.monotonic()
        parts = []
        for w in self._workers:
            calls = [f"{r.kind} {r.env_key!r} sent {now - r.sent:.1f}s ago" for r in w.inflight.values()]
            calls += [f"{r.kind} {r.env_key!r} queued" for r in w.queue]
            parts.append(f"worker {w.pid} ({w.family}, {w.state}, {w.held()}/{len(w.instances)} "
                         f"instances held){': ' + ', '.join(calls) if calls else ''}")
        waiting = sum(len(q) for q in self._waiting.values())
        return "; ".join(parts) + f"; {waiting} resets waiting for an instance"

    def has_instance(self, env_key: Hashable) -> bool:
        """Whether a live episode holds an environment instance (its reset is not queued for one)."""
        ep = self._episodes.get(env_key)
        return ep is not None and ep.worker is not None

    def capacity(self, family: str) -> int:
        """Environment instances of a family: how many of its episodes can be live at once."""
        return sum(len(w.instances) for w in self._workers if w.family == family)

    def worker_pids(self, family: str | None = None) -> list[int]:
        """Pids of live worker processes (for tests and monitoring)."""
        return [w.pid for w in self._workers
                if w.process is not None and w.state != "dead" and family in (None, w.family)]

    def close(self) -> None:
        """Stop every worker and everything it started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w.state != "idle" or w.inflight:
                self._kill(w)  # busy or still starting: it would not read the request
            elif w.process is not None:
                w.process.send({"op": "close"})
        end = time.monotonic() + _CLOSE_GRACE
        for w in self._workers:
            if w.process is not None and w.state != "dead":
                w.process.wait(end - time.monotonic())
            self._kill(w)
        for cwd in self._cwds.values():
            shutil.rmtree(cwd, ignore_errors=True)
        self._sel.close()
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- workers ------------------------------------------------------------------------------
    def _spawn(self, w: _Worker) -> None:
        spec = self._specs[w.family]
        if spec.own_cwd and w.family not in self._cwds:
            self._cwds[w.family] = tempfile.mkdtemp(prefix=f"cope-{w.family}-")
        init = {"op": "init", "target": spec.target, "kwargs": self._kwargs[w.family],
                "concurrent": spec.concurrent_instances}
        try:
            w.process = WorkerProcess(self._python[w.family], init, worker_env(self._env_vars[w.family],
                                      own_cwd=spec.own_cwd), self._cwds.get(w.family))
        except OSError as e:  # no such interpreter: retrying will not help
            w.process, w.state = None, "dead"
            w.start_failures = _MAX_START_FAILURES - 1
            self._start_failed(w, f"cannot start {self._python[w.family]}: {e}")
            return
        self._sel.register(w.process.stdout, selectors.EVENT_READ, w)
        w.state = "starting"
        w.started_at = time.monotonic()

    def _kill(self, w: _Worker) -> None:
        """Kill a worker's process group and stop listening to it."""
        if w.process is None:
            return
        try:
            self._sel.unregister(w.process.stdout)
        except (KeyError, ValueError, RuntimeError):
            pass
        w.process.kill()
        w.state = "dead"

    def _worker_lost(self, w: _Worker, error: str, reason: str, culprit: _Request | None = None) -> None:
        """The worker died or hung: fail its episodes, replace it. With `culprit` (the call that
        missed its deadline) only that call gets `error`; the worker's other calls in flight
        were lost with it ('crashed')."""
        process, pid = w.process, w.pid
        code = None if process is None else process.exit_code()
        tail = "" if process is None else process.stderr_tail()
        self._kill(w)
        if code is None and process is not None:
            code = process.exit_code()
        detail = f"{reason} (pid {pid}, exit {code})"
        if tail:
            detail += f"; stderr tail: {tail[-600:]}"
        failed = []
        for req in w.inflight.values():
            if culprit is None or req is culprit:
                failed.append((req, error, detail))
            else:
                failed.append((req, "crashed", f"worker lost: {detail}"))
        w.inflight = {}
        # Calls queued behind the failed one (or behind its start): a reset not yet sent starts
        # afresh on a live worker, unless the family is broken; the others were lost with the worker.
        queued_error = "start_failed" if w.family in self._broken else "crashed"
        unsent = [req for req in w.queue if req.kind == "reset" and w.family not in self._broken]
        failed += [(req, queued_error, f"worker lost: {detail}") for req in w.queue if req not in unsent]
        w.queue.clear()
        for req, err, why in failed:
            self._fail(req, err, why, pid)
        for env_key in w.instances:
            ep = self._episodes.get(env_key) if env_key is not None else None
            if ep is not None and ep.worker is w and not ep.busy:
                ep.lost, ep.lost_pid = f"worker lost while idle: {detail}", pid
        w.instances = [None] * len(w.instances)
        for req in reversed(unsent):  # in their order, ahead of later resets
            self._episodes[req.env_key].worker, self._episodes[req.env_key].instance = None, -1
            del req.payload["instance"]
            self._waiting[w.family].appendleft(req)
        if not (self._closed or w.family in self._broken):
            self._spawn(w)
        self._assign_waiting(w.family)

    def _start_failed(self, w: _Worker, reason: str) -> None:
        w.start_failures += 1
        if w.start_failures >= _MAX_START_FAILURES:
            self._broken[w.family] = reason
            for req in list(self._waiting[w.family]):
                self._fail(req, "start_failed", reason)
            self._waiting[w.family].clear()

    # ---- message pump -------------------------------------------------------------------------
    def _pump(self, wait: float) -> None:
        """Read what workers sent (waiting up to `wait`), then enforce deadlines."""
        if self._sel.get_map():
            for key, _ in self._sel.select(timeout=wait):
                self._read(key.data)
        elif wait > 0:
            time.sleep(wait)
        now = time.monotonic()
        for w in self._workers:
            if w.state == "dead":
                continue
            if w.state == "starting" and now - w.started_at > self._specs[w.family].start_timeout:
                self._start_failed(w, f"worker did not start within "
                                      f"{self._specs[w.family].start_timeout:.0f}s")
                self._worker_lost(w, "start_failed", "start timeout")
            elif w.inflight:
                late = min(w.inflight.values(), key=lambda r: r.sent + r.calls * self._timeouts[w.family])
                if now - late.sent > late.calls * self._timeouts[w.family]:
                    self._worker_lost(w, "timeout", f"no answer within {late.calls * self._timeouts[w.family]:.1f}s",
                                      culprit=late)

    def _next_deadline(self) -> float:
        deadlines = [r.sent + r.calls * self._timeouts[w.family] for w in self._workers for r in w.inflight.values()]
        deadlines += [w.started_at + self._specs[w.family].start_timeout for w in self._workers
                      if w.state == "starting"]
        return min(deadlines, default=time.monotonic() + 0.5)

    def _read(self, w: _Worker) -> None:
        process = w.process
        try:
            for msg in process.messages():
                self._handle(w, msg)
                if w.process is not process or w.state == "dead":  # lost (and replaced) meanwhile
                    return
        except WorkerGone as e:
            if e.died and w.state == "starting":
                self._start_failed(w, "worker exited during start-up: " + process.stderr_tail())
                self._worker_lost(w, "start_failed", "exited during start-up")
            else:
                self._worker_lost(w, "crashed", str(e))

    def _handle(self, w: _Worker, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            if not msg["ready"]:
                reason = str(msg.get("reason", ""))
                w.start_failures = _MAX_START_FAILURES - 1  # an import error will not heal
                self._start_failed(w, f"worker could not load its family: {reason}")
                self._worker_lost(w, "start_failed", f"could not load family: {reason[-600:]}")
                return
            w.state, w.start_failures = "idle", 0
            self._assign_waiting(w.family)
            self._dispatch(w)
            return
        req = w.inflight.pop(msg.get("instance"), None)
        if req is None:
            self._worker_lost(w, "crashed", f"unexpected message for instance {msg.get('instance')!r}")
            return
        ep = self._episodes[req.env_key]
        ep.busy = False
        if msg.get("ok"):
            ep.score = float(msg.get("score", 0.0))
            result = EnvResult(req.env_key, req.kind, msg.get("observation", ""), ep.score,
                               bool(msg.get("done")), bool(msg.get("success")),
                               msg.get("info") or {}, None, "",
                               time.monotonic() - req.submitted, w.pid, msg.get("replayed"))
        else:
            result = EnvResult(req.env_key, req.kind, "", ep.score, True, False, {},
                               msg.get("error", "env_error"), str(msg.get("reason", "")),
                               time.monotonic() - req.submitted, w.pid)
        if ep.released:
            self._end_episode(req.env_key)
        else:
            self._ready.append(result)
            if result.done:
                self._end_episode(req.env_key)
        self._dispatch(w)

    # ---- scheduling ---------------------------------------------------------------------------
    def _dispatch(self, w: _Worker) -> None:
        """Send queued calls the worker can start now: one at a time, or with concurrent instances one
        per instance (an instance's calls stay in order), so each call's deadline covers only its own work."""
        concurrent = self._specs[w.family].concurrent_instances
        while w.state == "idle" and w.queue and (concurrent or not w.inflight):
            req = next((r for r in w.queue if r.payload["instance"] not in w.inflight), None)
            if req is None:
                return
            w.queue.remove(req)
            req.sent = time.monotonic()
            w.inflight[req.payload["instance"]] = req
            if not w.process.send(req.payload):
                self._worker_lost(w, "crashed", "worker pipe closed")
                return

    def _assign_waiting(self, family: str) -> None:
        """Give queued resets the free instances of this family's workers (least loaded first)."""
        queue = self._waiting[family]
        while queue:
            candidates = [w for w in self._workers if w.family == family and w.state != "dead"
                          and w.free_instance() >= 0]
            if not candidates:
                return
            w = min(candidates, key=lambda w: (w.state != "idle", w.held()))
            req = queue.popleft()
            ep = self._episodes.get(req.env_key)
            if ep is None or ep.released:
                continue
            instance = w.free_instance()
            w.instances[instance] = req.env_key
            ep.worker, ep.instance = w, instance
            req.payload["instance"] = instance
            w.queue.append(req)
            self._dispatch(w)

    def _end_episode(self, env_key: Hashable) -> None:
        ep = self._episodes.pop(env_key, None)
        if ep is None:
            return
        w = ep.worker
        if w is not None and 0 <= ep.instance < len(w.instances) and w.instances[ep.instance] == env_key:
            w.instances[ep.instance] = None
            self._assign_waiting(ep.family)

    def _fail(self, req: _Request, error: str, reason: str, pid: int | None = None) -> None:
        ep = self._episodes.get(req.env_key)
        score = ep.score if ep is not None else 0.0
        result = EnvResult(req.env_key, req.kind, "", score, True, False, {}, error, reason,
                           time.monotonic() - req.submitted, pid)
        if ep is not None:
            ep.busy = False
            released = ep.released
            self._end_episode(req.env_key)
            if released:
                return
        self._ready.append(result)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")

