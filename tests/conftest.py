"""Test session setup: 8 fake CPU devices (for the sharding tests) before JAX initialises."""
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_START = time.time()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"test suite wall time: {time.time() - _START:.1f} s")
