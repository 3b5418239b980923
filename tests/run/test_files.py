"""A run's small files are written whole or not at all, and its metrics log survives a torn record."""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from cope_jax.run import files, metrics
from tests.paths import ROOT


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "config.json"
    files.write_json(str(path), {"a": 1})
    with pytest.raises(RuntimeError):
        with files.replacing(str(path)) as tmp:
            with open(tmp, "w") as f:
                f.write('{"a": ')
            raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["config.json"]
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_a_kill_mid_write_leaves_the_old_file_or_the_new_one(tmp_path):
    """SIGKILL while 200 MB are being written: the file is one of the two whole versions."""
    path = str(tmp_path / "eval.md")
    old, new = "old\n" * 10, "x" * (200 << 20)
    files.write_text(path, old)
    code = f"from cope_jax.run import files; print('go', flush=True); files.write_text({path!r}, 'x' * (200 << 20))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "go\n"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    size = os.path.getsize(path)
    assert size in (len(old), len(new))
    if size == len(old):
        assert open(path).read() == old


def _log(workdir, n):
    log = metrics.MetricsLog(str(workdir))
    for step in range(1, n + 1):
        log.write("train", step, {"loss": 0.5 / step})
    log.close()


def test_a_torn_last_record_is_left_out_with_one_warning_and_cut_before_the_next(tmp_path, caplog):
    _log(tmp_path, 3)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind": "train", "step": 4, "lo')  # killed mid-append
    with caplog.at_level(logging.WARNING):
        records = metrics.read_log(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3]
    torn = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn) == 1 and "line 4" in torn[0].getMessage()
    _log(tmp_path, 5)  # the resumed run: the fragment is cut, the new records stand on their own lines
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        records = metrics.read_log(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 1, 2, 3, 4, 5] and not caplog.records
    assert metrics.latest_records(records, "train")[4]["loss"] == 0.125


def test_a_damaged_record_before_the_last_is_an_error_naming_its_line(tmp_path):
    _log(tmp_path, 3)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:10] + "\n"
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        metrics.read_log(str(tmp_path))
