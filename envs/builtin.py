"""Built-in environment: a tiny house of rooms, solvable in 3-12 ordered steps, pure Python.

It is the environment of the embedded demo and of the fast tests, so it is built for a few-million-
parameter model on a CPU: a vocabulary of a few dozen words, observations of a line or two,
actions from a tiny grammar:

    go north|south|east|west   take OBJ   open door   put OBJ in CONTAINER   look

Three sub-task families (for per-family metrics), each needing several correct steps in order:
- fetch:   "Task: take the apple."           walk to the object, take it;
- deliver: "Task: put the cup in the box."   walk to the object, take it, walk to the box, put it;
- unlock:  "Task: go to the attic."          the attic's door is locked: fetch the key, walk to the
                                             door, `open door`, go through.
Every observation after a move, take, open or put restates the task and describes the room,
including the side the agent came in by ("You came in from the south."); exits are listed in right-hand-rule order relative to
the agent's heading (right, straight, left, back; heading north at the start).
Anything the house cannot do answers the fixed invalid-action message "Nothing happens.".
A reply is the bare action line (`reply_format`, how demonstrations are written); a ReAct
`Action:` line parses too.
Score = fraction of the family's milestones reached (e.g. deliver: holding the object 0.5, object in
the container 1.0); Y = 1 iff the episode ended with all milestones reached.

Tasks: `generate_task(task_id)` is a pure function of the id (a `random.Random` seeded with the
string "builtin-v1:<id>", stable across Python versions). Splits are disjoint *as tasks*, not only as ids: a task's split is decided by a
hash of its content (1 in 8 goes to test), and each split keeps the first `num_train` / `num_test`
distinct tasks in id order; a layout is kept when its shortest solution (`shortest_solution`, BFS
with a fixed direction order, knowing the map) has 3..12 steps.

The expert that demonstrates (`expert_actions`) knows only what the agent sees: it takes and opens
what the task needs when it is in the room, and otherwise walks by the right-hand rule (try right of
its heading, then straight, left, back: the first open exit listed), which tours a tree of rooms.
Its next action is a function of the task, the current observation and what it holds, so a small
model can imitate it; the
shortest solution cannot be imitated (it needs the map). It is deterministic and on average ~1.2x
as long as the shortest solution.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from envs.base import EnvFamily

ROOMS = ("hall", "kitchen", "garden", "cellar", "attic", "study")
ITEMS = ("key", "apple", "ball", "cup", "book")
CONTAINERS = ("box", "basket")
DIRS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
FAMILIES = ("fetch", "unlock", "deliver")
INVALID = "Nothing happens."
MIN_STEPS, MAX_STEPS = 3, 12
_TEST_EVERY = 8  # one task in 8 (by content hash) belongs to the test split

INSTRUCTION = (
    "You are an agent in a small house. Every round I will give you an observation, you have to "
    "respond an action to finish the given task. Actions: go DIR (north, south, east, west), "
    "take OBJ, open door, put OBJ in OBJ, look. Respond with your next action only, on one line.")


@dataclass(frozen=True)
class Task:
    """A generated task: house layout, object placement, start room and goal."""
    task_id: int
    family: str
    exits: dict[str, dict[str, str]]          # room -> {direction: room}
    items: dict[str, str]                     # takeable object -> room
    containers: dict[str, str]                # container -> room
    start: str
    goal: tuple[str, ...]                     # fetch (obj,), deliver (obj, container), unlock (room,)
    locked: tuple[str, str] | None = None     # (room, direction) of the locked door

    def text(self) -> str:
        if self.family == "fetch":
            return f"Task: take the {self.goal[0]}."
        if self.family == "deliver":
            return f"Task: put the {self.goal[0]} in the {self.goal[1]}."
        return f"Task: go to the {self.goal[0]}."

    def signature(self) -> str:
        """Content of the task without its id: equal signatures = the same task."""
        body = {"family": self.family, "exits": self.exits, "items": self.items,
                "containers": self.containers, "start": self.start, "goal": self.goal,
                "locked": self.locked}
        return json.dumps(body, sort_keys=True)


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _shortest_path(exits: dict[str, dict[str, str]], src: str, dst: str,
                   blocked: tuple[str, str] | None) -> list[str] | None:
    """Directions from src to dst by BFS (fixed direction order), avoiding the blocked door."""
    prev: dict[str, tuple[str, str] | None] = {src: None}
    queue = deque([src])
    while queue:
        room = queue.popleft()
        if room == dst:
            break
        for d in DIRS:
            nxt = exits[room].get(d)
            if nxt is None or nxt in prev:
                continue
            if blocked is not None and ((room, d) == blocked or (nxt, OPPOSITE[d]) == blocked):
                continue
            prev[nxt] = (room, d)
            queue.append(nxt)
    if dst not in prev:
        return None
    path: list[str] = []
    room = dst
    while prev[room] is not None:
        room, d = prev[room]
        path.append(d)
    return path[::-1]


def shortest_solution(task: Task) -> list[str]:
    """Deterministic shortest solution of a task, planned on the full map."""
    go = lambda path: [f"go {d}" for d in path]  # noqa: E731
    sp = lambda a, b: _shortest_path(task.exits, a, b, task.locked)  # noqa: E731
    if task.family == "fetch":
        (obj,) = task.goal
        return go(sp(task.start, task.items[obj])) + [f"take {obj}"]
    if task.family == "deliver":
        obj, box = task.goal
        return (go(sp(task.start, task.items[obj])) + [f"take {obj}"]
                + go(sp(task.items[obj], task.containers[box])) + [f"put {obj} in {box}"])
    door_room, door_dir = task.locked
    key_room = task.items["key"]
    return (go(sp(task.start, key_room)) + ["take key"] + go(sp(key_room, door_room))
            + ["open door", f"go {door_dir}"])


CLOCKWISE = ("north", "east", "south", "west")


def _preference(heading: str) -> tuple[str, ...]:
    """Right-hand rule: right of the heading, straight on, left, back."""
    i = CLOCKWISE.index(heading)
    return tuple(CLOCKWISE[(i + k) % 4] for k in (1, 0, 3, 2))


def expert_actions(task: Task, max_steps: int = 4 * MAX_STEPS) -> list[str]:
    """The demonstrator's actions: acts on what it sees, explores by the right-hand rule."""
    room, items, door_open, heading = task.start, dict(task.items), False, "north"
    acts: list[str] = []
    act = acts.append
    while len(acts) < max_steps:
        here = {o for o, r in items.items() if r == room}
        want = task.goal[0] if task.family != "unlock" else "key"
        if items.get(want) != "inventory" and want in here:
            act(f"take {want}")
            items[want] = "inventory"
            if task.family == "fetch":
                return acts
            continue
        if items.get(want) == "inventory":
            if task.family == "deliver" and task.containers.get(task.goal[1]) == room:
                act(f"put {want} in {task.goal[1]}")
                return acts
            if task.family == "unlock" and task.locked[0] == room:
                if not door_open:
                    act("open door")
                    door_open = True
                    continue
                act(f"go {task.locked[1]}")
                return acts
        exits = task.exits[room]
        heading = next(d for d in _preference(heading)
                       if d in exits and (door_open or task.locked != (room, d)))
        act(f"go {heading}")
        room = exits[heading]
    raise RuntimeError(f"expert did not solve builtin task {task.task_id} in {max_steps} steps")


