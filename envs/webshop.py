"""WebShop (the `web_agent_site` engine of the WebShop repository, princeton-nlp/WebShop).

Configuration (paper appendix A.3): 1,000 products (`num_products=1000`: the 1K product files
and the `indexes_1k` search index), synthetic goals generated from those products' attributes,
shuffled by the engine with random.seed(233): 6,910 goals, the task ids. A goal id is the
engine's fixed session `reset(session=id)`, so an id names the same instruction everywhere.

Splits: a seeded, documented selection (the paper's own ids are not published). Test = goals
0-199, the head of the engine's own test range (goals[:500]); train = 3,930 goals from the engine's
own train range (goals[1500:]), taken in the order of the key sha256("cope-webshop-v1:<id>") and
returned sorted. Disjoint, 59.8% of the pool, as in the paper; no package needed to compute them.

The engine cannot be installed from a package index (the PyPI `webshop` package does not ship
`web_agent_site`) and its data cannot be downloaded here: the family runs workers under the
interpreter made by envs/setup/webshop.sh (COPE_ENV_PYTHON_WEBSHOP) on a WebShop checkout given by
`root` / $WEBSHOP_ROOT, and fails at start with a message naming what is missing.

Protocol (appendix C.2, AgentGym's WebShop client): observations are the engine's text pages
followed by "AVAILABLE ACTIONS: " (search[...] when the page has a search bar, then click[<value>]
for each clickable); actions are `search[keywords]` or `click[value]`; an unparseable reply leaves
the page unchanged ("Invalid action." and the page). Score is the engine's reward in [0, 1] at the
purchase; Y = done and score == 1.0.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from envs.base import EnvDataError, EnvFamily

NUM_GOALS = 6910
NUM_TEST, NUM_TRAIN = 200, 3930
ENGINE_TEST_RANGE, ENGINE_TRAIN_START = 500, 1500
SPLIT_SEED = "cope-webshop-v1"
INVALID = "Invalid action."
# What a WebShop checkout must hold for the 1,000-product configuration (relative to its root).
REQUIRED = {
    "web_agent_site": "the engine's source (clone the WebShop repository)",
    "data/items_shuffle_1000.json": "the 1K product file (WebShop's `setup.sh -d small`)",
    "data/items_ins_v2_1000.json": "the 1K attribute file (WebShop's `setup.sh -d small`)",
    "search_engine/indexes_1k": "the 1K Lucene index (WebShop's search_engine/run_indexing.sh)",
}

INSTRUCTION = (
    "You are web shopping. I will give you instructions about what to do. You have to follow the "
    "instructions. Every round I will give you an observation and a list of available actions, you "
    "have to respond an action based on the state and instruction. You can use search action if "
    "search is available. You can click one of the buttons in clickables. An action should be of "
    "the following structure: search[keywords] click[value] If the action is not valid, perform "
    "nothing. Keywords in search are up to you, but the value in click must be a value in the list "
    "of available actions. Remember that your keywords in search should be carefully designed. "
    "Your response should use the following format: Thought: I think \u2026 Action: "
    "click[something]")
ACKNOWLEDGEMENT = "Ok."


def _split_ids() -> dict[str, tuple[int, ...]]:
    key = lambda i: hashlib.sha256(f"{SPLIT_SEED}:{i}".encode()).digest()  # noqa: E731
    train = sorted(range(ENGINE_TRAIN_START, NUM_GOALS), key=key)[:NUM_TRAIN]
    return {"test": tuple(range(NUM_TEST)), "train": tuple(sorted(train))}


SPLIT_IDS = _split_ids()


def check_install(root: str | Path | None) -> Path:
    """The WebShop checkout, or FileNotFoundError naming what is missing and how to get it."""
    if not root:
        raise EnvDataError(
            "WebShop is not set up: give the family's `root` (or $WEBSHOP_ROOT), a WebShop "
            "checkout prepared by envs/setup/webshop.sh, which names every step.")
    root = Path(root)
    missing = [f"{rel} ({why})" for rel, why in REQUIRED.items() if not (root / rel).exists()
               or ((root / rel).is_dir() and not any((root / rel).iterdir()))]
    if missing:
        raise EnvDataError(f"WebShop checkout {root} lacks: " + "; ".join(missing)
                                + ". See envs/setup/webshop.sh.")
    return root


def format_observation(page: str, available: dict[str, Any]) -> str:
    """The engine's text page followed by the actions it accepts now."""
    actions = (["search[<your query>]"] if available.get("has_search_bar") else []) + \
        [f"click[{c}]" for c in available.get("clickables", [])]
    return f"{page}\nAVAILABLE ACTIONS: {', '.join(actions)}"


def is_action(action: str) -> bool:
    """Whether `action` has the shape the engine understands (search[...] or click[...])."""
    return action.endswith("]") and action.split("[", 1)[0] in ("search", "click") \
        and "[" in action


class WebShopEnv(EnvFamily):
    """WebShop's WebAgentTextEnv in text mode with 1,000 products; one engine per instance."""

    name = "webshop"
    max_rounds = {"train": 15, "eval": 15}
    invalid_action_message = INVALID

    def __init__(self, root: str | None = None) -> None:
        super().__init__()
        self.root = root or os.environ.get("WEBSHOP_ROOT") or ""
        self._env = None
        self._page = ""
        self._score = 0.0

    # ---- static side -------------------------------------------------------------------
    split_ids = SPLIT_IDS

    def num_tasks(self) -> int:
        return NUM_GOALS

    def instruction(self) -> str:
        return INSTRUCTION

    def acknowledgement(self) -> str:
        return ACKNOWLEDGEMENT

    def task_family(self, task_id: int) -> str:
        return "webshop"  # WebShop has no sub-task families

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and score == 1.0)

    # ---- live side -----------------------------------------------------------------------
    def _engine(self):
        if self._env is None:
            root = check_install(self.root)
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            try:
                from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
            except ImportError as e:
                raise ImportError(f"WebShop's engine does not import under {sys.executable} "
                                  f"({e}); make its interpreter with envs/setup/webshop.sh") from e
            env = WebAgentTextEnv(observation_mode="text", num_products=1000, human_goals=False)
            goals = len(env.server.goals)
            if goals != NUM_GOALS:
                raise ValueError(f"WebShop built {goals} synthetic goals, expected {NUM_GOALS}: "
                                 f"is {root} the 1,000-product configuration?")
            self._env = env
        return self._env

    def _observe(self) -> str:
        return format_observation(self._page, self._env.get_available_actions())

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        env = self._engine()
        if not 0 <= task_id < NUM_GOALS:
            raise ValueError(f"WebShop goal id {task_id} outside 0..{NUM_GOALS - 1}")
        self._page, _ = env.reset(session=int(task_id))
        self._score = 0.0
        return self._observe(), {"score": 0.0, "goal": env.get_instruction_text()}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if not is_action(action):
            return self._invalid_step()[:3] + ({"invalid": True},)
        page, reward, done, _ = self._env.step(action)
        self._page, self._score = page, float(reward or 0.0)
        return self._observe(), self._score, bool(done), {"invalid": False}

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        return f"{INVALID}\n\n{self._observe()}", self._score, False, {}

    def _current_score(self) -> float:
        return self._score

    def close(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - the engine may hold no browser at all
                pass
        self._env = None
