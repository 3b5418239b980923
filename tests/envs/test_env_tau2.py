"""tau2-bench on the real package: id table and splits, the native tool-calling protocol, gold
replays graded by tau2's own evaluator (through the adapter and the pool), and the users."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from envs.pool import EnvPool
from envs.tau2 import (BAD_TOOL_CALL, DOMAINS, POOL, SPLIT_IDS, Tau2Env, gold_replies, load_table,
                       tau2_registry, tool_call_text)

SIZES = {"retail": (74, 40), "airline": (30, 20), "telecom": (74, 40)}
# Policy length (characters) and number of tools per domain, as measured in the paper (C.5.1).
PAPER_PROMPTS = {"retail": (6699, 15), "airline": (7676, 14), "telecom": (23318, 13)}


def loader_table() -> dict[str, dict[str, list]]:
    """The id table computed from the package's own task loaders (what `envs/tau2.py` ships
    precomputed; this recomputes it)."""
    out = {}
    for domain in DOMAINS:
        load = tau2_registry().get_tasks_loader(domain)
        test = {t.id for t in load("test")}
        train = {t.id for t in load("train")}
        ids = [t.id for t in load("base")]
        if set(ids) != test | train or test & train:
            raise ValueError(f"tau2 {domain}: train/test do not partition base")
        out[domain] = {"ids": ids, "test": [i in test for i in ids]}
    return out


def _test_ids(domain, k):
    return [i for i in SPLIT_IDS["test"] if POOL[i][0] == domain][:k]


def _play(env, task_id, replies, max_rounds=50):
    obs, info = env.reset(task_id, max_rounds=max_rounds)
    steps = [(obs, 0.0, False, info)]
    for reply in replies:
        steps.append(env.step(env.parse_action(reply)))
        if steps[-1][2]:
            break
    return steps


@pytest.fixture(scope="module")
def env():
    e = Tau2Env()
    yield e
    e.close()


def test_id_table_is_the_packages_loaders_and_splits():
    assert load_table() == loader_table()
    fam = Tau2Env()
    train, test = fam.task_ids("train"), fam.task_ids("test")
    assert (len(train), len(test), fam.num_tasks()) == (178, 100, 278)
    assert not set(train) & set(test)
    for domain, (n_train, n_test) in SIZES.items():
        assert sum(fam.task_family(i) == domain for i in train) == n_train
        assert sum(fam.task_family(i) == domain for i in test) == n_test
    # positional across retail, airline, telecom, in that order
    assert [fam.task_family(i) for i in (0, 113, 114, 163, 164, 277)] == \
        ["retail", "retail", "airline", "airline", "telecom", "telecom"]


def test_system_prompt_and_tools_are_the_domains_own(env):
    for domain, (policy_chars, n_tools) in PAPER_PROMPTS.items():
        tid = _test_ids(domain, 1)[0]
        system, tools = env.system_prompt(tid), env.tools(tid)
        policy = system.split("<policy>\n", 1)[1].rsplit("\n</policy>", 1)[0]
        assert len(policy) == policy_chars and len(tools) == n_tools, domain
        assert system.startswith("You are a customer service agent")
        assert all(t["type"] == "function" and t["function"]["name"] for t in tools)
        assert "done" not in {t["function"]["name"] for t in tools}
    assert env.chat_layout == "tool_calling"


def test_parse_action_takes_the_first_tool_call_verbatim():
    fam = Tau2Env()
    a = tool_call_text("get_user_details", {"user_id": "u1"})
    b = tool_call_text("calculate", {"expression": "1+1"})
    assert fam.parse_action(f"Let me look.\n{a}\n{b}<|im_end|>") == a
    assert fam.parse_action("  Sure, what is your email?  ") == "Sure, what is your email?"
    assert fam.parse_action("") is None and fam.parse_action("<|im_end|>") is None
    assert fam.parse_action('x <tool_call>{"name": "f"') == '<tool_call>{"name": "f"'


def test_gold_replay_gives_y1_in_every_domain(env):
    for domain in DOMAINS:
        for tid in _test_ids(domain, 2):
            steps = _play(env, tid, gold_replies(env.load_task(tid)))
            obs, score, done, info = steps[-1]
            assert done and score == 1.0 and env.success(score, done, info), (domain, tid, info)
            assert info["termination"] == "user_stop"
    # observations carry their chat role: tool results after calls, customer text otherwise
    tid = _test_ids("retail", 1)[0]
    steps = _play(env, tid, gold_replies(env.load_task(tid)))
    assert steps[0][3]["role"] == "user" and steps[1][3]["role"] == "tool"
    user_id = steps[1][0]  # real tool results: the id lookup, then that user's record
    assert json.loads(steps[2][0])["user_id"] == user_id


def test_doing_nothing_on_a_database_task_gives_y0(env):
    tid = _test_ids("retail", 1)[0]
    task = env.load_task(tid)
    assert {"DB"} <= {b.value for b in task.evaluation_criteria.reward_basis}
    assert any(a.name.startswith(("return_", "exchange_", "modify_", "cancel_"))
               for a in task.evaluation_criteria.actions)
    obs, score, done, info = _play(env, tid, ["Sorry, I cannot help with that."])[-1]
    assert done and info["termination"] == "user_stop" and score == 0.0
    assert not env.success(score, done, info)


def test_bad_tool_call_costs_a_round_and_the_cap_scores_zero(env):
    tid = _test_ids("airline", 1)[0]
    env.reset(tid, max_rounds=3)
    obs, score, done, info = env.step(env.parse_action('<tool_call>{"name": "get_user_details", '
                                                       '"arguments": {"user_id": }</tool_call>'))
    assert obs == BAD_TOOL_CALL.format(reason="JSON error: Expecting value")
    assert info["role"] == "tool"
    assert info["invalid"] and not done and info["rounds"] == 1
    obs, score, done, info = env.step(None)
    assert info["invalid"] and not done
    obs, score, done, info = env.step(env.parse_action(tool_call_text("no_such_tool", {})))
    assert done and info["truncated"] and not env.success(score, done, info)


def test_gold_replay_through_the_pool():
    fam = Tau2Env()
    ids = [i for d in DOMAINS for i in _test_ids(d, 1)]
    with EnvPool({"tau2": 2}) as pool:
        scripts = {tid: gold_replies(fam.load_task(tid)) for tid in ids}
        for tid in ids:
            pool.submit_reset(tid, "tau2", tid, max_rounds=50)
        finals, deadline = {}, time.monotonic() + 180
        while len(finals) < len(ids) and time.monotonic() < deadline:
            for r in pool.poll(timeout=30):
                assert r.ok, r.reason
                if r.kind == "reset":
                    assert r.info["system"] and r.info["tools"] and r.info["role"] == "user"
                if r.done:
                    finals[r.env_key] = r
                else:
                    pool.submit_step(r.env_key, fam.parse_action(scripts[r.env_key].pop(0)))
    assert set(finals) == set(ids)
    assert all(r.success and r.score == 1.0 for r in finals.values())
    assert {fam.task_family(t) for t in finals} == set(DOMAINS)


class _FakeOpenAI(BaseHTTPRequestHandler):
    """A loopback OpenAI-compatible endpoint standing in for the LLM customer."""
    requests: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        n_user_turns = sum(m["role"] == "assistant" for m in body["messages"])
        content = "Hi, I want to cancel my order." if n_user_turns == 0 else "###STOP###"
        out = {"choices": [{"message": {"role": "assistant", "content": content}}]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_llm_user_over_an_openai_compatible_endpoint():
    server = HTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        fam = Tau2Env(user={"kind": "llm", "base_url": url, "model": "sim", "api_key_env": None})
        tid = _test_ids("retail", 1)[0]
        obs, info = fam.reset(tid)
        assert obs == "Hi, I want to cancel my order." and info["role"] == "user"
        obs, score, done, info = fam.step("Could you give me your order id?")
        assert done and info["termination"] == "user_stop" and score == 0.0
        first = _FakeOpenAI.requests[0]
        # tau2's own user prompt: simulation guidelines plus this task's scenario
        assert first["messages"][0]["role"] == "system"
        assert str(fam.load_task(tid).user_scenario.instructions.reason_for_call)[:40] \
            in first["messages"][0]["content"]
        assert first["model"] == "sim" and first["temperature"] == 0.7
    finally:
        server.shutdown()


def test_scripted_user_kind():
    fam = Tau2Env(user={"kind": "scripted", "turns": [{"content": "Hello there."},
                                                       {"content": "###TRANSFER###"}]})
    obs, info = fam.reset(_test_ids("airline", 1)[0])
    assert obs == "Hello there."
    obs, score, done, info = fam.step("Let me transfer you.")
    assert done and obs == "###TRANSFER###" and info["termination"] == "user_stop"


def test_native_chat_layout_renders_policy_tools_and_tool_responses(env):
    """The rollout's chat format (Qwen2.5 template) on what the family exposes (appendix C.5)."""
    from cope_jax.rollout.chat import ChatFormat
    from cope_jax.rollout.tokenizer import load_tokenizer
    tokenizer = load_tokenizer("qwen")
    chat = ChatFormat(tokenizer, "qwen2.5")
    tid = _test_ids("retail", 1)[0]
    reply = gold_replies(env.load_task(tid))[0]
    steps = _play(env, tid, [reply])
    (first, _, _, info0), (result, _, _, info1) = steps
    messages = [{"role": "system", "content": env.system_prompt(tid)},
                {"role": info0["role"], "content": first},
                {"role": "assistant", "content": env.parse_action(reply)},
                {"role": info1["role"], "content": result}]
    text = tokenizer.decode(chat.render(messages, tools=env.tools(tid)))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a customer service agent")
    assert "</policy>\n\n# Tools\n\nYou may call one or more functions" in system
    assert system.count('{"type": "function"') == len(env.tools(tid)) == 15
    assert "<|im_start|>assistant" not in text.split(first)[0]  # no acknowledgement turn
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>" in text


