"""The Qwen chat format (ChatML), rendered directly to token ids, turn by turn.

`<|im_start|>` and `<|im_end|>` are special tokens, so BPE never merges across them: encoding each
turn `<|im_start|>{role}\n{content}<|im_end|>\n` on its own and concatenating gives exactly the ids
of encoding the whole rendered conversation. That is what lets a rollout append an observation turn
to a live sequence (and keep the sampler's assistant ids untouched) without ever re-tokenizing the
history. The rendering follows the Qwen2.5 chat template (default system prompt, tools block,
`<tool_call>` rendering of assistant tool calls, consecutive tool results grouped into one user turn).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from cope_jax.rollout.tokenizer import IM_END, IM_START, Tokenizer


@dataclasses.dataclass(frozen=True)
class ChatStyle:
    default_system: str | None  # system turn added when the conversation has none
    generation_prefix: str = ""  # text after "<|im_start|>assistant\n" in a generation prompt


STYLES = {
    "qwen2.5": ChatStyle(default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": ChatStyle(default_system=None),
    # Qwen3 with thinking disabled (its template's enable_thinking=False)
    "qwen3_no_think": ChatStyle(default_system=None, generation_prefix="<think>\n\n</think>\n\n"),
    "plain": ChatStyle(default_system=None),
}

_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and "
                 "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                 "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One rendered turn: `ids[content_start:content_end]` are the content tokens."""

    role: str
    ids: list[int]
    content_start: int
    content_end: int


def _tojson(x: Any) -> str:
    # transformers' chat-template `tojson` filter
    return json.dumps(x, ensure_ascii=False)


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, style: str | ChatStyle = "qwen2.5"):
        self.tokenizer = tokenizer
        if isinstance(style, str):
            if style not in STYLES:
                raise ValueError(f"unknown chat style {style!r}; known: {sorted(STYLES)}")
            style = STYLES[style]
        self.style = style
        self.im_end_id = tokenizer.token_id(IM_END)
        self._suffix = tokenizer.encode(IM_END + "\n")  # [<|im_end|>, "\n"]

    # -- single turns ------------------------------------------------------------------------------
    def turn(self, role: str, content: str) -> Turn:
        """`<|im_start|>{role}\\n{content}<|im_end|>\\n` with its content span."""
        return self._turn_from_text(role, f"{role}\n{content}")

    def generation_prompt(self, role: str = "assistant") -> list[int]:
        """`<|im_start|>assistant\\n` (+ the style's prefix): the sampler continues from here and
        ends its turn with `<|im_end|>`."""
        return self.tokenizer.encode(f"{IM_START}{role}\n{self.style.generation_prefix}")

    def end_of_turn(self) -> list[int]:
        """The ids that follow a sampled `<|im_end|>` before the next turn (the newline)."""
        return self._suffix[1:]

    # -- whole conversations ----------------------------------------------------------------------
    def turns(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[Turn]:
        """Renders OpenAI-style messages (role, content, optional tool_calls) into turns."""
        messages = list(messages)
        out: list[Turn] = []
        first_is_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] if first_is_system else self.style.default_system
        if tools:
            text = "\n".join([_TOOLS_HEADER] + [_tojson(t) for t in tools]) + _TOOLS_FOOTER
            text = f"{system}\n\n{text}" if system else text
            out.append(self._turn_from_text("system", f"system\n{text}"))
        elif system is not None:
            out.append(self.turn("system", system))
        i = 1 if first_is_system else 0
        while i < len(messages):
            m = messages[i]
            role = m["role"]
            if role == "tool":  # consecutive tool results share one user turn
                parts = []
                while i < len(messages) and messages[i]["role"] == "tool":
                    parts.append(f"\n<tool_response>\n{messages[i]['content']}\n</tool_response>")
                    i += 1
                out.append(self._turn_from_text("user", "user" + "".join(parts)))
                continue
            if role == "assistant" and m.get("tool_calls"):
                text = "assistant" + (f"\n{m['content']}" if m.get("content") else "")
                for call in m["tool_calls"]:
                    call = call.get("function", call)
                    text += (f'\n<tool_call>\n{{"name": "{call["name"]}", "arguments": '
                             f'{_tojson(call["arguments"])}}}\n</tool_call>')
                out.append(self._turn_from_text("assistant", text))
            elif role in ("user", "assistant", "system"):
                out.append(self.turn(role, m["content"]))
            else:
                raise ValueError(f"message {i}: unknown role {role!r}")
            i += 1
        return out

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
        ids = [t for turn in self.turns(messages, tools) for t in turn.ids]
        return ids + self.generation_prompt() if add_generation_prompt else ids

    # -- internals ---------------------------------------------------------------------------------
    def _turn_from_text(self, role: str, body: str) -> Turn:
        ids = self.tokenizer.encode(f"{IM_START}{body}{IM_END}\n")
        header = self.tokenizer.encode(f"{IM_START}{role}\n")
        # the header normally tokenizes on its own; if the content's first characters merged into
        # it (content starting with whitespace), the content span starts at the common prefix
        start = 0
        while start < min(len(header), len(ids)) and header[start] == ids[start]:
            start += 1
        return Turn(role, ids, start, len(ids) - len(self._suffix))
