"""The ablation sweep: its arms change one field each, it resumes and shares identical runs, and its
table (means, standard errors, steps to GRPO, gradient norms) is recomputed from its JSON lines."""
import json
import math
import os

import pytest
from absl import flags

from launch.experiments import ablation as ab
from tests.paths import ROOT


@pytest.fixture
def sweep_flags(tmp_path):
    f = flags.FLAGS
    if not f.is_parsed():
        f.mark_as_parsed()
    saved = {k: getattr(f, k) for k in ("ablation_dir", "ablation_arms", "ablation_seeds", "ablation_steps",
                                        "ablation_set", "ablation_config")}
    f.ablation_dir, f.ablation_steps = str(tmp_path / "sweep"), 4
    yield f
    for k, v in saved.items():
        setattr(f, k, v)


def test_each_arm_changes_only_its_own_settings(sweep_flags):
    """An arm's config is its method's sweep config (shared steps, evaluation, seed) with exactly
    the fields it names changed."""
    for arm in ab.ARMS:
        c = json.loads(ab.arm_config(arm, 1).to_json())
        plain = json.loads(ab.arm_config(ab.Arm("plain", arm.method), 1).to_json())
        diff = {f"{s}.{k}" for s in c if isinstance(c[s], dict) for k in c[s] if c[s][k] != plain[s][k]}
        diff -= {"train.grad_norm_terms"}  # a diagnostic: it changes no update
        assert diff <= {f for f, _ in arm.overrides} and bool(diff) == bool(arm.overrides), (arm, diff)
        assert c["train"]["grad_norm_terms"] == (["pg", "af"] if arm.term_norms else [])
        assert c["train"]["steps"] == 4 and c["seed"] == plain["seed"] and c["method"] == arm.method
    assert len({a.name for a in ab.ARMS}) == len(ab.ARMS) == 13
    # the figure's panels show every arm, each beside the reference
    assert {a for arms in ab.PANELS.values() for a in arms} == set(ab.ARMS_BY_NAME)
    assert all(arms[0] == ab.REFERENCE for arms in ab.PANELS.values())


def test_shared_settings_reach_every_arm_and_bad_ones_are_refused(sweep_flags):
    """--ablation_set: one setting for every arm (a real benchmark's model path), typed like the field;
    a field the config lacks or a value of the wrong type stops the sweep in one line."""
    sweep_flags.ablation_set = ["model.path=ckpt/x", "rollout.tasks_per_step=3", "train.horizon=7"]
    for arm in ab.ARMS:
        c = ab.arm_config(arm, 0)
        assert c.model.path == "ckpt/x" and c.rollout.tasks_per_step == 3
        assert c.train.horizon == dict(arm.overrides).get("train.horizon", 7)  # the arm's own change wins
    for bad, why in (("model.nope=1", "ablation_set"), ("model.path", "ablation_set"), ("nope.x=1", "ablation_set"),
                     ("rollout.tasks_per_step=three", "ablation_set"), ("rollout.tasks_per_step=1.5", "tasks_per_step")):
        sweep_flags.ablation_set = [bad]
        with pytest.raises(ValueError, match=why):
            ab.arm_config(ab.ARMS[0], 0)
    with pytest.raises(ValueError, match="tasks_per_step"):
        ab.run([])  # refused before the sweep directory is made
    sweep_flags.ablation_set, sweep_flags.ablation_config = [], "configs/nope.py"
    with pytest.raises(ValueError, match="no such config file"):
        ab.run([])
    assert not os.path.exists(sweep_flags.ablation_dir)


def _fake_train(calls, evaluated=None):
    """Stands in for `cope_jax.stages.entry.train_run`: the warm start when the config has one, an evaluation
    at step 0 unless the log has it (as the real one), then RL steps with evaluations."""
    def train_run(config, workdir, progress=False):
        calls.append(os.path.basename(workdir))
        os.makedirs(workdir, exist_ok=True)
        tokenizer = os.path.join(workdir, "tokenizer.model")
        if not os.path.isfile(tokenizer):  # as the real one: trained into the workdir unless there
            with open(tokenizer, "w") as f:
                f.write(os.path.basename(workdir))
        if config.warmstart.steps > 0:
            os.makedirs(os.path.join(workdir, "warmstart"), exist_ok=True)
        if not config.eval.every:
            return {}
        path = os.path.join(workdir, "metrics.jsonl")
        logged = open(path).read() if os.path.isfile(path) else ""
        with open(path, "a") as f:
            for step in range(0, config.train.steps + 1, 2):
                if step == 0 and '"step": 0' in logged:
                    continue
                if evaluated is not None:
                    evaluated.append((os.path.basename(workdir), step))
                # each method's own evaluation differs, at step 0 too: a shared start shows as equal
                succ = 0.1 * step + 0.01 * config.seed + (0.05 if config.method == "cope" else 0)
                f.write(json.dumps({"kind": "eval", "step": step, "succ": succ}) + "\n")
                if step:
                    f.write(json.dumps({"kind": "train", "step": step, "grad_norm": 1.0 + step,
                                        "grad_norm_pg": 0.5, "kl": 0.01}) + "\n")
        return {}
    return train_run


