"""Action parsing: the paper's reply formats (appendix C), table-driven, malformed ones included."""

import pytest

from envs.builtin import BuiltinEnv
from envs.parsing import parse_action
from envs.sciworld import SciWorldEnv

# (reply, expected action for a single-line family)
CASES = [
    # ReAct: Thought then Action on its own line, or on the same line (the instruction's format).
    ("Thought: the key is north.\nAction: go north", "go north"),
    ("Thought: I should look. Action: look around", "look around"),
    ("Thought: first the door.\n\nAction: open door to kitchen\n", "open door to kitchen"),
    ("THOUGHT: go.\nACTION: go south", "go south"),
    ("Action: take key", "take key"),
    ("Action:go east", "go east"),
    ("Action: go north.", "go north"),                       # trailing period dropped
    ("Action: `take apple`", "take apple"),                  # inline code
    ('Action: "put apple in box"', "put apple in box"),      # quoted
    ("Action:\ngo west", "go west"),                         # action on the next line
    ("Action:\n```\nfocus on blue jay\n```", "focus on blue jay"),
    ("Thought: a\nAction: go north\nObservation: ...\nAction: take key", "take key"),  # last wins
    ("Action: click[Buy Now]", "click[Buy Now]"),            # WebShop
    ("Action: search[red shoes]", "search[red shoes]"),
    ("Thought: x\nAction: go north<|im_end|>", "go north"),  # stray end token
    ("Thought: x\r\nAction: go north\r\n", "go north"),      # CRLF
    # Bare actions.
    ("go north", "go north"),
    ("  take key  ", "take key"),
    ("look around\n", "look around"),
    ("0", "0"),                                              # ScienceWorld disambiguation answer
    # Code blocks without an Action: marker.
    ("```\ngo north\n```", "go north"),
    ("Thought: easy.\n```text\ntake key\n```", "take key"),
    # Malformed: no action can be read.
    ("", None),
    ("   \n  ", None),
    (None, None),
    ("Thought: I am not sure what to do.", None),
    ("Thought: hmm\nAction:", None),
    ("Thought: hmm\nAction:   \n\n", None),
    ("I will go north\nthen take the key", None),            # several unmarked lines
    ("```\n```", None),                                      # empty block
    ("```\ngo north", None),                                 # unterminated block
    ("Action: ```\ngo north\ntake key\n```", None),          # multi-line action, single-line env
    ("Reaction: go north\nmore text", None),                 # 'Reaction:' is not a marker
]


@pytest.mark.parametrize("reply,expected", CASES)
def test_parse_single_line(reply, expected):
    assert parse_action(reply) == expected


CODE = "apis.spotify.login(username='a', password='b')\nprint(1)"
MULTILINE_CASES = [
    (f"I will log in.\n```python\n{CODE}\n```", CODE),
    (f"Thought: log in.\nAction:\n```python\n{CODE}\n```", CODE),
    ("```python\nprint(apis.api_docs.show_app_descriptions())\n```\nThen I will look.",
     "print(apis.api_docs.show_app_descriptions())"),
    ("I have no code for you.\nSorry.", None),
]


@pytest.mark.parametrize("reply,expected", MULTILINE_CASES)
def test_parse_multiline(reply, expected):
    assert parse_action(reply, multiline=True) == expected


def test_options_turn_off_formats():
    assert parse_action("go north", bare=False) is None
    assert parse_action("```\ngo north\n```", code_blocks=False) is None
    assert parse_action("Action: go north", bare=False, code_blocks=False) == "go north"


@pytest.mark.parametrize("family", [BuiltinEnv(), SciWorldEnv()])
def test_families_use_the_parser(family):
    assert family.parse_action("Thought: t\nAction: look around") == "look around"
    assert family.parse_action("Thought: only thinking") is None
