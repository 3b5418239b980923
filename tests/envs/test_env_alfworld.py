"""ALFWorld on the real TextWorld engine, with games generated locally in the real format:
expert plans win through the adapter and the pool, wrong plans lose, data bookkeeping."""

import json
import re
import time

import pytest

from envs.alfworld import INVALID, TASK_TYPES, AlfWorldEnv, list_games, planner_plan, task_type_of
from envs.pool import EnvPool
from tests.alfworld_games import TEST_GAMES, TRAIN_GAMES, make_game_file, write_dataset, write_game


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("alfworld"))


@pytest.fixture(scope="module")
def env(data_dir):
    e = AlfWorldEnv(data_dir=str(data_dir))
    yield e
    e.close()


def test_splits_and_families_from_game_folders(env):
    train, test = env.task_ids("train"), env.task_ids("test")
    assert train == list(range(len(TRAIN_GAMES)))
    assert test == list(range(len(TRAIN_GAMES), len(TRAIN_GAMES) + len(TEST_GAMES)))
    assert {env.task_family(i) for i in train} == set(TASK_TYPES.values())
    assert all("/valid_train/" in str(env.games()[i]) for i in test)
    assert [env.task_family(i) for i in test] == ["pick", "heat"]


def test_game_file_is_the_real_format(data_dir):
    game = list_games(data_dir, "train")[0]
    data = json.loads(game.read_text())
    assert set(data) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
    assert data["solvable"] and data["walkthrough"] == planner_plan(game)
    assert "(define (domain alfred)" in data["pddl_domain"]
    assert "UNKNOWN GOAL" not in data["grammar"]
    assert re.search(r"Your task is to: [^.\"]* mug", data["grammar"])  # the templated goal


def test_expert_plans_win_through_the_adapter(env):
    for tid in env.task_ids("train")[:2]:
        plan = env.expert_plan(tid)
        obs, info = env.reset(tid, max_rounds=30)
        assert obs.startswith("You are in the middle of a room")
        assert "Your task is to: " in obs and "\nAVAILABLE ACTIONS: " in obs
        assert all(a in info["admissible_commands"] for a in ("look", "inventory"))
        for a in plan:
            obs, score, done, info = env.step(a)
        assert done and score == 1.0 and env.success(score, done, info), env.task_family(tid)


def test_expert_plans_win_through_the_pool_and_wrong_plans_lose(env, data_dir):
    ids = env.task_ids("train") + env.task_ids("test")
    plans = {("win", t): env.expert_plan(t) for t in ids}
    pick = next(t for t in ids if env.task_family(t) == "pick")  # put a mug in the shelf:
    assert plans[("win", pick)][-1].endswith(" to shelf 1")      # end on the desk instead
    wrong = plans[("win", pick)][:-2] + ["go to desk 1", plans[("win", pick)][-1].replace(
        "shelf 1", "desk 1")]
    plans[("wrong", pick)] = wrong
    with EnvPool({"alfworld": 2}, family_kwargs={"alfworld": {"data_dir": str(data_dir)}}) as pool:
        for ep in plans:
            pool.submit_reset(ep, "alfworld", ep[1], max_rounds=len(plans[ep]))
        finals, deadline = {}, time.monotonic() + 120
        while len(finals) < len(plans) and time.monotonic() < deadline:
            for r in pool.poll(timeout=30):
                assert r.ok, r.reason
                if r.done:
                    finals[r.env_key] = r
                else:
                    pool.submit_step(r.env_key, plans[r.env_key].pop(0))
    assert set(finals) == set(plans)
    won = {ep[1] for ep, r in finals.items() if ep[0] == "win" and r.success and r.score == 1.0}
    assert won == set(ids) and len({env.task_family(t) for t in won}) == 6
    lost = finals[("wrong", pick)]
    assert not lost.success and lost.score == 0.0 and lost.info["truncated"]
    assert lost.observation.startswith("You move the mug") and "to the desk 1." in lost.observation