CLOSINGS = ("Thank you.", "Is there anything else")  # how `gold_replies` ends


class _Customer(BaseHTTPRequestHandler):
    """A loopback OpenAI chat-completions server playing a customer over several turns: it asks for
    help, agrees while the agent works, and stops after the agent's closing message (`CLOSINGS`).
    `delay`: seconds before each answer."""
    requests: list = []
    delay = 0.0

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        time.sleep(type(self).delay)
        # the customer's own turns are 'assistant' messages in its chat, the agent's are 'user'
        agent = [m for m in body["messages"] if m["role"] == "user"]
        if not any(m["role"] == "assistant" for m in body["messages"]):
            content = "Hi, I need help with my account."
        elif agent and str(agent[-1].get("content", "")).startswith(CLOSINGS):
            content = "###STOP###"
        else:
            content = "Yes, please go ahead."
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def customer():
    server = HTTPServer(("127.0.0.1", 0), _Customer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Customer.requests, _Customer.delay = [], 0.0
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _configured_pool(url, **env):
    """The pool a tau2 run starts, from `configs/tau2.py` with the customer's endpoint set."""
    from configs import tau2
    from cope_jax.run import build

    c = tau2.get_config("cope")
    c.env.update(workers=1, **env)
    c.env.user.update(base_url=url, model="customer-sim")
    return build._pool(c, 1, build._user(c))


def test_an_llm_customer_over_http_talks_several_turns_and_tau2_grades_the_episode(customer):
    fam = Tau2Env()
    tid = _test_ids("retail", 1)[0]
    # a question first (the customer answers it), then the gold actions and the closing message
    replies = ["Before I start: could you confirm what you need?"] + gold_replies(fam.load_task(tid))
    with _configured_pool(customer) as pool:
        pool.submit_reset(0, "tau2", tid, max_rounds=50)
        (r,) = pool.wait_all(timeout=120)
        assert r.ok and r.info["role"] == "user" and r.observation == "Hi, I need help with my account."
        while not r.done:
            pool.submit_step(0, fam.parse_action(replies.pop(0)))
            (r,) = pool.wait_all(timeout=120)
            assert r.ok, r.reason
    customer_turns = len(_Customer.requests)
    assert customer_turns >= 3 and r.info["termination"] == "user_stop"
    assert r.success and r.score == 1.0  # tau2's evaluator: the gold actions' database, info communicated
    first = _Customer.requests[0]
    assert first["model"] == "customer-sim" and first["temperature"] == 0.7  # the paper's customer


def test_a_slow_customer_fails_its_episode_not_the_worker(customer):
    """The customer's calls share 80% of the step's deadline: a customer slower than that ends the
    episode as an environment error before the pool would kill the worker as hung."""
    tid = _test_ids("airline", 1)[0]
    with _configured_pool(customer, call_timeout=2.5) as pool:
        def reset(episode):
            pool.submit_reset(episode, "tau2", tid, max_rounds=50)
            (r,) = pool.wait_all(timeout=60)
            pool.release(episode)
            return r

        assert reset(0).ok  # tau2's imports happened at the worker's start (Tau2Env.warm_up)
        pid = pool.worker_pids("tau2")
        _Customer.delay = 3.0
        r = reset(1)
        assert not r.ok and r.error == "env_error" and "timed out" in r.reason, r.reason
        _Customer.delay = 0.0
        assert reset(2).ok and pool.worker_pids("tau2") == pid  # the same worker answered