def _layout(rng: random.Random) -> dict[str, dict[str, str]]:
    """A random tree of 3-5 rooms on a grid (so directions are consistent)."""
    names = rng.sample(ROOMS, rng.choice((3, 4, 4, 5)))
    pos = {names[0]: (0, 0)}
    taken = {(0, 0)}
    exits: dict[str, dict[str, str]] = {names[0]: {}}
    for name in names[1:]:
        while True:
            base = rng.choice(sorted(pos))
            d = rng.choice(tuple(DIRS))
            x, y = pos[base][0] + DIRS[d][0], pos[base][1] + DIRS[d][1]
            if (x, y) not in taken:
                break
        pos[name] = (x, y)
        taken.add((x, y))
        exits[name] = {OPPOSITE[d]: base}
        exits[base][d] = name
    return exits


def _candidate(task_id: int, family: str, rng: random.Random) -> Task:
    exits = _layout(rng)
    rooms = sorted(exits)
    items: dict[str, str] = {}
    containers: dict[str, str] = {}
    locked = None
    if family == "fetch":
        obj = rng.choice(ITEMS)
        items[obj] = rng.choice(rooms)
        goal: tuple[str, ...] = (obj,)
    elif family == "deliver":
        obj, box = rng.choice(ITEMS[1:]), rng.choice(CONTAINERS)
        items[obj], containers[box] = rng.choice(rooms), rng.choice(rooms)
        goal = (obj, box)
    else:
        leaves = [r for r in rooms if len(exits[r]) == 1]
        target = rng.choice(leaves)
        (d_in, door_room), = exits[target].items()
        locked = (door_room, OPPOSITE[d_in])
        rooms = [r for r in rooms if r != target]
        items["key"] = rng.choice(rooms)
        goal = (target,)
    # One distractor object or container half of the time.
    if rng.random() < 0.5:
        spare = [o for o in ITEMS if o not in items]
        items[rng.choice(spare)] = rng.choice(rooms)
    elif family != "deliver" and rng.random() < 0.5:
        containers[rng.choice(CONTAINERS)] = rng.choice(rooms)
    start = rng.choice(rooms)
    return Task(task_id, family, exits, items, containers, start, goal, locked)