def test_the_sweep_resumes_shares_identical_runs_and_reports(sweep_flags, monkeypatch):
    import cope_jax.stages.entry

    calls, evaluated = [], []
    monkeypatch.setattr(cope_jax.stages.entry, "train_run", _fake_train(calls, evaluated))
    monkeypatch.setattr(ab, "fingerprint", lambda warm: "start-a")  # the fake warm start is empty
    sweep_flags.ablation_arms, sweep_flags.ablation_seeds = ["grpo", "cope_k2", "cope_lambda_0.001"], ["0", "1"]
    ab.run([])
    # the warm start once; cope_lambda_0.001 is cope_k2 at the demo's lambda: the same two runs
    assert calls == ["warmstart_run", "grpo_seed0", "cope_k2_seed0", "grpo_seed1", "cope_k2_seed1"]
    root = sweep_flags.ablation_dir
    assert sorted(os.listdir(os.path.join(root, "results"))) == sorted(
        f"{a}_seed{s}.jsonl" for a in sweep_flags.ablation_arms for s in (0, 1))
    assert os.path.isfile(os.path.join(root, "ablation.png")) and os.path.isfile(os.path.join(root, "ablation.md"))
    for run in calls[1:]:  # every arm reads the tokenizer its warm start was trained with
        assert open(os.path.join(root, run, "tokenizer.model")).read() == "warmstart_run"
    # the starting policy is evaluated once per seed, by the seed's first run; the others log its record
    assert [w for w, step in evaluated if step == 0] == ["grpo_seed0", "grpo_seed1"]
    start = {(r["arm"], r["seed"]): r["succ"] for r in ab.read_results(root) if r["kind"] == "eval" and r["step"] == 0}
    assert start[("cope_k2", 0)] == start[("grpo", 0)] != start[("cope_k2", 1)] == start[("grpo", 1)]
    calls.clear()
    ab.run([])  # everything done: nothing runs again
    assert calls == []
    os.remove(os.path.join(root, "results", "cope_k2_seed1.jsonl"))
    ab.run([])  # a run without its results file is run (resumed) again, alone
    assert calls == ["cope_k2_seed1"]
    # a later invocation shares finished runs too: the identical arm is not run again
    os.remove(os.path.join(root, "results", "cope_lambda_0.001_seed0.jsonl"))
    sweep_flags.ablation_arms = ["cope_lambda_0.001"]
    calls.clear()
    ab.run([])
    assert calls == [] and os.path.isfile(os.path.join(root, "results", "cope_lambda_0.001_seed0.jsonl"))
    assert {r["warmstart"] for r in ab.read_results(root)} == {"start-a"}
    # results of another warm start (a directory copied from a machine whose warm start came out
    # different) are refused in one line, before anything runs, and by the report
    monkeypatch.setattr(ab, "fingerprint", lambda warm: "start-b")
    os.remove(os.path.join(root, "results", "cope_k2_seed1.jsonl"))
    with pytest.raises(ValueError, match="different warm starts"):
        ab.run([])
    assert calls == [] and not os.path.exists(os.path.join(root, "results", "cope_k2_seed1.jsonl"))
    with open(os.path.join(root, "results", "grpo_seed1.jsonl"), "a") as f:
        f.write(json.dumps({"arm": "grpo", "seed": 1, "warmstart": "start-b", "kind": "eval", "step": 4,
                            "succ": 0.5}) + "\n")
    with pytest.raises(ValueError, match="different warm starts"):
        ab.report(root)


