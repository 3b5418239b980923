"""`launch.accept` on this CPU host at its tiny sizes: it completes, and its report has every section
with measured and predicted columns."""
import json
import subprocess
import sys
from launch.accept.report import SECTIONS
from tests.paths import ROOT



def _accept(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "launch.accept", f"--out={tmp_path}", "--repeats=1", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_cpu_run_reports_every_section_measured_beside_predicted(tmp_path):
    proc = _accept(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in open(tmp_path / "accept.jsonl")]
    summary, checks = lines[0], lines[1:]
    assert summary["backend"] == "cpu" and summary["size"] == "tiny" and summary["chip"] is None
    assert {c["section"] for c in checks} == set(SECTIONS)
    assert set(summary["seconds"]) == set(SECTIONS)  # a complete run's summary gives each section's seconds
    # attention: both implementations timed at both lengths, blockwise checked against dense
    timed = {(c["name"].split()[0], c["name"].split()[1]) for c in checks
             if c["section"] == "attention" and c["unit"] == "s"}
    assert timed == {(impl, T) for impl in ("dense", "blockwise") for T in ("512", "1024")}
    assert all(c["measured"] > 0 for c in checks if c["unit"] == "s")
    errors = [c for c in checks if "error vs dense" in c["name"]]
    assert len(errors) == 2 and all(0 < c["measured"] < c["predicted"] and c["met"] for c in errors)
    # the compiler's layout of the call is the prediction; blockwise's is the smaller at 1,024 tokens
    peaks = {c["name"].split()[0]: c["predicted"] for c in checks
             if c["section"] == "attention" and c["unit"] == "B" and " 1024 " in c["name"]}
    assert 0 < peaks["blockwise"] < peaks["dense"]
    # sampler: the bounds measured in the run, a decode step and a prefill per batch against them
    sampler = [c for c in checks if c["section"] == "sampler"]
    assert all(c["measured"] > 0 for c in sampler[:2]) and sampler[0]["unit"] == "B/s"
    for batch in (1, 8):
        steps = [c for c in sampler if f"batch {batch}," in c["name"]]
        assert [c["name"].split()[0] for c in steps] == ["decode", "prefill"]
        assert all(c["predicted"] > 0 and (c["measured"] is None or c["ratio"] > 0) for c in steps), steps
    # train: the step's resident-memory peak beside the compiler's layout of the same program
    (memory,) = [c for c in checks if c["section"] == "train" and c["unit"] == "B"]
    assert memory["measured"] > 0 and memory["predicted"] > 0 and 0.5 < memory["ratio"] < 2, memory
    (seconds,) = [c for c in checks if c["section"] == "train" and c["unit"] == "s"]
    assert seconds["measured"] > 0 and seconds["predicted"] is None  # CPU: no public peak figures
    # rl: one demo step through the trainer, its rollout and update timed
    assert [c["name"] for c in checks if c["section"] == "rl"] == ["demo RL step: rollout", "demo RL step: update"]
    assert all(c["measured"] > 0 for c in checks if c["section"] == "rl")
    table = open(tmp_path / "accept.md").read()
    assert "| section | check | measured | predicted | ratio | met | note |" in table
    assert sum(table.count(f"\n| {section} |") for section in SECTIONS) == len(checks)
    assert f"| {memory['ratio']:.3g} |" in table


def test_an_unknown_section_is_one_line_before_anything_is_written(tmp_path):
    proc = _accept(tmp_path / "out", "--sections=attention,sampling")
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == ["accept: error: --sections: unknown sampling; expected some of "
                                                "train, attention, sampler, rl"]


def test_a_target_this_machine_lacks_is_planned_never_measured(tmp_path):
    proc = _accept(tmp_path, "--sections=train", "--topology=1xH100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    checks = [json.loads(x) for x in open(tmp_path / "accept.jsonl")][1:]
    planned = [c for c in checks if c["section"] == "plan"]
    assert [c["unit"] for c in planned] == ["s", "B"]
    assert all(c["measured"] is None and c["predicted"] > 0 and "planned only" in c["note"] for c in planned)
    assert all(c["measured"] is not None for c in checks if c["section"] == "train")


def test_an_unknown_topology_is_one_line(tmp_path):
    proc = _accept(tmp_path / "out", "--topology=v9-8")
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[0]]
    assert "unknown topology 'v9-8'" in proc.stderr


def test_the_train_section_falls_back_to_the_largest_preset_that_fits(monkeypatch):
    from launch.accept import device as accept_device
    from launch.accept import train as accept_train

    path, overrides, _ = accept_train.SIZES["tiny"]
    monkeypatch.setitem(accept_train.SIZES, "probe", (path, overrides, ("Qwen2.5-7B-Instruct", None)))
    monkeypatch.setattr(accept_device, "memory_budget", lambda fraction=0.9: 2**30)  # a 1 GiB device
    c, cfg, program, compiled, note = accept_train._fitting("probe")
    assert cfg.hidden_size < 3584 and compiled is not None  # the config's own small model
    assert note.startswith("Qwen2.5-7B-Instruct: its state alone is ") and "over the 1.0 GiB" in note
    state_gib = float(note.split("its state alone is ")[1].split()[0])
    assert 105 < state_gib < 120  # 7.6B float32 parameters, their gradients and AdamW's two moments
    monkeypatch.setattr(accept_device, "memory_budget", lambda fraction=0.9: None)  # CPU: no limit
    assert accept_train._fitting("tiny")[4] == ""
