"""Forecasting / success-filtered imitation examples (method §3), table-driven."""
import numpy as np
import pytest

from cope_jax.rollout.chat import ChatFormat
from cope_jax.batch.forecasting import (NEXT_ACTION, PLAN_REQUEST, ForecastConfig, build_examples, history_prefix,
                                  target_windows)
from cope_jax.rollout.tokenizer import IM_END, load_tokenizer
from cope_jax.rollout.trajectory import Trajectory

TOK = load_tokenizer("qwen2.5")
CHAT = ChatFormat(TOK, "plain")
INVALID = "Nothing happens."


def episode(actions, observations=None, success=True, group=0, replies=None, obs_role="user", rejected=()):
    """A trajectory laid out as the rollout lays it out; replies default to ReAct text; `rejected`:
    the steps whose action the environment rejected."""
    observations = observations or [f"obs {i}" for i in range(len(actions) + 1)]
    replies = replies or [f"Thought: step {i}.\nAction: {a}" if a else "I am confused" for i, a in enumerate(actions)]
    ids, amask, omask, aspans, ospans = [], [], [], [], []

    def add(seq, a=False, o=False):
        ids.extend(seq)
        amask.extend([a] * len(seq))
        omask.extend([o] * len(seq))

    add(CHAT.turn("user", "Standing instruction.").ids)
    add(CHAT.turn("assistant", "OK.").ids)
    for i, reply in enumerate(replies + [None]):
        turn = CHAT.turn(obs_role, observations[i])
        add(turn.ids[:turn.content_start])
        ospans.append((len(ids), len(ids) + turn.content_end - turn.content_start))
        add(turn.ids[turn.content_start:turn.content_end], o=True)
        add(turn.ids[turn.content_end:])
        if reply is None:
            break
        add(CHAT.generation_prompt())
        sampled = TOK.encode(reply) + [TOK.token_id(IM_END)]
        aspans.append((len(ids), len(ids) + len(sampled) - 1))
        add(sampled, a=True)
        add(CHAT.end_of_turn())
    return Trajectory(tokens=ids, action_mask=amask, obs_mask=omask, action_spans=aspans,
                      observation_spans=ospans, actions=list(actions), observations=observations,
                      rejected=[j in rejected for j in range(len(actions))], success=success, group_id=group)


def target_texts(example):
    """Decoded target runs (contiguous target_mask segments)."""
    runs, cur = [], []
    for tok, m in zip(example.tokens, example.target_mask):
        if m:
            cur.append(int(tok))
        elif cur:
            runs.append(TOK.decode(cur))
            cur = []
    if cur:
        runs.append(TOK.decode(cur))
    return runs


ACTIONS = ["go north", "take key", "go south", "open door", "go east"]


@pytest.mark.parametrize("K,t,expected", [
    (0, 0, ["go north"]),
    (0, 4, ["go east"]),
    (1, 0, ["go north", "take key"]),
    (2, 1, ["take key", "go south", "open door"]),
    (2, 3, ["open door", "go east"]),          # clamped at the episode end, never padded
    (4, 0, ACTIONS),
    (4, 2, ["go south", "open door", "go east"]),
])
def test_react_targets_and_clamping(K, t, expected):
    examples = build_examples([episode(ACTIONS)], CHAT, ForecastConfig(horizon=K))
    assert [e.step for e in examples] == list(range(5))
    ex = examples[t]
    assert target_texts(ex) == ["\n".join(expected) + IM_END]
    text = TOK.decode(ex.tokens)
    assert PLAN_REQUEST["react"].format(k=len(expected)) in text
    # history: exactly the recorded prefix up to and including o_t, then the planning request turn
    traj = episode(ACTIONS)
    prefix = history_prefix(traj, t, CHAT)
    np.testing.assert_array_equal(ex.tokens[:len(prefix)], prefix)
    assert TOK.decode(prefix).endswith(f"obs {t}{IM_END}\n")
    assert not ex.target_mask[:len(prefix)].any()
    assert ex.prefix_len == len(prefix)  # what the train step packs once per episode


def test_loss_only_on_the_target_turn():
    ex = build_examples([episode(ACTIONS)], CHAT, ForecastConfig(horizon=2))[1]
    idx = np.flatnonzero(ex.target_mask)
    assert idx.max() - idx.min() + 1 == len(idx)  # one contiguous run
    gen = CHAT.generation_prompt()
    np.testing.assert_array_equal(ex.tokens[idx.min() - len(gen):idx.min()], gen)
    assert ex.tokens[idx.max()] == TOK.token_id(IM_END)
    assert ex.tokens[idx.max() + 1:].tolist() == CHAT.end_of_turn()


def test_weights_follow_group_successes():
    trajs = ([episode(ACTIONS[:2], group=0, success=False)] +            # 0 successes: no examples
             [episode(ACTIONS[:2], group=1, success=True)] +             # 1 success: weight 1
             [episode(ACTIONS[:2], group=2, success=s) for s in (True, True, True, False)])
    examples = build_examples(trajs, CHAT, ForecastConfig(horizon=2))
    weights = {}
    for e in examples:
        weights.setdefault(e.group_id, set()).add(e.weight)
    assert weights == {1: {1.0}, 2: {1 / 3}}
    assert sorted({e.source for e in examples}) == [1, 2, 3, 4]


