"""ScienceWorld played by its gold path, whatever the model says: the rollout's tail measured on
the real engine (`launch.bench --suite=rollout --rollout_families=sciworld_gold`).

Each round, the model's reply (parsed or not) costs its round as usual, but the simulator steps
the task's next gold action (`getGoldActionSequence`, generated at load). An episode therefore
ends on its own within its gold path's length, a success, or runs to the round cap, a
failure: the episode lengths of an agent that solves every task the simulator's way, on the real
engine's observations and step times. The gold paths are not shortest paths (a `wait` loop, a
full tour of rooms), so at the paper's training cap of 20 rounds about half the test tasks
end as failures at the cap (49% of the 200 test tasks have a path of at most 20 actions, 70% at
most 30, the evaluation cap; the paper's trained agents succeed on 64-72% at 30): the long tail of
an agentic batch, with the share of round-capped episodes a real run sees.
"""

from __future__ import annotations

from typing import Any

from envs.sciworld import SciWorldEnv


class GoldSciWorldEnv(SciWorldEnv):
    """ScienceWorld stepping each task's gold path in place of the model's actions (module docstring)."""

    name = "sciworld_gold"
    idle_action = "look around"  # played once the gold path is spent (an episode the cap has not ended)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._path: list[str] = []

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self._load(task_id, gold=True)
        self._path = list(self._server.getGoldActionSequence())
        observation, info = self._opening(task_id)
        return observation, {**info, "gold_length": len(self._path)}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return super()._step(self._path[self._rounds - 1] if self._rounds <= len(self._path) else self.idle_action)

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        return self._step("")
