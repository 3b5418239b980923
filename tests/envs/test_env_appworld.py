"""AppWorld without its package or data in this interpreter (it pins pydantic 1 and its data is not
on a package index): split bookkeeping on a small data folder in AppWorld's on-disk format, the
standing instruction, code-block actions, and the missing-package / missing-data errors."""

import sys

import pytest

from envs.appworld import DATASETS, SIZES, AppWorldEnv, read_dataset
from envs.pool import EnvPool

SMALL = {"train": ["a1b2c3d_1", "a1b2c3d_2", "e4f5a6b_1"], "dev": ["0c0c0c0_1"],
         "test_normal": ["1d1d1d1_1", "1d1d1d1_2"], "test_challenge": ["2e2e2e2_1", "3f3f3f3_1"]}


def _write_data(root, datasets):
    """`<root>/data/datasets/<name>.txt` (one id per line, optional `:tag`) and task folders."""
    (root / "data" / "datasets").mkdir(parents=True)
    for name, ids in datasets.items():
        lines = [f"{tid}:tagged" if k == 0 else tid for k, tid in enumerate(ids)]
        (root / "data" / "datasets" / f"{name}.txt").write_text("\n".join(lines) + "\n\n")
        for tid in ids:
            (root / "data" / "tasks" / tid).mkdir(parents=True)
    return root


@pytest.fixture()
def small_root(tmp_path):
    return _write_data(tmp_path, SMALL)


def test_split_bookkeeping_follows_appworlds_dataset_files(small_root):
    assert read_dataset(small_root, "train") == SMALL["train"]  # tags dropped, blanks skipped
    fam = AppWorldEnv(root=str(small_root), check_sizes=False)
    assert fam.pool() == [t for name in DATASETS for t in SMALL[name]]
    assert fam.task_ids("train") == [0, 1, 2]
    assert fam.split_ids("dev") == [3]
    assert fam.task_ids("test") == [4, 5]
    assert [fam.task_family(i) for i in range(8)] == \
        ["train"] * 3 + ["dev"] + ["test_normal"] * 2 + ["test_challenge"] * 2
    challenge = AppWorldEnv(root=str(small_root), test_split="test_challenge", check_sizes=False)
    assert challenge.task_ids("test") == [6, 7] and challenge.num_tasks() == 8
    with pytest.raises(ValueError, match="test_split"):
        AppWorldEnv(test_split="dev")


def test_release_sizes_are_checked(small_root):
    assert sum(SIZES.values()) == 732
    with pytest.raises(ValueError, match="train has 3 tasks, expected 90"):
        AppWorldEnv(root=str(small_root)).task_ids("train")


def test_missing_data_names_the_folder_and_the_setup(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        AppWorldEnv(root=str(tmp_path)).task_ids("train")
    assert str(tmp_path / "data" / "tasks") in str(e.value)
    assert "envs/setup/appworld.sh" in str(e.value) and "APPWORLD_ROOT" in str(e.value)
    (tmp_path / "data" / "tasks").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="datasets/train.txt"):
        read_dataset(tmp_path, "train")


def test_missing_package_fails_the_episode_in_the_worker(small_root):
    kwargs = {"appworld": {"root": str(small_root), "check_sizes": False}}
    with EnvPool({"appworld": 1}, family_kwargs=kwargs,
                 python={"appworld": sys.executable}) as pool:
        pool.submit_reset("a", "appworld", 0, max_rounds=30)
        (r,) = pool.wait_all(timeout=60)
    assert r.error == "env_error" and not r.success
    assert "appworld package does not import" in r.reason and "COPE_ENV_PYTHON_APPWORLD" in r.reason


def test_instruction_is_the_worked_example_of_appendix_c4():
    text = AppWorldEnv().instruction()
    assert text.startswith("I am your supervisor, and you are an AI Assistant")
    assert text.endswith("The task you must solve will be given to you in the next message.")
    assert "Task: How many playlists do I have in my Spotify playlist library?" in text
    assert "**Key instructions**" in text and "apis.supervisor.complete_task" in text
    assert 11_000 < len(text) < 12_500  # the paper measures 12,396 with its JSON pretty-printed
    assert AppWorldEnv().acknowledgement() == "Ok."
    # the demonstration's code blocks are valid Python
    blocks = text.split("```python\n")[1:]
    for block in blocks:
        compile(block.split("\n```")[0], "<demo>", "exec")
    assert len(blocks) == 12


def test_actions_are_multiline_code_blocks():
    fam = AppWorldEnv()
    reply = ("I will log in first.\n```python\npasswords = apis.supervisor.show_account_passwords()"
             "\nprint(passwords)\n```")
    assert fam.parse_action(reply) == \
        "passwords = apis.supervisor.show_account_passwords()\nprint(passwords)"
    done = "Thought: done.\nAction:\n```python\napis.supervisor.complete_task()\n```"
    assert fam.parse_action(done) == "apis.supervisor.complete_task()"
    assert fam.parse_action("I am not sure what to do.\nMaybe later.") is None
    assert fam.parse_action("```python\nprint(1)") is None  # an unterminated block
    assert fam.success(1.0, True, {"all_passed": True})
    assert not fam.success(0.5, True, {"all_passed": False})


_REPL = '''
"""A stand-in for the appworld package: AppWorld's REPL runs the policy's code in the worker's own
interpreter, and so does this one (the package pins pydantic 1 and is not installed here)."""
import contextlib, io, types


def update_root(root):
    pass


class AppWorld:
    def __init__(self, task_id, experiment_name):
        supervisor = types.SimpleNamespace(first_name="Ada", last_name="L", email="a@x", phone_number="1")
        self.task = types.SimpleNamespace(supervisor=supervisor, instruction="print things")

    def execute(self, code):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})
        return out.getvalue()

    def task_completed(self):
        return False

    def close(self):
        pass
'''


def test_the_policys_code_cannot_read_the_trainers_secrets(small_root, tmp_path, monkeypatch):
    """An AppWorld action runs in a worker that started with an allow-listed environment, in a
    directory of its own: a credential of the trainer's environment is not there to read."""
    stub = tmp_path / "stub"
    (stub / "appworld").mkdir(parents=True)
    (stub / "appworld" / "__init__.py").write_text(_REPL)
    for task in SMALL["train"]:
        (small_root / "data" / "tasks" / task / "specs.json").write_text("{}")
    (small_root / "data" / "base_dbs").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("COPE_TEST_SECRET_KEY", "sk-do-not-leak")
    monkeypatch.setenv("APPWORLD_ROOT", str(small_root))  # a family's own variable does reach it
    code = ("import os\nprint(repr(os.environ.get('COPE_TEST_SECRET_KEY')))\n"
            "print(os.environ.get('APPWORLD_ROOT'))\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))")
    with EnvPool({"appworld": 1}, family_kwargs={"appworld": {"check_sizes": False}},
                 python={"appworld": sys.executable}) as pool:
        pool.submit_reset("a", "appworld", 0, max_rounds=30)
        (r,) = pool.wait_all(timeout=60)
        assert r.ok, r.reason
        pool.submit_step("a", code)
        (r,) = pool.wait_all(timeout=60)
        assert r.ok, r.reason
    secret, root, cwd, listing = r.observation.split("```")[1].strip().splitlines()
    assert secret == "None" and "sk-do-not-leak" not in r.observation
    assert root == str(small_root)
    assert cwd != str(tmp_path) and cwd != str(sys.path[0]) and listing == "[]"
