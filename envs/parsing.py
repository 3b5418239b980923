"""Extract the action from a model reply (method §5, paper appendix C).

The standing instructions ask for `Thought: ... Action: ...` (ReAct), or `Action: ...` alone; models
also answer with a bare action line or wrap the action in a ``` code block (AppWorld's actions *are*
code blocks). One parser covers all of them so every family reads replies the same way, and the
string it returns is exactly what the forecasting targets are built from (method §3).

Rules, in order:
1. The last `Action:` marker (also `ACTION:`) wins; its action is the rest of that line, or, when
   that is empty, the next non-empty line or the code block that follows.
2. Otherwise the first fenced code block, if `code_blocks` is on.
3. Otherwise, if `bare` is on, a reply of exactly one non-empty line that is not a `Thought:` line.
4. Anything else (empty, thought only, several unmarked lines, an empty block) is malformed: None.
The found text is stripped of surrounding whitespace, backticks and quotes and, for single-line
families, of one trailing period ("Action: go north." is common). A single-line family rejects an
action that spans several lines.
"""

from __future__ import annotations

import re

# `Action:` at the start of a line or after whitespace/punctuation, so "Reaction:" does not match.
_ACTION_RE = re.compile(r"(?:^|(?<=[\s.,;!?*]))(?:Action|ACTION)\s*:", re.MULTILINE)
_FENCE_RE = re.compile(r"```[^\n`]*\n?(.*?)```", re.DOTALL)
_THOUGHT_RE = re.compile(r"^\s*(?:Thought|THOUGHT)\s*:")
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _strip_end_tokens(text: str) -> str:
    for tok in _END_TOKENS:
        text = text.replace(tok, "")
    return text


def _clean(action: str, multiline: bool) -> str | None:
    action = action.strip()
    # Surrounding markdown/quotes, possibly nested (`"go north"`).
    while len(action) >= 2 and action[0] == action[-1] and action[0] in "`'\"":
        action = action[1:-1].strip()
    action = action.strip("`").strip()
    if not multiline:
        if "\n" in action:
            return None
        if action.endswith(".") and not action.endswith(".."):
            action = action[:-1].rstrip()
    return action or None


def _after_marker(rest: str) -> str:
    """The action text that follows an `Action:` marker."""
    fence = _FENCE_RE.match(rest.lstrip())
    if fence:
        return fence.group(1)
    first, _, tail = rest.partition("\n")
    if first.strip():
        return first
    for line in tail.split("\n"):
        if line.strip():
            if line.strip().startswith("```"):
                fence = _FENCE_RE.search(tail)
                return fence.group(1) if fence else ""
            return line
    return ""


def parse_action(reply: str | None, *, code_blocks: bool = True, bare: bool = True,
                 multiline: bool = False) -> str | None:
    """Return the action in `reply`, or None when the reply is malformed.

    `multiline=True` keeps multi-line actions (code-as-action families); otherwise an action must be
    one line. None makes the environment answer with its invalid-action observation.
    """
    if not reply:
        return None
    text = _strip_end_tokens(reply).replace("\r\n", "\n")
    if not text.strip():
        return None
    markers = list(_ACTION_RE.finditer(text))
    if markers:
        return _clean(_after_marker(text[markers[-1].end():]), multiline)
    if code_blocks:
        fence = _FENCE_RE.search(text)
        if fence:
            return _clean(fence.group(1), multiline)
        if "```" in text:
            return None  # an unterminated block is malformed, not a bare action
    if bare:
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if len(lines) == 1 and not _THOUGHT_RE.match(lines[0]):
            return _clean(lines[0], multiline)
    return None
