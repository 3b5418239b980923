"""One environment worker process as the pool sees it: an `envs.worker` interpreter started in a
process group of its own, with an allow-listed environment, spoken to in JSON lines over pipes,
and killed with everything it started.

Workers are started with subprocess, never fork (the trainer runs JAX threads). A worker leads its
own process group, so `kill` takes its children too (ScienceWorld's JVMs); a worker whose parent
dies kills its own group (envs.worker). What to do when one dies or hangs is the pool's business
(envs/pool.py); this module only starts, talks to and stops one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

from envs.base import LAUNCH_DIR

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
# what every worker takes from the trainer's environment: the interpreter's, locale's and JVM's
# basics. A family adds the variables it reads (FamilySpec.env_vars), a pool its `env_vars` (a
# tau2 customer's key); anything else (API keys, cloud credentials) stays in the trainer.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ",
            "TMPDIR", "TERM", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "JAVA_HOME", "PYTHONPATH", "PYTHONHASHSEED",
            "GLIBC_TUNABLES")


def worker_env(names: tuple[str, ...], *, own_cwd: bool) -> dict[str, str]:
    """A worker's environment: the variables `names` of this process's environment that are set, the
    repository on its path, and (for a family run in a directory of its own) where it was launched."""
    env = {k: os.environ[k] for k in names if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        [_REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    if own_cwd:
        env[LAUNCH_DIR] = os.getcwd()
    return env


class WorkerGone(Exception):
    """The worker's stdout ended (`died`) or carried a line that is not a message."""

    def __init__(self, reason: str, *, died: bool):
        super().__init__(reason)
        self.died = died


class WorkerProcess:
    """A started `envs.worker` process (module docstring). Its stdout is non-blocking: `messages`
    reads what has arrived and returns."""

    def __init__(self, python: str, init: dict[str, Any], env: dict[str, str], cwd: str | None):
        """Starts the interpreter and sends it `init`. Raises OSError when `python` cannot run."""
        self.stderr = tempfile.TemporaryFile()
        self._buf = bytearray()
        self._killed = False
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "envs.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self.stderr, env=env, cwd=cwd, start_new_session=True)
        except OSError:
            self.stderr.close()
            raise
        try:
            self.send(init)  # if it died at once, the EOF on its stdout reports the failed start
            os.set_blocking(self.proc.stdout.fileno(), False)
        except BaseException:  # e.g. init kwargs JSON cannot write: the started process goes too
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self):
        """What a selector waits on."""
        return self.proc.stdout

    def exit_code(self) -> int | None:
        return self.proc.poll() if not self._killed else self.proc.returncode

    def send(self, payload: dict[str, Any]) -> bool:
        """Writes one request line; False when the pipe is closed (the worker is gone)."""
        try:
            self.proc.stdin.write(json.dumps(payload).encode("utf-8") + b"\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def messages(self) -> Iterator[dict[str, Any]]:
        """The messages complete so far, in order. Raises WorkerGone at the end of its stdout or on a
        line that is not JSON (after yielding the messages before it)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            raise WorkerGone("worker process died", died=True)
        self._buf += chunk
        while b"\n" in self._buf:
            line, _, rest = bytes(self._buf).partition(b"\n")
            self._buf = bytearray(rest)
            try:
                msg = json.loads(line)
            except ValueError:
                raise WorkerGone(f"garbled message {line[:200]!r}", died=False) from None
            yield msg

    def wait(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for it to exit."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """Kills its process group and reaps it (once)."""
        if self._killed:
            return
        self._killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except (OSError, AttributeError):
                pass

    def stderr_tail(self, n: int = 1500) -> str:
        """The last `n` bytes it wrote to stderr (for an error message)."""
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - n))
            return self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""
