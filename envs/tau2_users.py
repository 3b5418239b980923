"""Pluggable customer simulators for tau2-bench (envs.tau2).

A tau2 episode always runs a simulated customer next to the agent. Which one is a plain-data spec
(it travels to the pool worker as JSON in the family's kwargs):

    {"kind": "gold"}                      scripted from the task's gold actions (tests, demos)
    {"kind": "scripted", "turns": [...]}  a fixed list of user messages, one per user turn
    {"kind": "llm", "base_url": "http://host:port/v1", "model": "...", "temperature": 0.7,
     "api_key_env": "OPENAI_API_KEY", "timeout": 120}
                                          tau2's own user simulator (its guidelines, the task's
                                          scenario, the user's device tools in telecom), with
                                          generation sent to any OpenAI-compatible endpoint

A user turn is either text ({"content": "..."}; ###STOP### / ###TRANSFER### ends the episode) or
tool calls on the user's side ({"tool_calls": [{"name": ..., "arguments": {...}}]}, telecom's
device actions). A run configures it in `env.user` (configs/base.py); the `llm` kind's calls of
one environment step share a budget inside the pool's call deadline (`time_left`), so a slow
endpoint fails that episode, not the worker. Anything that implements `ChatBackend.complete` can
be plugged in from Python with `make_user(..., backend=...)`.

tau2 (and its pydantic models) is imported lazily, inside the worker that runs the family.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, Callable, Protocol

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
GOLD_DONE = "Done, I did that."          # the gold user's reply after performing device actions


class ChatBackend(Protocol):
    """Generates the next message of a chat (the simulated customer's side)."""

    def complete(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """OpenAI-style messages (and tool schemas) in; {"content": str | None,
        "tool_calls": [{"id", "name", "arguments": dict}] | None} out."""


class OpenAIChatBackend:
    """`/chat/completions` of any OpenAI-compatible server, over the standard library."""

    def __init__(self, base_url: str, model: str, temperature: float = 0.7,
                 api_key_env: str | None = "OPENAI_API_KEY", timeout: float = 120.0,
                 max_tokens: int | None = None, time_left: Callable[[], float] | None = None) -> None:
        if not base_url:
            raise ValueError("the llm user needs base_url (an OpenAI-compatible endpoint)")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.timeout = model, temperature, timeout
        self.max_tokens = max_tokens
        self.time_left = time_left  # seconds the current environment step has left for the customer
        self.api_key = os.environ.get(api_key_env, "") if api_key_env else ""

    def complete(self, messages: list[dict], tools: list[dict] | None) -> dict:
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "temperature": self.temperature}
        if tools:
            body["tools"] = tools
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode("utf-8"), headers)
        timeout = self.timeout if self.time_left is None else min(self.timeout, self.time_left())
        if timeout <= 0:
            raise RuntimeError(f"user simulator endpoint {self.url}: the step's time for the customer is spent")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = json.loads(response.read().decode("utf-8"))
        except (urllib.error.URLError, OSError) as e:  # TimeoutError is an OSError
            raise RuntimeError(f"user simulator endpoint {self.url} failed within {timeout:.3g} s: {e}") from e
        message = reply["choices"][0]["message"]
        calls = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments") or {}
            calls.append({"id": call.get("id", ""), "name": fn["name"],
                          "arguments": json.loads(args) if isinstance(args, str) else args})
        return {"content": message.get("content"), "tool_calls": calls or None}