@lru_cache(maxsize=8192)
def generate_task(task_id: int) -> Task:
    """The task of an id: deterministic, expert solution of 3..12 steps."""
    rng = random.Random(f"builtin-v1:{task_id}")
    family = FAMILIES[task_id % len(FAMILIES)]
    for _ in range(1000):
        task = _candidate(task_id, family, rng)
        if MIN_STEPS <= len(shortest_solution(task)) <= MAX_STEPS:
            return task
    raise RuntimeError(f"no valid layout for builtin task {task_id}")  # pragma: no cover


def task_split(task: Task) -> str:
    digest = hashlib.sha256(task.signature().encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % _TEST_EVERY == 0 else "train"


@lru_cache(maxsize=16)
def _split_ids(split: str, count: int) -> tuple[int, ...]:
    ids, seen, i = [], set(), 0
    while len(ids) < count:
        task = generate_task(i)
        sig = task.signature()
        if task_split(task) == split and sig not in seen:
            seen.add(sig)
            ids.append(i)
        i += 1
    return tuple(ids)


@dataclass
class _State:
    room: str
    items: dict[str, str]                      # object -> room | "inventory" | container
    door_open: bool = False
    came_from: str | None = None               # the side of the room the agent entered by
    reached: set[str] = field(default_factory=set)


class BuiltinEnv(EnvFamily):
    """The built-in house environment (see module docstring)."""

    name = "builtin"
    max_rounds = {"train": 15, "eval": 20}
    invalid_action_message = INVALID
    # a reply is the bare action line: the acting turns then share the format of CoPE's forecasting
    # targets (method §3.1: the action strings, one per line), so a small policy learns one format, not two
    reply_format = "{action}"
    idle_action = "look"  # costs a round, changes nothing (demonstrations may dawdle with it)

    def __init__(self, num_train: int = 1000, num_test: int = 100) -> None:
        super().__init__()
        self.num_train, self.num_test = int(num_train), int(num_test)
        self._task: Task | None = None
        self._state: _State | None = None

    # ---- static side -------------------------------------------------------------------
    def task_ids(self, split: str) -> list[int]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}")
        return list(_split_ids(split, self.num_train if split == "train" else self.num_test))

    def instruction(self) -> str:
        return INSTRUCTION

    def acknowledgement(self) -> str:
        return "OK."

    def task_family(self, task_id: int) -> str:
        return FAMILIES[int(task_id) % len(FAMILIES)]

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and info.get("won", False))

    def expert_actions(self, task_id: int) -> list[str]:
        """The expert's demonstration for a task (deterministic)."""
        return expert_actions(generate_task(int(task_id)))

    # ---- live side -----------------------------------------------------------------------
    def _milestones(self) -> tuple[str, ...]:
        fam = self._task.family
        return {"fetch": ("holding",), "deliver": ("holding", "placed"),
                "unlock": ("key", "door", "arrived")}[fam]

    def _current_score(self) -> float:
        if self._task is None:
            return 0.0
        return len(self._state.reached) / len(self._milestones())

    def _describe(self) -> str:
        task, st = self._task, self._state
        here = [o for o in ITEMS if st.items.get(o) == st.room]
        here += [c for c in CONTAINERS if task.containers.get(c) == st.room]
        if not here:
            seen = "nothing"
        elif len(here) == 1:
            seen = _article(here[0])
        else:
            seen = ", ".join(_article(w) for w in here[:-1]) + " and " + _article(here[-1])
        exits = []
        heading = OPPOSITE[st.came_from] if st.came_from else "north"
        for d in _preference(heading):  # right-hand-rule order: the way back is always last
            if d in task.exits[st.room]:
                lock = task.locked == (st.room, d) and not st.door_open
                exits.append(d + (" (locked)" if lock else ""))
        came = f" You came in from the {st.came_from}." if st.came_from else ""
        return f"{task.text()} You are in the {st.room}.{came} You see {seen}. Exits: {', '.join(exits)}."

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self._task = task = generate_task(task_id)
        self._state = _State(room=task.start, items=dict(task.items))
        return self._describe(), {"task": task.text(), "score": 0.0, "won": False}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs = self._apply(" ".join(action.lower().split()))
        self._update_milestones()
        score = self._current_score()
        won = score >= 1.0
        return obs, score, won, {"won": won, "score": score}

    def _apply(self, act: str) -> str:
        task, st = self._task, self._state
        words = act.split()
        if act == "look":
            return self._describe()
        if len(words) == 2 and words[0] == "go" and words[1] in DIRS:
            nxt = task.exits[st.room].get(words[1])
            if nxt is None:
                return INVALID
            if task.locked == (st.room, words[1]) and not st.door_open:
                return "The door is locked."
            st.room, st.came_from = nxt, OPPOSITE[words[1]]
            return self._describe()
        if len(words) == 2 and words[0] == "take" and st.items.get(words[1]) == st.room:
            st.items[words[1]] = "inventory"
            return f"You take the {words[1]}. {self._describe()}"
        if act == "open door" and task.locked is not None and task.locked[0] == st.room \
                and not st.door_open and st.items.get("key") == "inventory":
            st.door_open = True
            return f"You open the door. {self._describe()}"
        if len(words) == 4 and words[0] == "put" and words[2] == "in" \
                and st.items.get(words[1]) == "inventory" \
                and task.containers.get(words[3]) == st.room:
            st.items[words[1]] = words[3]
            return f"You put the {words[1]} in the {words[3]}. {self._describe()}"
        return INVALID

    def _update_milestones(self) -> None:
        task, st = self._task, self._state
        if task.family == "fetch":
            if st.items[task.goal[0]] == "inventory":
                st.reached.add("holding")
        elif task.family == "deliver":
            obj, box = task.goal
            if st.items[obj] == "inventory":
                st.reached.add("holding")
            if st.items[obj] == box:
                st.reached.update(("holding", "placed"))
        else:
            if st.items["key"] == "inventory":
                st.reached.add("key")
            if st.door_open:
                st.reached.add("door")
            if st.room == task.goal[0]:
                st.reached.add("arrived")
