"""ScienceWorld (the `scienceworld` package, a Scala simulator behind a py4j gateway).

Task pool (method §5, paper appendix A.3): the 30 task types minus 5-1, 5-2, 9-1, 9-2, 9-3, 10-1,
10-2, every variation of the remaining 23, in the package's task order (tasks.json, i.e. "1-1",
"1-2", ...) and variation order 0..n-1 -- the enumeration of AgentGym's server -- indexed by one
running id: 4,639 (task, variation) pairs. The table below is the package's own task list and
variation counts (checked against the package by tests), so the trainer can use ids, splits and
families without the package installed.

Splits: a seeded, documented selection. Every running id i gets the key
sha256("cope-sciworld-v1:<i>"); ids sorted by key form one fixed permutation of the pool; the first
200 are the test split and the next 2,120 the train split (both returned sorted). The selection is
uniform over the pool, disjoint by construction, and independent of Python's `random`, so it is the
same on every machine and version. (The paper's own ids, from AgentGym, are not published; theirs
cover 22/23 task types in train and 12/23 in test, ours cover all 23 in train and most in test.)

Live side, built for throughput:
- the raw server path: `PythonInterface.step` plus `getScore` / `getCompleted`. The package's
  `ScienceWorldEnv.step` also recomputes the valid action-object combinations, look, inventory
  and task description on every call (20-50x slower);
- our own round cap (EnvFamily.reset(max_rounds)): the package's `envStepLimit` counts simulator
  moves, and `look around` is not one;
- our own JVM launch with a capped heap (`-Xmx512m` by default), so four workers fit in memory.

Y and score (method §5): score is the simulator's 0..100 score (-100 when the task is failed, e.g. a
wrong `focus on`; the episode then ends, as in the package); Y = done and score >= 100.
The first observation is the task description followed by the output of `look around`
(AgentGym's reset), so the goal arrives inside it (appendix C.3).
"""

from __future__ import annotations

import atexit
import hashlib
import weakref
from typing import Any

from envs.base import EnvFamily

# (ScienceWorld task id, task name, number of variations), in the package's order.
TASKS: tuple[tuple[str, str, int], ...] = (
    ("1-1", "boil", 30), ("1-2", "melt", 30), ("1-3", "freeze", 30),
    ("1-4", "change-the-state-of-matter-of", 30),
    ("2-1", "use-thermometer", 540), ("2-2", "measure-melting-point-known-substance", 436),
    ("2-3", "measure-melting-point-unknown-substance", 300),
    ("3-1", "power-component", 20),
    ("3-2", "power-component-renewable-vs-nonrenewable-energy", 20),
    ("3-3", "test-conductivity", 900), ("3-4", "test-conductivity-of-unknown-substances", 600),
    ("4-1", "find-living-thing", 300), ("4-2", "find-non-living-thing", 300),
    ("4-3", "find-plant", 300), ("4-4", "find-animal", 300),
    ("5-1", "grow-plant", 126), ("5-2", "grow-fruit", 126),
    ("6-1", "chemistry-mix", 32), ("6-2", "chemistry-mix-paint-secondary-color", 36),
    ("6-3", "chemistry-mix-paint-tertiary-color", 36),
    ("7-1", "lifespan-longest-lived", 125), ("7-2", "lifespan-shortest-lived", 125),
    ("7-3", "lifespan-longest-lived-then-shortest-lived", 125),
    ("8-1", "identify-life-stages-1", 14), ("8-2", "identify-life-stages-2", 10),
    ("9-1", "inclined-plane-determine-angle", 168),
    ("9-2", "inclined-plane-friction-named-surfaces", 1386),
    ("9-3", "inclined-plane-friction-unnamed-surfaces", 162),
    ("10-1", "mendelian-genetics-known-plant", 120),
    ("10-2", "mendelian-genetics-unknown-plant", 480),
)
EXCLUDED = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
POOL: tuple[tuple[str, int], ...] = tuple(
    (name, v) for tid, name, n in TASKS if tid not in EXCLUDED for v in range(n))
NAME_TO_ID = {name: tid for tid, name, _ in TASKS}
SPLIT_SEED = "cope-sciworld-v1"
NUM_TEST, NUM_TRAIN = 200, 2120
INVALID = "No known action matches that input."

