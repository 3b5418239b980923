"""The environment protocol every family implements (docs/architecture.md "Env protocol", method §5).

One class per family carries two sides:
- the *static* side, used by the rollout loop in the trainer process: task pool and splits,
  standing instruction and acknowledgement (paper appendix C), action parsing, success label,
  sub-task family of a task, round limits. It must work with the standard library alone, because
  the trainer's interpreter need not have the environment's packages;
- the *live* side, used only inside a pool worker: `reset` / `step` on one episode at a time.
  Environment packages are imported lazily there (under the family's own interpreter).

`reset` and `step` are template methods: the base class owns the round counter, our own step cap
(environments count steps differently, e.g. ScienceWorld ignores `look around`), and the rule that
an unparseable reply (action None) still costs a round and yields the invalid-action observation.
Subclasses implement `_reset`, `_step` and `success`.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

from envs.parsing import parse_action as _parse_action

SPLITS = ("train", "test")


# the trainer's working directory, for workers that start in one of their own (FamilySpec.own_cwd)
LAUNCH_DIR = "COPE_LAUNCH_DIR"


class EnvDataError(FileNotFoundError):
    """The family's data or package is missing; the message names it and how to get it."""


class EnvFamily(abc.ABC):
    """Base class of an environment family; one instance holds at most one live episode."""

    name: str = ""
    # Rounds per episode for training rollouts and for evaluation (method §5).
    max_rounds: dict[str, int] = {"train": 20, "eval": 30}
    # Observation returned for an action the environment cannot execute or parse.
    invalid_action_message: str = "Nothing happens."
    # Action parsing options (see envs.parsing.parse_action).
    multiline_actions: bool = False
    # How a reply states an action, for written demonstrations (cope_jax.run.demos): ReAct's line.
    reply_format: str = "Action: {action}"
    # An action that costs a round and changes nothing, for demonstrators that idle
    # (cope_jax.run.demos, warmstart.dawdle); None: the family has none.
    idle_action: str | None = None
    # How the rollout lays out the chat (optional protocol, defaults fit every ReAct family):
    # 'react': user instruction + fixed acknowledgement, then observations as user turns;
    # 'tool_calling': a system message (`system_prompt(task_id)`) rendered with the native tools
    # list (`tools(task_id)`), no acknowledgement, and each observation in the role given by the
    # step/reset info's 'role' ('tool' results are grouped into <tool_response> user turns).
    chat_layout: str = "react"
    # How a summary's overall Score / Succ combines the sub-task families (cope_jax/run/metrics.py):
    # 'count-weighted' over all episodes, or 'family-mean' (the unweighted mean of the families').
    overall: str = "count-weighted"

    def __init__(self) -> None:
        self._rounds = 0
        self._max_rounds: int | None = None
        self._done = True
        self._task_id: int | None = None

    # ---- static side -------------------------------------------------------------------
    # split name -> task ids; families with a fixed table just set it (others override task_ids)
    split_ids: Mapping[str, Sequence[int]] = {}

    @classmethod
    def warm_up(cls) -> None:
        """What a worker does once before it reports ready (under the family's start timeout), so
        the first reset's call deadline does not pay for it: heavy imports. Default: nothing."""

    def task_ids(self, split: str) -> list[int]:
        """Task ids of `split` ('train' or 'test'), a stable list."""
        if split not in self.split_ids:
            raise ValueError(f"unknown split {split!r}; known: {sorted(self.split_ids)}")
        return list(self.split_ids[split])

    def num_tasks(self) -> int:
        """Size of the pool the splits are drawn from."""
        return len(set(self.task_ids("train")) | set(self.task_ids("test")))

    @abc.abstractmethod
    def instruction(self) -> str:
        """Standing instruction: the first user turn of every episode (appendix C)."""

    def acknowledgement(self) -> str:
        """Fixed assistant reply to the instruction (appendix C)."""
        return "OK. I'll follow your instructions and try my best to solve the task."

    def system_prompt(self, task_id: int) -> str | None:
        """System message of a 'tool_calling' family (None: the chat format's default)."""
        return None

    def tools(self, task_id: int) -> list[dict] | None:
        """OpenAI JSON schemas of the tools advertised to the model ('tool_calling' families)."""
        return None

    def parse_action(self, reply: str | None) -> str | None:
        """The action in a model reply, None when malformed (-> invalid-action observation)."""
        return _parse_action(reply, multiline=self.multiline_actions)

    @abc.abstractmethod
    def task_family(self, task_id: int) -> str:
        """Sub-task family of a task, for per-family metrics."""

    @abc.abstractmethod
    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        """Success label Y of an episode's final step (method §5)."""

    # ---- live side -----------------------------------------------------------------------
    def reset(self, task_id: int, max_rounds: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns (first observation, info).

        `max_rounds` caps the number of `step` calls; the step that reaches it returns done=True
        with info['truncated']=True (unless the episode ended on its own at that step).
        """
        self._rounds = 0
        self._max_rounds = max_rounds
        self._done = False
        self._task_id = int(task_id)
        observation, info = self._reset(int(task_id))
        info = dict(info)
        info.setdefault("task_id", int(task_id))
        info.setdefault("family", self.task_family(int(task_id)))
        return observation, info

    def step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """One round; `action` None means the reply was unparseable. Returns (obs, score, done, info)."""
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._rounds += 1
        if action is None:
            observation, score, done, info = self._invalid_step()
            info = dict(info, invalid=True, parsed=False)
        else:
            observation, score, done, info = self._step(action)
            info = dict(info)
            info.setdefault("invalid", observation == self.invalid_action_message)
            info.setdefault("parsed", True)
        info.setdefault("score", float(score))
        info["rounds"] = self._rounds
        info["truncated"] = False
        if not done and self._max_rounds is not None and self._rounds >= self._max_rounds:
            done = True
            info["truncated"] = True
        self._done = bool(done)
        return observation, float(score), bool(done), info

    def close(self) -> None:
        """Release what the live side holds (processes, files). Safe to call twice."""

    @abc.abstractmethod
    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        """Family-specific reset."""

    @abc.abstractmethod
    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Family-specific step on a parsed action."""

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        """Round spent on an unparseable reply: the state is unchanged."""
        return self.invalid_action_message, self._current_score(), False, {}

    def _current_score(self) -> float:
        """Raw score of the live episode so far (for unparseable rounds)."""
        return 0.0