def test_unparseable_and_invalid_actions():
    acts = ["go north", None, "take key", "go west", "open door"]
    obs = ["o0", "o1", INVALID, "o3", INVALID, "o5"]
    plain = build_examples([episode(acts, obs, rejected=(1, 3))], CHAT, ForecastConfig(horizon=2))
    assert [e.step for e in plain] == [0, 2, 3, 4]  # without the filter a rejected action is a target
    assert target_texts(plain[0]) == ["go north\ntake key" + IM_END]


def _windows(actions, rejected, horizon, kind="forecast"):
    traj = episode(actions, rejected=rejected)
    return target_windows(traj, ForecastConfig(kind=kind, horizon=horizon, skip_invalid=True))


def test_rejected_targets_are_refilled_with_the_next_valid_action():
    """method §3.4 / the paper's section 8: each rejected target is replaced by the next valid action of the episode;
    a step whose own action was rejected keeps its example with the refilled target."""
    acts = ["go north", "fly", "take key", "go south", "dance"]  # a_1 and a_4 (the last) rejected
    # K=0: the rejected a_1 -> a_2; the rejected last action has no valid action after it
    assert _windows(acts, (1, 4), 0) == [[0], [2], [2], [3], []]
    # K=1: windows keep two targets where the episode has them, skipping the rejected a_1
    assert _windows(acts, (1, 4), 1) == [[0, 2], [2, 3], [2, 3], [3], []]
    # unparseable (None) and rejected alike; sft targets the step's own turn: rejected steps dropped
    assert _windows(["go north", None, "take key"], (1,), 0) == [[0], [2], [2]]
    assert _windows(acts, (1, 4), 0, kind="sft") == [[0], [], [2], [3], []]
    # what the examples say: step 1's example forecasts "take key" from the history up to o_1
    ex = build_examples([episode(acts, rejected=(1, 4))], CHAT, ForecastConfig(horizon=1, skip_invalid=True))
    assert [e.step for e in ex] == [0, 1, 2, 3]
    assert target_texts(ex[1]) == ["take key\ngo south" + IM_END]
    assert "fly" not in TOK.decode(ex[1].tokens[ex[1].prefix_len:])


def test_sft_success_targets_the_sampled_turn():
    traj = episode(ACTIONS[:3])
    examples = build_examples([traj], CHAT, ForecastConfig(kind="sft", horizon=0))
    assert len(examples) == 3
    ex = examples[1]
    start, end = traj.action_spans[1]
    np.testing.assert_array_equal(ex.tokens[:end + 1], traj.tokens[:end + 1])  # exact sampled ids
    assert target_texts(ex) == ["Thought: step 1.\nAction: take key" + IM_END]
    assert "Plan ahead" not in TOK.decode(ex.tokens)


TAU2_ACTIONS = ['<tool_call>\n{"name": "find_user", "arguments": {"email": "a@b.c"}}\n</tool_call>',
                "Could you confirm the order id?",
                '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>',
                "Your order has shipped."]


def test_tau2_multi_turn_targets():
    traj = episode(TAU2_ACTIONS, observations=["hi, I need help"] + ["result"] * 4, replies=TAU2_ACTIONS)
    examples = build_examples([traj], CHAT, ForecastConfig(layout="tool_calling", horizon=2))
    ex = examples[0]
    assert target_texts(ex) == [a + IM_END for a in TAU2_ACTIONS[:3]]
    text = TOK.decode(ex.tokens)
    assert PLAN_REQUEST["tool_calling"].format(k=3) in text
    assert text.count(NEXT_ACTION) == 2
    # the inserted "Next action?" turns carry no loss
    for run in target_texts(ex):
        assert NEXT_ACTION not in run


def test_tau2_skip_no_call():
    traj = episode(TAU2_ACTIONS, observations=["hi"] + ["r"] * 4, replies=TAU2_ACTIONS)
    cfg = ForecastConfig(layout="tool_calling", horizon=0, skip_no_call=True)
    assert [e.step for e in build_examples([traj], CHAT, cfg)] == [0, 2]
    # K=1: window [3] is a reply only -> dropped; windows with one call survive
    cfg = ForecastConfig(layout="tool_calling", horizon=1, skip_no_call=True)
    assert [e.step for e in build_examples([traj], CHAT, cfg)] == [0, 1, 2]


def test_config_errors():
    with pytest.raises(ValueError, match="kind"):
        ForecastConfig(kind="dream")
    with pytest.raises(ValueError, match="horizon"):
        ForecastConfig(horizon=-1)


def test_without_group_normalization_every_example_weighs_one():
    trajs = [episode(ACTIONS[:2], group=2, success=s) for s in (True, True, True, False)]
    normalized = build_examples(trajs, CHAT, ForecastConfig(horizon=1))
    plain = build_examples(trajs, CHAT, ForecastConfig(horizon=1, group_normalized=False))
    assert {e.weight for e in normalized} == {1 / 3} and {e.weight for e in plain} == {1.0}
    assert [e.tokens.tolist() for e in normalized] == [e.tokens.tolist() for e in plain]
