"""A synthetic family whose episode lengths are known in advance and long-tailed, for measuring the
rollout's tail (`launch.bench --suite=rollout --rollout_families=tail`) and testing what is done
about it.

The length of task t's episode depends on t alone (a seeded draw) and on nothing the policy says:
every reply, parsed or not, costs one round. With probability `success_rate` the task is one the
agent "solves": the episode ends on its own after 1 + Geometric rounds (mean `mean_success_rounds`),
a success. Otherwise it never ends on its own and runs to the round cap, a failure. That is the
shape of an agentic batch at the paper's caps (20-50 rounds): the successes end early, the
failures hold their rows to the cap, and a step waits for them.
"""

from __future__ import annotations

import random
import time
from typing import Any

from envs.base import EnvFamily

NEVER = 10**9  # the length of a failing task: the round cap ends it


class TailEnv(EnvFamily):
    """Episodes of known, long-tailed lengths (module docstring)."""

    name = "tail"
    split_ids = {"train": range(0, 1000), "test": range(1000, 1200)}
    idle_action = "wait"

    def __init__(self, success_rate: float = 0.7, mean_success_rounds: float = 3.0, seed: int = 0,
                 call_s: float = 0.0) -> None:
        super().__init__()
        if not 0 <= success_rate <= 1 or mean_success_rounds < 1 or call_s < 0:
            raise ValueError(f"need 0 <= success_rate <= 1, mean_success_rounds >= 1 and call_s >= 0, "
                             f"got {success_rate}, {mean_success_rounds}, {call_s}")
        self.success_rate, self.mean_success_rounds, self.seed = success_rate, mean_success_rounds, seed
        self.call_s = call_s  # seconds each reset and step takes: a simulator's (or simulated user's) own time
        self._length = NEVER

    def length(self, task_id: int) -> int:
        """Rounds task `task_id`'s episode lasts on its own (NEVER: until the round cap)."""
        rng = random.Random(f"{self.seed}:{task_id}")
        if rng.random() >= self.success_rate:
            return NEVER
        rounds, p = 1, 1.0 / self.mean_success_rounds  # 1 + Geometric(p) failures: mean 1/p
        while rng.random() >= p:
            rounds += 1
        return rounds

    def instruction(self) -> str:
        return "Answer each observation with one action, as 'Action: <action>'. The task ends when it ends."

    def task_family(self, task_id: int) -> str:
        return "tail"

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and score >= 1.0)

    def expert_actions(self, task_id: int) -> list[str]:
        """What a demonstrator plays: `wait` until a solvable task ends (none for a failing one)."""
        n = self.length(task_id)
        return [] if n == NEVER else [self.idle_action] * n

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        time.sleep(self.call_s)
        self._length = self.length(task_id)
        return f"Task {task_id}. Round 0.", {}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return self._advance()

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        return self._advance()

    def _advance(self) -> tuple[str, float, bool, dict[str, Any]]:
        time.sleep(self.call_s)
        done = self._rounds >= self._length
        return f"Round {self._rounds}.", float(done), done, {"invalid": False}

    def _current_score(self) -> float:
        return 0.0