def gold_script(task) -> list[dict]:
    """User turns that go with replaying a task's gold actions (see envs.tau2.gold_replies):
    the opening request, then for each run of user-side gold actions those tool calls and a short
    confirmation, and finally ###STOP###."""
    scenario = task.user_scenario.instructions
    reason = getattr(scenario, "reason_for_call", None) or str(scenario)
    turns: list[dict] = [{"content": f"Hi. {reason}".strip()}]
    pending: list[dict] = []
    for action in (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []:
        if action.requestor == "user":
            pending.append({"name": action.name, "arguments": dict(action.arguments)})
        elif pending:
            turns += [{"tool_calls": [c]} for c in pending] + [{"content": GOLD_DONE}]
            pending = []
    if pending:
        turns += [{"tool_calls": [c]} for c in pending] + [{"content": GOLD_DONE}]
    return turns + [{"content": STOP}]


def make_user(spec: dict, task, environment, backend: ChatBackend | None = None,
              time_left: Callable[[], float] | None = None):
    """A tau2 BaseUser for one episode of `task` in `environment` (inside the worker); an `llm`
    customer's calls end by `time_left()` seconds (the step's share of its deadline)."""
    kind = spec.get("kind", "gold")
    if kind == "gold":
        return _classes()["ScriptedUser"](gold_script(task))
    if kind == "scripted":
        return _classes()["ScriptedUser"](list(spec["turns"]))
    if kind == "llm":
        if backend is None:
            backend = OpenAIChatBackend(spec.get("base_url", ""), spec.get("model", "user"),
                                        spec.get("temperature", 0.7),
                                        spec.get("api_key_env", "OPENAI_API_KEY"),
                                        spec.get("timeout", 120.0), spec.get("max_tokens"), time_left)
        tools = environment.user_tools.get_tools() if environment.user_tools else None
        return _classes()["BackendUser"](backend, tools=tools,
                                         instructions=str(task.user_scenario))
    raise ValueError(f"unknown tau2 user kind {kind!r}; known: gold, scripted, llm")


_CLASSES: dict[str, type] = {}


def _classes() -> dict[str, type]:
    """The user classes, defined on first use (they subclass tau2's, imported lazily)."""
    if _CLASSES:
        return _CLASSES
    from tau2.data_model.message import MultiToolMessage, ToolCall, UserMessage
    from tau2.user.base import BaseUser, UserState
    from tau2.user.user_simulator import UserSimulator
    from tau2.utils.llm_utils import to_litellm_messages

    def to_user_message(turn: dict, index: int) -> UserMessage:
        calls = turn.get("tool_calls")
        if calls:
            return UserMessage(role="user", content=None, tool_calls=[
                ToolCall(id=c.get("id") or f"user_call_{index}_{k}", name=c["name"],
                         arguments=dict(c.get("arguments") or {}), requestor="user")
                for k, c in enumerate(calls)])
        return UserMessage(role="user", content=str(turn.get("content") or ""))

    class ScriptedUser(BaseUser):
        """Plays a fixed list of user turns; when it runs out it stops the episode."""

        def __init__(self, turns: list[dict]) -> None:
            super().__init__(instructions=None, llm=None, llm_args=None)
            self.turns = turns
            self._offset = 0

        def get_init_state(self, message_history=None) -> UserState:
            history = list(message_history or [])
            self._offset = sum(isinstance(m, UserMessage) for m in history)
            return UserState(system_messages=[], messages=history)

        def generate_next_message(self, message, state):
            state.messages.extend(message.tool_messages if isinstance(message, MultiToolMessage)
                                  else [message])
            index = sum(isinstance(m, UserMessage) for m in state.messages) - self._offset
            turn = self.turns[index] if index < len(self.turns) else {"content": STOP}
            reply = to_user_message(turn, index)
            state.messages.append(reply)
            return reply, state

        @classmethod
        def is_stop(cls, message) -> bool:
            return UserSimulator.is_stop(message)

        def set_seed(self, seed: int) -> None:
            pass

        def stop(self, message=None, state=None) -> None:
            pass

    class BackendUser(UserSimulator):
        """tau2's user simulator (prompt, scenario, user tools) generating through a backend."""

        def __init__(self, backend: ChatBackend, tools=None, instructions=None) -> None:
            super().__init__(tools=tools, instructions=instructions, llm="backend", llm_args={})
            self.backend = backend

        def _generate_next_message(self, message, state):
            state.messages.extend(message.tool_messages if isinstance(message, MultiToolMessage)
                                  else [message])
            messages = to_litellm_messages(state.system_messages + state.flip_roles())
            schemas = [t.openai_schema for t in self.tools] if self.tools else None
            out = self.backend.complete(_openai_messages(messages), schemas)
            turn = ({"tool_calls": out["tool_calls"]} if out.get("tool_calls")
                    else {"content": out.get("content") or ""})
            reply = to_user_message(turn, len(state.messages))
            state.messages.append(reply)
            return reply, state

        def set_seed(self, seed: int) -> None:
            pass

    _CLASSES.update(ScriptedUser=ScriptedUser, BackendUser=BackendUser)
    return _CLASSES


def _openai_messages(messages: list[dict]) -> list[dict]:
    """litellm-style dicts -> strict OpenAI chat format (tool calls nested under 'function')."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]}
                               for c in m["tool_calls"]]
        out.append(m)
    return out
