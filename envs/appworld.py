"""AppWorld (the `appworld` package): a Python REPL against nine simulated apps.

Splits (paper appendix A.3): AppWorld's own partition, read as `appworld.load_task_ids` reads it
(`<root>/data/datasets/<name>.txt`, one task id per line, `:tag` suffixes dropped): train (90),
dev (57), test_normal (168), test_challenge (417), 732 in all. Our integer task ids are positions
in that concatenation (in that order); split 'train' is AppWorld's train, split 'test' is
test_normal, or test_challenge with `test_split="test_challenge"` (the two test sets are separate
evaluation passes). `split_ids(name)` gives any of the four. The static side reads the dataset
files with the standard library, so the trainer needs neither the package nor pydantic 1.

Execution: each reply's code runs through `AppWorld.execute` inside the pool worker (AppWorld's
own restricted REPL and in-process app servers), never in the trainer. AppWorld pins pydantic 1,
so its workers run under the interpreter that envs/setup/appworld.sh makes
(COPE_ENV_PYTHON_APPWORLD). The data (`appworld download data`) cannot be fetched here: without
the package or the data the family fails at start with a message naming what is missing.

Protocol (appendix C.4): the standing instruction is AppWorld's worked example (12k characters,
envs/data/appworld_instruction.txt); the task arrives in the first observation with the
supervisor's identity; an action is the reply's python code block (multi-line); observations are
"Output:" and the REPL output. The episode ends when the code marks the task complete
(`apis.supervisor.complete_task`); then the task's state-based tests run: score = fraction of tests
passed, Y = all passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from envs.base import LAUNCH_DIR, EnvDataError, EnvFamily

DATASETS = ("train", "dev", "test_normal", "test_challenge")
SIZES = {"train": 90, "dev": 57, "test_normal": 168, "test_challenge": 417}
INSTRUCTION_PATH = Path(__file__).resolve().parent / "data" / "appworld_instruction.txt"
INVALID = ("Output:\nNo code to run. Reply with your code in one ```python code block.")
FIRST_OBSERVATION = ("Using these APIs, now generate code to solve the actual task:\n\n"
                     "My name is: {first_name} {last_name}. My personal email is {email} and "
                     "phone number is {phone_number}.\nTask: {instruction}")
SETUP_HINT = ("run envs/setup/appworld.sh, which makes AppWorld's own interpreter (it pins "
              "pydantic 1), installs its apps and downloads its data, and point "
              "COPE_ENV_PYTHON_APPWORLD and APPWORLD_ROOT at what it prints")


def read_dataset(root: str | Path, name: str) -> list[str]:
    """AppWorld task ids of a dataset file, as appworld.load_task_ids reads them."""
    if name not in DATASETS:
        raise ValueError(f"unknown AppWorld dataset {name!r}; known: {DATASETS}")
    data = Path(root) / "data"
    path = data / "datasets" / f"{name}.txt"
    if not (data / "tasks").is_dir() or not path.exists():
        raise EnvDataError(
            f"AppWorld data not found: {path if (data / 'tasks').is_dir() else data / 'tasks'} "
            f"is missing (APPWORLD_ROOT={root}); {SETUP_HINT}")
    return [line.strip().split(":")[0] for line in path.read_text().splitlines() if line.strip()]


class AppWorldEnv(EnvFamily):
    """AppWorld tasks, one `AppWorld` session per episode, in the worker process."""

    name = "appworld"
    max_rounds = {"train": 30, "eval": 30}
    invalid_action_message = INVALID
    multiline_actions = True

    def __init__(self, root: str | None = None, test_split: str = "test_normal",
                 experiment_name: str = "cope", check_sizes: bool = True) -> None:
        super().__init__()
        if test_split not in ("test_normal", "test_challenge"):
            raise ValueError(f"test_split must be test_normal or test_challenge, "
                             f"not {test_split!r}")
        self.root = root or os.environ.get("APPWORLD_ROOT") or os.environ.get(LAUNCH_DIR) or os.getcwd()
        self.test_split = test_split
        self.experiment_name = experiment_name
        self.check_sizes = check_sizes
        self._pool: list[str] | None = None
        self._offsets: dict[str, int] = {}
        self._world = None
        self._score = 0.0

    # ---- static side -------------------------------------------------------------------
    def pool(self) -> list[str]:
        """AppWorld task id of every running id (train, dev, test_normal, test_challenge)."""
        if self._pool is None:
            pool: list[str] = []
            for name in DATASETS:
                ids = read_dataset(self.root, name)
                if self.check_sizes and len(ids) != SIZES[name]:
                    raise ValueError(f"AppWorld {name} has {len(ids)} tasks, expected "
                                     f"{SIZES[name]}: a different AppWorld data release?")
                self._offsets[name] = len(pool)
                pool += ids
            self._pool = pool
        return self._pool

    def split_ids(self, name: str) -> list[int]:
        """Running ids of one of AppWorld's four datasets."""
        pool = self.pool()
        start = self._offsets[name]
        end = start + len(read_dataset(self.root, name))
        return list(range(start, min(end, len(pool))))

    def task_ids(self, split: str) -> list[int]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}")
        return self.split_ids("train" if split == "train" else self.test_split)

    def num_tasks(self) -> int:
        return len(self.pool())

    def instruction(self) -> str:
        return INSTRUCTION_PATH.read_text().rstrip("\n")

    def acknowledgement(self) -> str:
        return "Ok."

    def task_family(self, task_id: int) -> str:
        task_id = int(task_id)
        self.pool()
        return max((off, name) for name, off in self._offsets.items() if off <= task_id)[1]

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and info.get("all_passed", False))

    # ---- live side -----------------------------------------------------------------------
    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        task = self.pool()[int(task_id)]
        try:
            import appworld
        except ImportError as e:
            raise ImportError(f"the appworld package does not import under {sys.executable} "
                              f"({e}); {SETUP_HINT}") from e
        data = Path(self.root) / "data"
        missing = [p for p in (data / "tasks" / task / "specs.json", data / "base_dbs")
                   if not p.exists()]
        if missing:
            raise EnvDataError(f"AppWorld data incomplete: {', '.join(map(str, missing))} "
                                    f"missing; {SETUP_HINT}")
        appworld.update_root(self.root)
        self.close()
        self._world = appworld.AppWorld(task_id=task, experiment_name=self.experiment_name)
        self._score = 0.0
        t = self._world.task
        sup = t.supervisor
        observation = FIRST_OBSERVATION.format(
            first_name=sup.first_name, last_name=sup.last_name, email=sup.email,
            phone_number=sup.phone_number, instruction=t.instruction)
        return observation, {"appworld_task_id": task, "score": 0.0}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        output = self._world.execute(action)
        observation = f"Output:\n```\n{output}\n```"
        if not self._world.task_completed():
            return observation, 0.0, False, {}
        result = self._world.evaluate().to_dict()
        passes, tests = len(result["passes"]), int(result["num_tests"])
        self._score = passes / max(1, tests)
        return observation, self._score, True, {"all_passed": bool(result["success"]),
                                                "passes": passes, "num_tests": tests}

    def _current_score(self) -> float:
        return self._score

    def close(self) -> None:
        if self._world is not None:
            try:
                self._world.close()
            except Exception:  # noqa: BLE001 - a half-open session has nothing left to release
                pass
        self._world = None
