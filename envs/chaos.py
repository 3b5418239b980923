"""Fault-injection family for testing the pool: the built-in env plus actions that break the worker.

Actions `crash` (SIGKILL itself), `exit` (exit without answering), `hang` (never answer) and
`raise` (an exception inside the environment) exercise every failure path of envs.pool; a reset
with a negative task id hangs. `rendezvous` answers only once another instance in the same worker
has reached it too (within 5 s; otherwise it raises): it succeeds only where the worker runs its
instances' calls at once. With `spawn_child=True` the live side starts a long-sleeping child
process (standing in for ScienceWorld's JVM) and reports its pid in the reset info, so tests can
check that killing a worker also kills what it started. `reset_delay` / `step_delay` seconds make
each call take that long, and `WARM_UP_SECONDS` (an environment variable of the worker) makes its
start take that long, announced on stderr (`WARMING`): moments a test can hit a worker in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from envs.builtin import BuiltinEnv


_RENDEZVOUS = threading.Barrier(2)
WARM_UP_SECONDS = "COPE_CHAOS_WARM_UP_SECONDS"
WARMING = "chaos: warming up"


class ChaosEnv(BuiltinEnv):
    """BuiltinEnv whose workers can be made to crash, hang or raise."""

    name = "chaos"

    def __init__(self, spawn_child: bool = False, reset_delay: float = 0.0, step_delay: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._spawn_child = spawn_child
        self._delays = {"reset": float(reset_delay), "step": float(step_delay)}
        self._child: subprocess.Popen | None = None

    @classmethod
    def warm_up(cls) -> None:
        seconds = float(os.environ.get(WARM_UP_SECONDS, 0))
        if seconds:
            print(WARMING, file=sys.stderr, flush=True)
            time.sleep(seconds)

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        time.sleep(self._delays["reset"])
        if task_id < 0:
            time.sleep(1e6)
        if self._spawn_child and self._child is None:
            self._child = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(1e6)"])
        obs, info = super()._reset(task_id)
        info["worker_pid"] = os.getpid()
        if self._child is not None:
            info["child_pid"] = self._child.pid
        return obs, info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        time.sleep(self._delays["step"])
        if action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "exit":
            os._exit(3)
        if action == "hang":
            time.sleep(1e6)
        if action == "raise":
            raise RuntimeError("chaos: injected failure")
        if action == "rendezvous":
            _RENDEZVOUS.wait(timeout=5.0)  # BrokenBarrierError when no peer call runs meanwhile
            return "Met.", 0.0, False, {}
        return super()._step(action)

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None