def test_invalid_actions_change_nothing(env):
    tid = env.task_ids("test")[0]
    obs0, _ = env.reset(tid, max_rounds=3)
    obs, score, done, info = env.step("fly to the moon")
    assert obs.startswith(INVALID + "\nAVAILABLE ACTIONS: ") and info["invalid"] and not done
    assert obs.split("AVAILABLE ACTIONS: ")[1] == obs0.split("AVAILABLE ACTIONS: ")[1]
    obs, score, done, info = env.step(None)
    assert info["invalid"] and info["parsed"] is False and not done
    obs, score, done, info = env.step("look")
    assert done and info["truncated"] and not env.success(score, done, info)


def test_game_lists_fix_ids_and_order(data_dir, tmp_path):
    games = list_games(data_dir, "train")
    picked = [games[3], games[0]]
    mapping = [{"item_id": i, "task_type": g.parent.parent.name, "task_id": g.parent.name}
               for i, g in enumerate(picked)]
    (tmp_path / "train.json").write_text(json.dumps(mapping))
    (tmp_path / "test.json").write_text(json.dumps(
        [f"{g.parent.parent.name}/{g.parent.name}" for g in list_games(data_dir, "test")[:1]]))
    fam = AlfWorldEnv(data_dir=str(data_dir), train_list=str(tmp_path / "train.json"),
                      test_list=str(tmp_path / "test.json"))
    assert fam.games()[:2] == picked and fam.task_ids("test") == [2]
    # the listed order, not the sorted one (look_at < pick_and < pick_clean < pick_cool < ...)
    assert [fam.task_family(i) for i in range(3)] == ["cool", "examine", "pick"]


def test_missing_data_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="ALFWORLD_DATA"):
        AlfWorldEnv().task_ids("train")
    with pytest.raises(FileNotFoundError, match="json_2.1.1"):
        AlfWorldEnv(data_dir=str(tmp_path)).task_ids("test")
    with EnvPool({"alfworld": 1}, family_kwargs={"alfworld": {"data_dir": str(tmp_path)}}) as pool:
        pool.submit_reset("a", "alfworld", 0)
        (r,) = pool.wait_all(timeout=60)
        assert r.error == "env_error" and "ALFWorld data not found" in r.reason


def test_unknown_task_type_and_unsolvable_games_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown ALFWorld task type"):
        task_type_of(tmp_path / "pick_and_slice-Apple-None-Plate-1" / "trial_x" / "game.tw-pddl")
    game = write_game(tmp_path, "train", "pick_and_place_simple", "Mug", "Shelf")
    trial = game.parent
    # a goal on an object type the room lacks cannot be planned: not solvable, not listed
    problem = (trial / "initial_state.pddl").read_text()
    (trial / "initial_state.pddl").write_text(problem.replace(
        "(objectType ?o MugType)", "(objectType ?o KettleType)"))
    assert not make_game_file(trial)
    assert list_games(tmp_path, "train") == []


def test_handcoded_expert_also_wins_the_generated_games(env):
    """ALFWorld's handcoded expert reads observations, facts and ALFRED's object naming the way
    real games present them; it winning generated games checks that they are real-format."""
    import random

    import textworld
    from alfworld.agents.environment.alfred_tw_env import (AlfredDemangler, AlfredExpert,
                                                           AlfredExpertType, AlfredInfos)
    from textworld.envs import PddlEnv
    random.seed(0)  # the expert explores with the global RNG
    for game in env.games()[:3]:  # examine, pick, clean
        engine = PddlEnv(textworld.EnvInfos(admissible_commands=True, facts=True, won=True,
                                            extras=["gamefile"]))
        engine = AlfredExpert(AlfredInfos(AlfredDemangler(engine, shuffle=False)),
                              expert_type=AlfredExpertType.HANDCODED)
        engine.load(str(game))
        state, steps = engine.reset(), 0
        while not state["won"] and steps < 80:
            state, _, _ = engine.step(state["extra.expert_plan"][0])
            steps += 1
        assert state["won"], game
