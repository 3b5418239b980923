"""Transparent huge pages for XLA:CPU's large buffers: glibc's malloc tunable, set at process start.

On CPU, XLA allocates each call's large buffers (the train step's activations and attention scores)
with malloc, and glibc serves a block above its mmap threshold (at most 32 MiB) with fresh 4 KiB
pages: every call faults them all in again, and the kernel zeroes each one. With
`glibc.malloc.hugetlb=1` (glibc >= 2.35) malloc asks for transparent huge pages on those mappings
(honoured where the kernel's THP mode is `madvise`, the usual default, or `always`): 512x fewer
faults. Nothing in the arithmetic changes: results are bit-identical. glibc reads its tunables only
when a process starts, so a binary adds the variable and executes itself again (`reexec`, called by
`launch.cli.run`); `python -m launch.huge_pages` prints the environment line for shell scripts.
"""
from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def environment(env) -> dict | None:
    """A copy of `env` with TUNABLE added to GLIBC_TUNABLES, or None when nothing should change:
    a hugetlb setting is there already (a user's own, 0 included, wins) or the C library is not
    glibc >= 2.35."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables or not _glibc_has_hugetlb():
        return None
    return dict(env, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}" if tunables else TUNABLE)


def reexec() -> None:
    """Executes this process's command again with the tunable set (no return), when `environment`
    says it is missing; otherwise returns at once."""
    env = environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _glibc_has_hugetlb() -> bool:
    lib, version = platform.libc_ver()
    try:
        return lib == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


if __name__ == "__main__":
    env = environment(os.environ)
    print((env or os.environ).get("GLIBC_TUNABLES", ""))
