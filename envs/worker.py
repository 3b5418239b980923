"""A pool worker process: hosts environment instances and answers requests over pipes.

Run as `python -m envs.worker` by envs.pool, possibly under a family's own interpreter, so this
module imports only the standard library and envs/ (never JAX or the model). Messages are JSON
lines (plain data) on stdin / the original stdout:

    parent -> worker: {"op": "init", "target": "module:Class", "kwargs": {...},
                       "concurrent": false}                                    (first line)
                      {"op": "reset", "instance": 0, "task_id": 7, "max_rounds": 20,
                       "actions": [...]}  (optional: steps replayed after the reset)
                      {"op": "step", "instance": 0, "action": "go north" | null}
                      {"op": "close"}
    worker -> parent: {"ready": true, "pid": ...}  or  {"ready": false, "reason": ...}
                      {"ok": true, "instance": 0, "observation": ..., "score": ..., "done": ...,
                       "success": ..., "info": {...}, "replayed": [...]}
                      ("replayed", after a reset with actions: the reset's observation and each
                      replayed step's; the rest of the reply is the last call's)
                      or  {"ok": false, "instance": 0, "error": "env_error", "reason": ...}

With "concurrent" the instances' requests run at the same time (a thread per instance) and replies come in
completion order, each naming its instance; otherwise one request at a time, in order.

Anything an environment prints goes to stderr (fd 1 is re-pointed there), so it cannot corrupt the
protocol. A watchdog thread kills the worker's whole process group (its JVMs included) when the
parent disappears, so even a parent killed with SIGKILL leaves no orphans behind.
"""

from __future__ import annotations

import json
import os
import queue
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


class _Instances:
    """The worker's environment instances, each used by one thread only.

    Serial (default): requests run one after another on the main thread. Concurrent (the family's
    `concurrent_instances`): each instance has its own thread, so one instance's reset or step (ScienceWorld:
    a call into its own JVM, which releases the GIL) runs while another instance's is in progress;
    requests of one instance still run in order.
    """

    def __init__(self, cls, kwargs: dict, chan: _Channel, concurrent: bool) -> None:
        self._cls, self._kwargs, self._chan = cls, kwargs, chan
        self._envs: dict[int, object] = {}
        self._send_lock = threading.Lock()
        self._concurrent = concurrent
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, msg: dict) -> None:
        instance = int(msg.get("instance", 0))
        if not self._concurrent:
            self._run(instance, msg)
            return
        q = self._queues.get(instance)
        if q is None:
            q = self._queues[instance] = queue.SimpleQueue()
            t = threading.Thread(target=self._serve_instance, args=(instance, q), daemon=True)
            t.start()
            self._threads.append(t)
        q.put(msg)

    def _serve_instance(self, instance: int, q: queue.SimpleQueue) -> None:
        while (msg := q.get()) is not None:
            self._run(instance, msg)

    def _send(self, msg: dict) -> None:
        with self._send_lock:
            self._chan.send(msg)

    def _run(self, instance: int, msg: dict) -> None:
        try:
            if msg["op"] == "reset":
                env = self._envs.get(instance)
                if env is None:
                    env = self._envs[instance] = self._cls(**self._kwargs)
                obs, info = env.reset(msg["task_id"], msg.get("max_rounds"))
                score, done, replayed = float(info.get("score", 0.0)), False, [obs]
                for action in msg.get("actions") or ():  # a parked episode caught up in one call
                    if done:
                        break
                    obs, score, done, info = env.step(action)
                    replayed.append(obs)
                reply = {"ok": True, "instance": instance, "observation": obs, "score": score, "done": done,
                         "success": bool(done and env.success(score, done, info)), "info": info}
                self._send(reply | ({"replayed": replayed} if msg.get("actions") else {}))
            elif msg["op"] == "step":
                env = self._envs[instance]
                obs, score, done, info = env.step(msg.get("action"))
                self._send({"ok": True, "instance": instance, "observation": obs, "score": score, "done": done,
                            "success": bool(env.success(score, done, info)), "info": info})
            else:
                self._send({"ok": False, "instance": instance, "error": "env_error", "reason": f"bad op {msg['op']!r}"})
        except Exception:  # noqa: BLE001 - the episode fails, the worker lives on
            env = self._envs.pop(instance, None)
            try:
                if env is not None:
                    env.close()
            except Exception:  # noqa: BLE001
                pass
            self._send({"ok": False, "instance": instance, "error": "env_error", "reason": traceback.format_exc(limit=8)})

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:  # the pool closes only idle workers: the threads are waiting
            t.join(timeout=5.0)
        for env in self._envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass


def _serve(chan: _Channel) -> None:
    init = chan.recv()
    if init is None:
        return
    try:
        sys.path[:0] = [p for p in init.get("sys_path", []) if p not in sys.path]
        from envs.registry import import_target
        cls = import_target(init["target"])
        cls.warm_up()
        kwargs = init.get("kwargs", {})
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the requests
        chan.send({"ready": False, "reason": traceback.format_exc(limit=5)})
        return
    chan.send({"ready": True, "pid": os.getpid()})
    instances = _Instances(cls, kwargs, chan, bool(init.get("concurrent")))
    try:
        while True:
            msg = chan.recv()
            if msg is None or msg.get("op") == "close":
                return
            instances.submit(msg)
    finally:
        instances.close()


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