def test_the_warm_start_fingerprint_names_the_parameters(tmp_path):
    """Equal for the same parameters saved twice, different when one value changes."""
    import jax.numpy as jnp
    from flax import nnx

    from models import qwen
    from models.config import QwenConfig
    from models.orbax_io import save_orbax

    cfg = QwenConfig(family="qwen2", vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    model = qwen.Qwen(cfg, rngs=nnx.Rngs(0))
    save_orbax(model, str(tmp_path / "a"))
    save_orbax(model, str(tmp_path / "b"))
    model.embed[...] = model.embed[...].at[3, 2].add(jnp.float32(1e-3))
    save_orbax(model, str(tmp_path / "c"))
    a, b, c = (ab.fingerprint(str(tmp_path / d)) for d in "abc")
    assert a == b != c and len(a) == 16
    with open(tmp_path / "tokenizer.model", "wb") as f:  # the warm start's run trained a tokenizer
        f.write(b"pieces")
    assert ab.fingerprint(str(tmp_path / "a")) != a
    assert ab.fingerprint(None) == ""


def test_a_config_without_warm_start_starts_every_arm_from_its_model(sweep_flags, monkeypatch):
    import cope_jax.stages.entry

    calls = []
    monkeypatch.setattr(cope_jax.stages.entry, "train_run", _fake_train(calls))
    sweep_flags.ablation_config = "configs/sciworld.py"
    sweep_flags.ablation_arms, sweep_flags.ablation_seeds = ["grpo", "cope_k2"], ["0"]
    ab.run([])
    assert calls == ["grpo_seed0", "cope_k2_seed0"]
    root = sweep_flags.ablation_dir
    assert not any(os.path.exists(os.path.join(root, d, "warmstart")) for d in ("warmstart_run", *calls))
    assert {r["arm"] for r in ab.read_results(root)} == {"grpo", "cope_k2"}


def test_the_table_is_recomputed_from_the_json_lines():
    rec = lambda arm, seed, step, succ: {"arm": arm, "seed": seed, "kind": "eval", "step": step, "succ": succ}
    records = ([rec("grpo", s, t, v) for s, vals in enumerate([(0.1, 0.3, 0.5), (0.1, 0.2, 0.3)])
                for t, v in zip((0, 5, 10), vals)]
               + [rec("cope", s, t, v) for s, vals in enumerate([(0.1, 0.4, 0.6), (0.1, 0.5, 0.7)])
                  for t, v in zip((0, 5, 10), vals)]
               + [{"arm": "cope", "seed": 0, "kind": "train", "step": 3, "grad_norm": 7.5, "grad_norm_af": 2.0}])
    rows = {r["arm"]: r for r in ab.table(records)}
    assert rows["grpo"]["final_succ_mean"] == 0.4
    assert rows["grpo"]["final_succ_se"] == round(math.sqrt(0.02 / 2), 4)  # sample variance 0.02, n = 2
    assert rows["cope"]["steps_to_reference"] == 5 and rows["grpo"]["steps_to_reference"] == 10
    assert rows["cope"]["max_grad_norm"] == 7.5 and rows["cope"]["max_grad_norm_af"] == 2.0
    assert rows["grpo"]["max_grad_norm"] is None
    # paired by seed: cope - grpo = +0.1 (seed 0), +0.4 (seed 1)
    assert rows["cope"]["minus_reference_mean"] == 0.25
    assert rows["cope"]["minus_reference_se"] == round(math.sqrt(0.045 / 2), 4)
    assert rows["grpo"]["minus_reference_mean"] == 0.0 and rows["grpo"]["minus_reference_se"] == 0.0
    table = ab._markdown(list(rows.values()))
    assert "| cope | 2 | 0.650 ± 0.050 | +0.250 ± 0.150 | 5 | 7.50 | - / 2.00 |" in table
    assert "| max grad norm (of step means) |" in table  # these records hold step means only
    # a step's largest optimizer step (`grad_norm_max`) is the max, where the records have it
    records[-1] |= {"grad_norm_max": 9.0, "grad_norm_af_max": 3.0}
    rows = {r["arm"]: r for r in ab.table(records)}
    assert rows["cope"]["max_grad_norm"] == 9.0 and rows["cope"]["max_grad_norm_af"] == 3.0
    assert "| max grad norm |" in ab._markdown([rows["cope"]])


def test_an_arm_that_ties_the_reference_reaches_it():
    """Equal final successes on other seeds: the means differ in their last bits and round below
    the reference's; the tie still counts as reaching it, and the paired difference prints as 0."""
    rec = lambda arm, seed, step, succ: {"arm": arm, "seed": seed, "kind": "eval", "step": step, "succ": succ}
    finals = {"grpo": (0.64, 0.6975, 0.6), "sft_success": (0.6275, 0.705, 0.605)}  # both sum to 1.9375
    records = [rec(arm, s, t, v) for arm, vals in finals.items() for s, v in enumerate(vals)
               for t in (0, 10)]
    rows = {r["arm"]: r for r in ab.table(records)}
    assert rows["sft_success"]["steps_to_reference"] == 10
    assert "| sft_success | 3 | 0.646 ± 0.030 | +0.000 ± 0.006 | 10 |" in ab._markdown(list(rows.values()))


def test_the_committed_table_is_recomputed_from_the_committed_json_lines():
    """docs/ablation holds the demo page's sweep: its table (in ablation.md and docs/demo.md) is what
    the report computes from its results, from one warm start, and its figure exists."""
    root = os.path.join(ROOT, "docs", "ablation")
    records = ab.read_results(root)
    assert records and {r["warmstart"] for r in records} == {ab.fingerprint(os.path.join(root, "warmstart_run", "warmstart"))}
    table = ab._markdown(ab.table(records))
    assert open(os.path.join(root, "ablation.md")).read() == table
    assert table in open(os.path.join(ROOT, "docs", "demo.md")).read()
    assert os.path.getsize(os.path.join(root, "ablation.png")) > 10_000
