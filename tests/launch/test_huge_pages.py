"""launch.huge_pages: the binaries restart once with glibc's huge-page tunable, and with it a large
malloc'd block faults in far fewer pages (what made the demo 1.45x faster end to end on 2 cores)."""
import os
import subprocess
import sys

import pytest

from launch import huge_pages
from tests.paths import ROOT


def test_the_tunable_is_added_once_and_a_users_own_setting_wins():
    assert huge_pages.environment({})["GLIBC_TUNABLES"] == huge_pages.TUNABLE
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}
    assert huge_pages.environment(other) == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{huge_pages.TUNABLE}", "X": "1"}
    assert huge_pages.environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert huge_pages.environment({"GLIBC_TUNABLES": huge_pages.TUNABLE}) is None


def _env_without_tunables():
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}


def test_a_process_reexecutes_itself_with_the_tunable_and_keeps_its_arguments():
    code = ("import os, sys; from launch import huge_pages; huge_pages.reexec(); "
            "print(os.environ['GLIBC_TUNABLES'], sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "a", "--b=c"], cwd=ROOT, env=_env_without_tunables(),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [huge_pages.TUNABLE, "['a',", "'--b=c']"]


# touches a 256 MiB malloc'd block (above glibc's mmap threshold) and prints the minor page faults it took
_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 256 << 20
p = libc.malloc(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(p, 1, n)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel offers no transparent huge pages")
def test_with_the_tunable_a_large_block_faults_in_far_fewer_pages():
    def faults(env):
        out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True,
                             timeout=60, check=True)
        return int(out.stdout)

    plain = faults(dict(_env_without_tunables(), GLIBC_TUNABLES="glibc.malloc.hugetlb=0"))
    huge = faults(huge_pages.environment(_env_without_tunables()))
    assert plain >= 256 * 256 * 0.9  # one fault per 4 KiB page
    assert huge * 20 < plain, (huge, plain)