INSTRUCTION = (
    'You are an agent for science world. Every round I will give you an observation, you have to '
    'respond an action based on the observation to finish the given task. Here are the actions you '
    'may take: [{"action": "open/close OBJ", "description": "open/close a container"}, '
    '{"action": "de/activate OBJ", "description": "activate/deactivate a device"}, '
    '{"action": "connect OBJ to OBJ", "description": "connect electrical components"}, '
    '{"action": "disconnect OBJ", "description": "disconnect electrical components"}, '
    '{"action": "use OBJ [on OBJ]", "description": "use a device/item"}, '
    '{"action": "look around", "description": "describe the current room"}, '
    '{"action": "look at OBJ", "description": "describe an object in detail"}, '
    '{"action": "look in OBJ", "description": "describe a container\u2019s contents"}, '
    '{"action": "read OBJ", "description": "read a note or book"}, '
    '{"action": "move OBJ to OBJ", "description": "move an object to a container"}, '
    '{"action": "pick up OBJ", "description": "move an object to the inventory"}, '
    '{"action": "put down OBJ", "description": "drop an inventory item"}, '
    '{"action": "pour OBJ into OBJ", "description": "pour a liquid into a container"}, '
    '{"action": "dunk OBJ into OBJ", "description": "dunk a container into a liquid"}, '
    '{"action": "mix OBJ", "description": "chemically mix a container"}, '
    '{"action": "go to LOC", "description": "move to a new location"}, '
    '{"action": "eat OBJ", "description": "eat a food"}, '
    '{"action": "flush OBJ", "description": "flush a toilet"}, '
    '{"action": "focus on OBJ", "description": "signal intent on a task object"}, '
    '{"action": "wait", "description": "take no action for 10 iterations"}, '
    '{"action": "wait1", "description": "take no action for 1 iteration"}, '
    '{"action":"examine OBJ","description":"provides a description of the objects present on or '
    'in a receptacle."}, {"action": "task", "description": "describe current task"}, '
    '{"action": "inventory", "description": "list your inventory"}] Your response should use the '
    'following format: Thought: your thoughts. Action: your next action')
ACKNOWLEDGEMENT = "OK. I\u2019ll follow your instructions and try my best to solve the task."


def _split_order() -> list[int]:
    key = lambda i: hashlib.sha256(f"{SPLIT_SEED}:{i}".encode()).digest()  # noqa: E731
    return sorted(range(len(POOL)), key=key)


_ORDER = _split_order()
SPLIT_IDS = {"test": tuple(sorted(_ORDER[:NUM_TEST])),
             "train": tuple(sorted(_ORDER[NUM_TEST:NUM_TEST + NUM_TRAIN]))}


class SciWorldEnv(EnvFamily):
    """ScienceWorld through the raw server path; one JVM per instance, started on first reset."""

    name = "sciworld"
    max_rounds = {"train": 20, "eval": 30}
    invalid_action_message = INVALID

    def __init__(self, java_opts: tuple[str, ...] | list[str] = ("-Xmx512m", "-XX:+UseSerialGC"),
                 simplifications: str = "") -> None:
        super().__init__()
        self.java_opts = list(java_opts)
        self.simplifications = simplifications
        self._gateway = None
        self._proc = None
        self._server = None
        self._score = 0.0

    # ---- static side -------------------------------------------------------------------
    split_ids = SPLIT_IDS

    def num_tasks(self) -> int:
        return len(POOL)

    def instruction(self) -> str:
        return INSTRUCTION

    def acknowledgement(self) -> str:
        return ACKNOWLEDGEMENT

    def task_family(self, task_id: int) -> str:
        return POOL[int(task_id)][0]

    @staticmethod
    def task_of(task_id: int) -> tuple[str, int]:
        """(task name, variation) of a running id."""
        return POOL[int(task_id)]

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and score >= 100)

    # ---- live side -----------------------------------------------------------------------
    def _open(self) -> None:
        if self._server is not None:
            return
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH
        port, proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH,
                                    javaopts=self.java_opts, return_proc=True)
        self._proc = proc
        self._gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port),
                                    java_process=proc)
        self._server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        # py4j hangs interpreter exit while a gateway is open: close it before that.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def _load(self, task_id: int, gold: bool) -> None:
        self._open()
        name, variation = POOL[int(task_id)]
        self._server.load(name, variation, self.simplifications, gold)
        self._score = 0.0

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self._load(task_id, gold=False)
        return self._opening(task_id)

    def _opening(self, task_id: int) -> tuple[str, dict[str, Any]]:
        """The loaded task's first observation (its description, then `look around`) and info."""
        description = self._server.getTaskDescription()
        observation = self._server.step("look around")
        name, variation = POOL[int(task_id)]
        return f"{description}\n{observation}", {
            "task_name": name, "variation": variation, "sw_task_id": NAME_TO_ID[name],
            "task_description": description, "score": 0.0}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        observation = self._server.step(action)
        score = float(int(round(100 * self._server.getScore())))
        done = bool(self._server.getCompleted()) or score < 0
        self._score = score
        return observation, score, done, {"score": score}

    def _current_score(self) -> float:
        return self._score

    def gold_actions(self, task_id: int) -> list[str]:
        """The simulator's gold action sequence for a task (loads the task; for tests/demos)."""
        self._load(task_id, gold=True)
        return list(self._server.getGoldActionSequence())

    def close(self) -> None:
        gateway, proc = self._gateway, self._proc
        self._gateway = self._proc = self._server = None
        if gateway is not None:
            try:
                gateway.shutdown()
            except Exception:  # noqa: BLE001 - the JVM may already be gone
                pass
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
