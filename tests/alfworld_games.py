"""Small ALFWorld games in the real on-disk format, generated locally for the tests.

ALFWorld's data (json_2.1.1, generated from ALFRED) cannot be downloaded here, so each test game
is written as an ALFRED trial folder: `traj_data.json` (task type and pddl_params) and
`initial_state.pddl` (a problem of the ALFRED PDDL domain, ALFRED's mangled object names, the goal
from alfworld's own goal library), then turned into `game.tw-pddl` by make_game_file below,
the `alfworld-generate` procedure (the package's grammar and planner).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Receptacle class -> ALFRED receptacle type (sink basins are `Sink|...|SinkBasin` objects).
RECEPTACLES = ("CounterTop", "Shelf", "Drawer", "Microwave", "Fridge", "SinkBasin", "Desk")
OPENABLE = {"Drawer", "Microwave", "Fridge"}


def _mangle(cls: str, i: int, suffix: str = "") -> str:
    """An ALFRED-style object id (`Mug|+00.11|+00.90|-01.21` with ALFRED's escapes)."""
    name = f"{cls}_bar__plus_00_dot_{10 + i:02d}_bar__plus_00_dot_90_bar__minus_01_dot_{20 + i:02d}"
    return name + (f"_bar_{suffix}" if suffix else "")


def problem(task_type: str, obj: str, recep: str, toggle: str, scene: int) -> str:
    """An ALFRED initial_state.pddl: one room with every receptacle, two `obj`, a distractor and a
    desk lamp; where the objects start (never in the goal receptacle) varies with `scene`."""
    import alfworld.gen.goal_library as glib
    receps = {r: _mangle("Sink", 1, "SinkBasin") if r == "SinkBasin" else _mangle(r, k + 1)
              for k, r in enumerate(RECEPTACLES)}
    locs = {r: f"loc_bar_{k}_bar_{k + scene}_bar_0_bar_30" for k, r in enumerate(RECEPTACLES)}
    places = [p for p in ("CounterTop", "Drawer", "Shelf", "Desk") if p != recep]  # not solved yet
    objects = {_mangle(obj, 11): places[scene % 3], _mangle(obj, 12): places[(scene + 1) % 3],
               _mangle("Apple", 13): places[(scene + 2) % 3], _mangle("DeskLamp", 14): "Desk"}
    otypes = sorted({obj, "Apple", "DeskLamp"})
    lines = ["(define (problem plan_trial)", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in RECEPTACLES]
    lines += [f"{o} - object" for o in objects] + [f"{r} - receptacle" for r in receps.values()]
    lines += [f"{loc} - location" for loc in locs.values()] + ["loc_bar_start - location", ")"]
    lines += ["(:init", "(atLocation agent1 loc_bar_start)"]
    for rt, r in receps.items():
        lines += [f"(receptacleType {r} {rt}Type)", f"(receptacleAtLocation {r} {locs[rt]})"]
        lines += [f"(openable {r})"] if rt in OPENABLE else []
        lines += [f"(canContain {rt}Type {ot}Type)" for ot in otypes if ot != "DeskLamp"]
    for o, rt in objects.items():
        cls = o.split("_bar_")[0]
        lines += [f"(objectType {o} {cls}Type)", f"(inReceptacle {o} {receps[rt]})",
                  f"(objectAtLocation {o} {locs[rt]})"]
        lines += ([f"(toggleable {o})"] if cls == "DeskLamp" else
                  [f"(pickupable {o})", f"(cleanable {o})", f"(heatable {o})", f"(coolable {o})"])
    lines.append(")")
    goal = glib.gdict[task_type]["pddl"].format(obj=obj, recep=recep, toggle=toggle, mrecep="")
    return "\n".join(lines) + "\n" + goal.replace("#", "-")


def write_game(root: Path, split_dir: str, task_type: str, obj: str, recep: str = "",
               toggle: str = "", scene: int = 1, trial: str = "trial_T20190901_000000_000001"
               ) -> Path:
    """Write one trial folder under root/json_2.1.1/<split_dir>/ and its game file."""
    folder = f"{task_type}-{obj}-None-{recep or toggle}-{scene}"
    trial_dir = Path(root) / "json_2.1.1" / split_dir / folder / trial
    trial_dir.mkdir(parents=True, exist_ok=True)
    traj = {"task_type": task_type, "scene": {"scene_num": scene},
            "pddl_params": {"object_target": obj, "parent_target": recep, "toggle_target": toggle,
                            "mrecep_target": "", "object_sliced": False},
            "turk_annotations": {"anns": [{"task_desc": f"{task_type} {obj}"}]}}
    (trial_dir / "traj_data.json").write_text(json.dumps(traj))
    (trial_dir / "initial_state.pddl").write_text(problem(task_type, obj, recep, toggle, scene))
    if not make_game_file(trial_dir):
        raise RuntimeError(f"generated game {trial_dir} is not solvable")
    return trial_dir / "game.tw-pddl"


# One game per family for train, two more for valid_train.
TRAIN_GAMES = (
    ("pick_and_place_simple", "Mug", "Shelf", ""),
    ("look_at_obj_in_light", "Mug", "", "DeskLamp"),
    ("pick_clean_then_place_in_recep", "Mug", "Shelf", ""),
    ("pick_heat_then_place_in_recep", "Mug", "CounterTop", ""),
    ("pick_cool_then_place_in_recep", "Mug", "Shelf", ""),
    ("pick_two_obj_and_place", "Mug", "Shelf", ""),
)
TEST_GAMES = (
    ("pick_and_place_simple", "Mug", "Desk", ""),
    ("pick_heat_then_place_in_recep", "Mug", "Shelf", ""),
)


def write_dataset(root: Path) -> Path:
    for k, (tt, obj, recep, toggle) in enumerate(TRAIN_GAMES):
        write_game(root, "train", tt, obj, recep, toggle, scene=k + 1)
    for k, (tt, obj, recep, toggle) in enumerate(TEST_GAMES):
        write_game(root, "valid_train", tt, obj, recep, toggle, scene=k + 2)
    return root


def make_game_file(trial_dir: str | Path, seed: int = 0) -> bool:
    """Write `game.tw-pddl` for an ALFRED trial folder (traj_data.json + initial_state.pddl), as
    `alfworld-generate` does: the package's PDDL domain, its grammar with the templated goal, the
    problem, and the planner's walkthrough; returns whether the game is solvable."""
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    from envs.alfworld import planner_plan

    trial = Path(trial_dir)
    with open(trial / "traj_data.json") as f:
        traj = json.load(f)
    random.seed(seed)  # the goal template is drawn with the global RNG inside alfworld
    game = {"pddl_domain": Path(ALFRED_PDDL_PATH).read_text(),
            "grammar": add_task_to_grammar(Path(ALFRED_TWL2_PATH).read_text(), traj,
                                           rng=random.Random(seed)),
            "pddl_problem": (trial / "initial_state.pddl").read_text(),
            "solvable": None, "walkthrough": None}
    path = trial / "game.tw-pddl"
    path.write_text(json.dumps(game))
    try:
        plan = planner_plan(path)
    except Exception:  # noqa: BLE001 - the planner found no plan: an unsolvable game
        plan = None
    game["walkthrough"], game["solvable"] = plan, bool(plan)
    path.write_text(json.dumps(game))
    return game["solvable"]
