"""ALFWorld on the real TextWorld engine (`alfworld` + `textworld` with its PDDL backend).

A task is one ALFWorld game: a trial folder holding `traj_data.json` (task type and parameters)
and `game.tw-pddl` (the ALFRED PDDL domain, the text grammar with the goal filled in, the problem,
and the `solvable` flag), laid out as
`json_2.1.1/<split>/<task_type>-<Obj>-<Mrecep>-<Recep>-<scene>/trial_*/`. The game is played by
textworld's `PddlEnv` (fast-downward grounds the PDDL) wrapped in ALFWorld's own name demangler,
exactly as `AlfredTWEnv` does.

Tasks and splits (method §5, paper appendix A.3): the training pool is the games under
json_2.1.1/train and the test set the games under json_2.1.1/valid_train, concatenated into one
list, train first, so test ids follow the train ids (2420-2619 with the paper's 2,420 / 200 lists).
The lists are, when given (`train_list` / `test_list`: JSON files of {"task_type": <game folder>,
"task_id": <trial folder>} entries, the mapping files of AgentGym's ALFWorld server, or plain lists
of "<game folder>/<trial folder>" strings), exactly those games in that order; otherwise every
playable game of the split folder (AlfredTWEnv's rule: one of the six task types, not movable or
sliced, `solvable` true), sorted by path. The data folder is `data_dir`, else $ALFWORLD_DATA.
Families are the six task types, read off the game folder's name (Table 8).

Protocol (appendix C.1, AgentGym's ALFWorld client): the first observation is the game intro
without its banner (the room, then "Your task is to: ..."), every observation ends with
"AVAILABLE ACTIONS: " and the admissible commands; an inadmissible command leaves the state
unchanged and the engine answers "Nothing happens.". Score is 1.0 once the game is won, and
Y = won. `expert_plan` is the engine's planner expert (fast-downward on the game's PDDL).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from envs.base import EnvDataError, EnvFamily

# ALFRED task type (the game folder's prefix) -> family name used in metrics.
TASK_TYPES = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "examine",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick_two",
}
SPLIT_DIRS = {"train": "train", "test": "valid_train"}
INVALID = "Nothing happens."

INSTRUCTION = (
    'Interact with a household to solve a task. Imagine you are an intelligent agent in a '
    'household environment and your target is to perform actions to complete the task goal. At '
    'the beginning of your interactions, you will be given the detailed description of the current '
    'environment and your goal to accomplish. For each of your turn, you will be given a list of '
    'actions which you can choose one to perform in this turn. You should choose from two actions: '
    '"THOUGHT" or "ACTION". If you choose "THOUGHT", you should first think about the current '
    'condition and plan for your future actions, and then output your action in this turn. Your '
    'output must strictly follow this format:"Thought: your thoughts. Action: your next action"; '
    'If you choose "ACTION", you should directly output the action in this turn. Your output must '
    'strictly follow this format:"Action: your next action". After your each turn, the environment '
    'will give you immediate feedback based on which you plan your next few steps. if the '
    'envrionment output "Nothing happened", that means the previous action is invalid and you '
    'should try more options. Reminder: 1. the action must be chosen from the given available '
    'actions. Any actions except provided available actions will be regarded as illegal. 2. Think '
    'when necessary, try to act directly more in the process.')
ACKNOWLEDGEMENT = "OK. I\u2019ll follow your instructions and try my best to solve the task."


def task_type_of(game_path: str | Path) -> str:
    """ALFRED task type of a game (the prefix of its game folder's name)."""
    folder = Path(game_path).parent.parent.name
    task_type = folder.split("-", 1)[0]
    if task_type not in TASK_TYPES:
        raise ValueError(f"{game_path}: unknown ALFWorld task type {task_type!r}")
    return task_type


def _read_list(path: str | Path) -> list[str]:
    with open(path) as f:
        entries = json.load(f)
    return [e if isinstance(e, str) else f"{e['task_type']}/{e['task_id']}" for e in entries]


def _playable(trial: Path) -> bool:
    """AlfredTWEnv.collect_game_files' filter, for one trial folder."""
    game = trial / "game.tw-pddl"
    if "movable" in str(trial) or "Sliced" in str(trial) or not game.exists():
        return False
    if trial.parent.name.split("-", 1)[0] not in TASK_TYPES:
        return False
    with open(game) as f:
        return bool(json.load(f).get("solvable"))


def list_games(data_dir: str | Path, split: str, game_list: str | Path | None = None) -> list[Path]:
    """The game files of a split, in task-id order (see the module docstring)."""
    root = Path(data_dir) / "json_2.1.1" / SPLIT_DIRS[split]
    if game_list is not None:
        games = [root / rel / "game.tw-pddl" for rel in _read_list(game_list)]
        missing = [str(g) for g in games if not g.exists()]
        if missing:
            raise EnvDataError(f"{len(missing)} games of {game_list} are missing under "
                                    f"{root}, e.g. {missing[0]}")
        return games
    if not root.is_dir():
        raise EnvDataError(
            f"ALFWorld data not found: {root} does not exist. Point data_dir (or $ALFWORLD_DATA) "
            f"at the folder holding json_2.1.1/train and json_2.1.1/valid_train, e.g. the one "
            f"`alfworld-download` fills.")
    trials = sorted(p.parent for p in root.glob("*/*/traj_data.json"))
    return [t / "game.tw-pddl" for t in trials if _playable(t)]


class AlfWorldEnv(EnvFamily):
    """ALFWorld games through textworld's PddlEnv; one engine per instance, reused across games."""

    name = "alfworld"
    max_rounds = {"train": 20, "eval": 30}
    invalid_action_message = INVALID

    def __init__(self, data_dir: str | None = None, train_list: str | None = None,
                 test_list: str | None = None, list_actions: bool = True) -> None:
        super().__init__()
        self.data_dir = data_dir or os.environ.get("ALFWORLD_DATA") or ""
        self.lists = {"train": train_list, "test": test_list}
        self.list_actions = list_actions
        self._games: dict[str, list[Path]] | None = None
        self._env = None
        self._state = None

    # ---- static side -------------------------------------------------------------------
    def games(self) -> list[Path]:
        """Every game file, indexed by task id (train games, then test games)."""
        if self._games is None:
            if not self.data_dir:
                raise EnvDataError(
                    "ALFWorld data not found: set data_dir or $ALFWORLD_DATA to the folder "
                    "holding json_2.1.1/train and json_2.1.1/valid_train.")
            self._games = {s: list_games(self.data_dir, s, self.lists[s]) for s in SPLIT_DIRS}
        return self._games["train"] + self._games["test"]

    def task_ids(self, split: str) -> list[int]:
        if split not in SPLIT_DIRS:
            raise ValueError(f"unknown split {split!r}")
        n_train = len(self.games()) - len(self._games["test"])
        return list(range(n_train)) if split == "train" else \
            list(range(n_train, n_train + len(self._games["test"])))

    def num_tasks(self) -> int:
        return len(self.games())

    def instruction(self) -> str:
        return INSTRUCTION

    def acknowledgement(self) -> str:
        return ACKNOWLEDGEMENT

    def task_family(self, task_id: int) -> str:
        return TASK_TYPES[task_type_of(self.games()[int(task_id)])]

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(info.get("won", False))

    # ---- live side -----------------------------------------------------------------------
    def _engine(self):
        if self._env is None:
            import textworld
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
            from textworld.envs import PddlEnv
            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
            self._env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
        return self._env

    def _observe(self, text: str) -> str:
        if not self.list_actions:
            return text
        return f"{text}\nAVAILABLE ACTIONS: {','.join(self._state['admissible_commands'])}"

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        game = self.games()[int(task_id)]
        env = self._engine()
        env.load(str(game))
        self._state = env.reset()
        intro = "\n".join(self._state.feedback.split("\n\n")[1:])  # drop the banner
        commands = list(self._state["admissible_commands"])
        return self._observe(intro), {"game": str(game), "won": False, "score": 0.0,
                                      "admissible_commands": commands}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._state, _, _ = self._engine().step(action)
        feedback = self._state.feedback
        if feedback.startswith("You arrive at loc "):  # AgentGym strips the location id
            feedback = feedback[feedback.find(". ") + 2:]
        won = bool(self._state["won"])
        return self._observe(feedback), float(won), won, {
            "won": won, "invalid": feedback == INVALID,
            "admissible_commands": list(self._state["admissible_commands"])}

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        return self._observe(INVALID), self._current_score(), False, {"won": False}

    def _current_score(self) -> float:
        return float(bool(self._state and self._state["won"]))

    def expert_plan(self, task_id: int) -> list[str]:
        """The engine's planner expert: a command sequence that wins the game from its start."""
        return planner_plan(self.games()[int(task_id)])

    def close(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - nothing to release on a half-built engine
                pass
        self._env = self._state = None


def planner_plan(game_file: str | Path) -> list[str]:
    """Plan a game with fast-downward through ALFWorld's PLANNER expert wrapper."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import (AlfredDemangler, AlfredExpert,
                                                           AlfredExpertType, AlfredInfos)
    from textworld.envs import PddlEnv
    env = PddlEnv(textworld.EnvInfos(admissible_commands=True, extras=["gamefile"]))
    env = AlfredExpert(AlfredInfos(AlfredDemangler(env, shuffle=False)),
                       expert_type=AlfredExpertType.PLANNER)
    env.load(str(game_file))
    return list(env.reset()["extra.expert_plan"])
