"""The rollout overlap benchmark: its line, its CPU accounting and its flags."""
import json
import os
import subprocess
import sys
import time

import pytest

from envs.pool import EnvPool
from envs.tail import TailEnv
from launch.bench.rollout import _cpu_s, _Tasks
from tests.paths import ROOT

SMALL = ["--suite=rollout", "--rollout_families=builtin", "--rollout_episodes=4", "--rollout_rounds=2",
         "--rollout_turn_tokens=4", "--rollout_repeats=1", "--rollout_workers=2", "--rollout_envs_per_worker=1",
         "--rollout_update_s=0.2"]


def _bench(*flags):
    return subprocess.run([sys.executable, "-m", "launch.bench", *SMALL, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cpu_time_counts_the_environment_workers():
    with EnvPool({"builtin": 2}) as pool:
        for ep in ("a", "b"):  # one per worker: both are up and idle after this
            pool.submit_reset(ep, "builtin", 0)
        assert len(pool.wait_all(timeout=60)) == 2
        workers = _cpu_s(pool) - time.process_time()  # starting them cost CPU (imports)
        assert workers > 0.02  # without the workers, ~0 (this process is subtracted)
        c0 = _cpu_s(pool)
        t0 = time.process_time()  # after c0: reading /proc costs this process CPU too
        while time.process_time() - t0 < 0.2:  # this process burns 0.2 s
            pass
        assert 0.2 <= _cpu_s(pool) - c0 < 0.2 + workers


def test_the_line_puts_the_rollout_next_to_its_parts():
    out = _bench("--rollout_turn_end=0.25")
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))
    assert line["family"] == "builtin" and line["env_steps"] == line["env_steps_replayed"] == 8
    # a quarter of the vocabulary ends a turn: most turns stop before the 4-token cap
    assert 0 < line["gen_tokens"] < 4 * 2 * 4
    for k in ("wall_s", "cold_wall_s", "sampling_s", "env_s", "sync_wall_s"):
        assert line[k] > 0 and line[k.replace("_s", "_cpu_s")] > 0
    # times carry 4 significant digits (a millisecond environment time is not 0), ratios 3 decimals
    assert line["overlap"] == pytest.approx(line["wall_s"] / max(line["sampling_s"], line["env_s"]), rel=0.005)
    assert line["sum_s"] == pytest.approx(line["sampling_s"] + line["env_s"], rel=0.002)
    assert line["wall_over_sum"] == pytest.approx(line["wall_s"] / line["sum_s"], rel=0.005)
    assert line["cpus"] == len(os.sched_getaffinity(0))
    assert 0 < line["occupancy"] <= 1 and 0 <= line["low_occupancy_share"] <= 1
    # the floor: the longer of the two walls, or their CPU time over the cores, over that wall
    longer = max(line["sampling_s"], line["env_s"])
    cpu_bound = (line["sampling_cpu_s"] + line["env_cpu_s"]) / line["cpus"]
    assert line["overlap_floor"] == pytest.approx(max(longer, cpu_bound) / longer, rel=0.005)


def test_bad_flags_are_refused():
    out = _bench("--rollout_turn_end=1.5")
    assert out.returncode != 0 and "--rollout_turn_end must be in [0, 1)" in out.stderr
    out = _bench("--rollout_turn_end=0.1", "--rollout_model=nowhere")
    assert out.returncode != 0 and "a --rollout_model ends its own turns" in out.stderr
    out = _bench("--rollout_update_s=-1")
    assert out.returncode != 0 and "--rollout_update_s must be >= 0" in out.stderr
    out = _bench("--rollout_families=builtin,nosuch")
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "bench: error: --rollout_families: no family nosuch; known: alfworld, appworld, builtin, chaos, sciworld, "
        "sciworld_gold, tail, tau2, webshop"]


def test_the_partial_line_compares_partial_rollouts_off_and_on():
    out = _bench("--rollout_families=tail", "--rollout_episodes=4", "--rollout_group_size=2", "--rollout_rounds=4",
                 "--rollout_partial_steps=3", "--norollout_overlap", "--rollout_row_devices=2")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert [ln.get("measure") for ln in lines] == ["partial"]  # the family's overlap line not measured
    (line,) = lines
    assert line["family"] == "tail" and line["tasks_per_step"] == 2 and line["groups_in_flight"] == 4
    assert line["row_devices"] == 2  # rows sharded over two host devices (the bench refuses a gathering sampler)
    # off trains steps x tasks_per_step groups; on drains at its last step, so trains every group it started
    assert line["off_groups"] == 3 * 2 and line["off_episodes"] == 3 * 2 * 2
    assert line["on_groups"] >= 3 * 2 and line["on_episodes"] == 2 * line["on_groups"]
    for mode in ("off", "on"):
        assert line[f"{mode}_wall_s"] > 0 and line[f"{mode}_env_steps"] >= line[f"{mode}_episodes"]
        assert line[f"{mode}_per_episode_s"] == pytest.approx(line[f"{mode}_wall_s"] / line[f"{mode}_episodes"],
                                                              rel=0.002)
        assert 0 < line[f"{mode}_occupancy"] <= 1 and 0 <= line[f"{mode}_low_occupancy_share"] <= 1
        assert line[f"{mode}_prefill_tokens"] > line[f"{mode}_env_steps"]  # each observation's tokens at least
    assert line["speedup"] == pytest.approx(line["off_per_episode_s"] / line["on_per_episode_s"], rel=0.005)
    # every group trained, so the trained episodes' ends are their tasks' known ones (group g: the g-th
    # task of the bench's shuffle)
    tail = TailEnv()
    for mode in ("off", "on"):
        capped = [tail.length(t) > 4 for t in _Tasks(tail.task_ids("test")).take(line[f"{mode}_groups"])]
        assert line[f"{mode}_capped_share"] == round(sum(capped) / len(capped), 3)
        assert line[f"{mode}_success_share"] == round(1 - sum(capped) / len(capped), 3)


def test_bad_partial_flags_are_refused():
    out = _bench("--rollout_row_devices=3")
    assert out.returncode != 0 and "--rollout_row_devices=3 must be >= 0 and divide the sampler's 2 rows" in out.stderr
    out = _bench("--norollout_overlap")
    assert out.returncode != 0 and "give --rollout_partial_steps" in out.stderr
    out = _bench("--rollout_partial_steps=-1")
    assert out.returncode != 0 and "--rollout_partial_steps must be >= 0" in out.stderr
    out = _bench("--rollout_partial_steps=2", "--rollout_group_size=3")
    assert out.returncode != 0 and "must be a positive multiple of --rollout_group_size=3" in out.stderr
