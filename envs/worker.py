"""A pool worker process: hosts environment instances and answers requests over pipes.

Run as `python -m envs.worker` by envs.pool, possibly under a family's own interpreter, so this
module imports only the standard library and envs/ (never JAX or the model). Messages are JSON
lines (plain data) on stdin / the original stdout:

    parent -> worker: {"op": "init", "target": "module:Class", "kwargs": {...}}      (first line)
                      {"op": "reset", "slot": 0, "task_id": 7, "max_steps": 20}
                      {"op": "step", "slot": 0, "action": "go north" | null}
                      {"op": "close"}
    worker -> parent: {"ready": true, "pid": ...}  or  {"ready": false, "reason": ...}
                      {"ok": true, "observation": ..., "score": ..., "done": ..., "success": ...,
                       "info": {...}}  or  {"ok": false, "error": "env_error", "reason": ...}

Anything an environment prints goes to stderr (fd 1 is re-pointed there), so it cannot corrupt the
protocol. A watchdog thread kills the worker's whole process group (its JVMs included) when the
parent disappears, so even a parent killed with SIGKILL leaves no orphans behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            _kill_own_group()


def _kill_own_group() -> None:
    if os.getpgrp() == os.getpid():  # we lead our own group (pool starts us in a new session)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)


class _Channel:
    """JSON lines over the original stdout, which no library can write to any more."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "wb", buffering=0)
        os.dup2(2, 1)
        self._in = sys.stdin.buffer

    def send(self, msg: dict) -> None:
        self._out.write(json.dumps(msg, default=str).encode("utf-8") + b"\n")

    def recv(self) -> dict | None:
        line = self._in.readline()
        return json.loads(line) if line else None


def _serve(chan: _Channel) -> None:
    init = chan.recv()
    if init is None:
        return
    try:
        sys.path[:0] = [p for p in init.get("sys_path", []) if p not in sys.path]
        from envs.registry import import_target
        cls = import_target(init["target"])
        kwargs = init.get("kwargs", {})
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the requests
        chan.send({"ready": False, "reason": traceback.format_exc(limit=5)})
        return
    chan.send({"ready": True, "pid": os.getpid()})
    slots: dict[int, object] = {}
    try:
        while True:
            msg = chan.recv()
            if msg is None or msg.get("op") == "close":
                return
            slot = int(msg.get("slot", 0))
            try:
                if msg["op"] == "reset":
                    env = slots.get(slot)
                    if env is None:
                        env = slots[slot] = cls(**kwargs)
                    obs, info = env.reset(msg["task_id"], msg.get("max_steps"))
                    score = float(info.get("score", 0.0))
                    chan.send({"ok": True, "observation": obs, "score": score, "done": False,
                               "success": False, "info": info})
                elif msg["op"] == "step":
                    env = slots[slot]
                    obs, score, done, info = env.step(msg.get("action"))
                    chan.send({"ok": True, "observation": obs, "score": score, "done": done,
                               "success": bool(env.success(score, done, info)), "info": info})
                else:
                    chan.send({"ok": False, "error": "env_error", "reason": f"bad op {msg['op']!r}"})
            except Exception:  # noqa: BLE001 - the episode fails, the worker lives on
                env = slots.pop(slot, None)
                try:
                    if env is not None:
                        env.close()
                except Exception:  # noqa: BLE001
                    pass
                chan.send({"ok": False, "error": "env_error",
                           "reason": traceback.format_exc(limit=8)})
    finally:
        for env in slots.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    chan = _Channel()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        _serve(chan)
    finally:
        sys.stderr.flush()


if __name__ == "__main__":
    main()
