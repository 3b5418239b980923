"""WebShop without its engine or data (neither can be installed here): splits, the standing
instruction, action parsing and observation layout, and the missing-install errors, also through
the pool."""

import hashlib

import pytest

from envs.pool import EnvPool
from envs.webshop import (NUM_GOALS, REQUIRED, SPLIT_IDS, WebShopEnv, check_install,
                          format_observation, is_action)
from tests.envs.splits import digest_in_fresh_interpreter

PAPER_INSTRUCTION_START = "You are web shopping. I will give you instructions about what to do."


def test_splits_are_disjoint_sized_seeded_and_pinned():
    fam = WebShopEnv()
    train, test = fam.task_ids("train"), fam.task_ids("test")
    assert (len(train), len(test), fam.num_tasks()) == (3930, 200, 6910)
    assert not set(train) & set(test)
    assert test == list(range(200))                      # the engine's own test range head
    assert min(train) >= 1500 and max(train) < NUM_GOALS  # the engine's own train range
    assert round((len(train) + len(test)) / NUM_GOALS, 3) == 0.598
    assert {digest_in_fresh_interpreter("webshop", seed) for seed in ("1", "2")} == {PINNED_SPLIT_DIGEST}
    digest = hashlib.sha256(repr((SPLIT_IDS["train"], SPLIT_IDS["test"])).encode()).hexdigest()
    assert digest[:16] == PINNED_SPLIT_DIGEST
    with pytest.raises(ValueError):
        fam.task_ids("dev")


PINNED_SPLIT_DIGEST = "284950fb228c2d88"


def test_instruction_follows_appendix_c2():
    fam = WebShopEnv()
    assert fam.instruction().startswith(PAPER_INSTRUCTION_START)
    assert "search[keywords] click[value]" in fam.instruction()
    assert fam.instruction().endswith("Action: click[something]")
    assert fam.acknowledgement() == "Ok."
    assert fam.max_rounds == {"train": 15, "eval": 15}


def test_actions_are_parsed_from_react_replies():
    fam = WebShopEnv()
    assert fam.parse_action("Thought: I think the first one fits.\nAction: click[B07X5Q7K1T]") \
        == "click[B07X5Q7K1T]"
    assert fam.parse_action("Thought: search.\nAction:\nsearch[red running shoes size 9]") \
        == "search[red running shoes size 9]"
    assert fam.parse_action("Thought: hmm") is None
    assert is_action("click[Buy Now]") and is_action("search[a [b] c]")
    assert not is_action("buy it") and not is_action("click Buy Now") and not is_action("tap[x]")


def test_observation_lists_the_available_actions():
    page = "Instruction: [SEP] Find me a red mug [SEP] Search"
    obs = format_observation(page, {"has_search_bar": True, "clickables": ["search"]})
    assert obs == page + "\nAVAILABLE ACTIONS: search[<your query>], click[search]"
    obs = format_observation("item page", {"has_search_bar": False,
                                           "clickables": ["< prev", "buy now"]})
    assert obs.endswith("AVAILABLE ACTIONS: click[< prev], click[buy now]")


def test_y_requires_a_perfect_score():
    fam = WebShopEnv()
    assert fam.success(1.0, True, {}) and not fam.success(0.75, True, {})
    assert not fam.success(1.0, False, {})


def test_missing_install_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("WEBSHOP_ROOT", raising=False)
    with pytest.raises(FileNotFoundError, match="WEBSHOP_ROOT"):
        check_install(None)
    with pytest.raises(FileNotFoundError) as e:
        check_install(tmp_path)
    assert all(rel in str(e.value) for rel in REQUIRED) and "envs/setup/webshop.sh" in str(e.value)
    # a checkout with the engine and products but an empty index still lacks the index
    for rel in REQUIRED:
        target = tmp_path / rel
        if rel.endswith(".json"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("[]")
        else:
            target.mkdir(parents=True, exist_ok=True)
    (tmp_path / "web_agent_site" / "__init__.py").write_text("")
    with pytest.raises(FileNotFoundError) as e:
        check_install(tmp_path)
    assert "search_engine/indexes_1k" in str(e.value) and "items_shuffle" not in str(e.value)


def test_missing_install_fails_the_episode_through_the_pool(tmp_path):
    with EnvPool({"webshop": 1}, family_kwargs={"webshop": {"root": str(tmp_path)}}) as pool:
        pool.submit_reset("a", "webshop", 0, max_rounds=15)
        (r,) = pool.wait_all(timeout=60)
        assert r.error == "env_error" and r.done and not r.success
        assert "items_shuffle_1000.json" in r.reason and "webshop.sh" in r.reason
