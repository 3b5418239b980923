"""The rollout loop on the built-in environment: token-exact trajectories (method §1)."""
import time

import jax
import numpy as np
import pytest

import models
from cope_jax.rollout.chat import ChatFormat
from cope_jax.rollout.runner import RolloutConfig, RolloutRunner, RolloutStats
from cope_jax.rollout.sampler import Sampler
from cope_jax.rollout.tokenizer import IM_END, IM_START, train_sentencepiece
from envs.pool import EnvPool
from envs.registry import make_family

FAMILY = make_family("builtin")


def _runner_parts():
    """(chat format, sampler) of a tiny random policy over a tokenizer of the built-in house."""
    tok = train_sentencepiece([FAMILY.instruction(), "Action: go north", "You see a key."] * 5, vocab_size=300)
    chat = ChatFormat(tok, "plain")
    cfg = models.QwenConfig(family="qwen3", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                            num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                            rope_theta=1e4, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    return chat, Sampler(models.create_model(cfg, seed=1), batch_size=4, max_len=1024, eos_ids=tok.eos_ids)


@pytest.fixture(scope="module")
def setup():
    chat, sampler = _runner_parts()
    with EnvPool({"builtin": 2}) as pool:
        yield chat.tokenizer, chat, sampler, pool


class Recorder:
    """Wraps a sampler and records what each generate call returned, per row, and when it ran."""

    def __init__(self, sampler):
        self.sampler, self.calls, self.events = sampler, [], []
        self.spans = []  # per generate call: (start, end, rows)
        self.handed = []  # per generate call: the requests in the order their turns were handed over
        self.in_generate = False

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def start(self, prompts, state=None, rows=None):
        self.events.append(("start", len(prompts)))
        return self.sampler.start(prompts, state, rows=rows)

    def generate(self, state, rows, *args, **kw):
        self.handed.append([])
        if kw.get("on_finish") is not None:
            on_finish = kw["on_finish"]

            def recorded(i, *a):
                self.handed[-1].append(i)
                on_finish(i, *a)
            kw["on_finish"] = recorded
        self.in_generate, t = True, time.perf_counter()
        try:
            out = self.sampler.generate(state, rows, *args, **kw)
        finally:
            self.in_generate = False
            self.spans.append((t, time.perf_counter(), len(rows)))
        self.calls.append(out)
        self.events.append(("generate", len(rows)))
        return out


def _six_episodes(setup, sync: bool):
    """(recorder, runner, tasks, trajectories, stats) of 3 groups of 2 episodes on the 4-row sampler."""
    tok, chat, sampler, pool = setup
    rec = Recorder(sampler)
    runner = RolloutRunner(rec, pool, "builtin", FAMILY, chat,
                           RolloutConfig(max_rounds=3, max_turn_tokens=6, sync=sync))
    tasks = [(t, g) for g, t in enumerate(FAMILY.task_ids("train")[:3]) for _ in range(2)]  # 6 > 4 rows
    trajs, stats = runner.run(tasks, jax.random.key(3))
    return rec, runner, tasks, trajs, stats


@pytest.mark.parametrize("sync", [False, True])
def test_occupancy_counts_each_call_and_the_tail_is_the_time_after_calls_under_half(setup, sync):
    rec, runner, tasks, trajs, stats = _six_episodes(setup, sync)
    assert stats.decode_calls == len(rec.spans) > 0
    assert stats.rows_decoded == sum(n for _, _, n in rec.spans) == sum(len(t.action_spans) for t in trajs)
    assert stats.row_capacity == 4 * len(rec.spans)
    assert stats.occupancy == pytest.approx(stats.rows_decoded / (4 * len(rec.spans)))
    # every call of fewer than 2 of the 4 rows is tail, with the time until the next call starts
    starts = [s for s, _, _ in rec.spans]
    low = [(s, nxt) for (s, _, n), nxt in zip(rec.spans, starts[1:] + [None]) if 2 * n < 4]
    inner = sum(nxt - s for s, nxt in low if nxt is not None)
    assert inner <= stats.low_occupancy_s <= stats.wall_s == stats.host_wall_s
    if low and low[-1][1] is None:  # the last call was under half: the tail runs to the rollout's end
        assert stats.low_occupancy_s >= inner + rec.spans[-1][1] - rec.spans[-1][0]

    one, alone = runner.run(tasks[:1], jax.random.key(3))
    assert alone.rows_decoded == alone.decode_calls == len(one[0].action_spans)
    assert alone.occupancy == 0.25 and 0 < alone.low_occupancy_s <= alone.wall_s  # one row of four: all tail
    both = RolloutStats.combined([stats, alone])
    assert both.wall_s == max(stats.wall_s, alone.wall_s) and both.host_wall_s == stats.wall_s + alone.wall_s
    assert both.low_occupancy_share == pytest.approx((stats.low_occupancy_s + alone.low_occupancy_s)
                                                     / (stats.wall_s + alone.wall_s))


@pytest.mark.parametrize("sync", [False, True])
def test_trajectories_hold_exactly_the_sampled_ids(setup, sync):
    tok = setup[0]
    rec, _, _, trajs, stats = _six_episodes(setup, sync)
    assert len(trajs) == 6 and stats.generated_tokens > 0
    sampled = sorted(tuple(t.tolist()) for call in rec.calls for t in call.tokens)
    in_trajs = []
    for t in trajs:
        assert t.finish_reason in ("done", "max_rounds", "context_full")
        assert t.num_steps == len(t.actions) <= 3
        # the environment's verdict on each answered action (its step info), for the forecasting filter
        assert t.rejected == [o == FAMILY.invalid_action_message for o in t.observations[1:]]
        for k, (a, b) in enumerate(t.action_spans):
            end = b + 1 if b < len(t.tokens) and t.tokens[b] == tok.token_id(IM_END) and t.action_mask[b] else b
            in_trajs.append(tuple(t.tokens[a:end].tolist()))
            # masks: exactly the sampled run is an action; nothing else in the turn is
            assert t.action_mask[a:end].all() and not t.action_mask[a - 1] and not t.obs_mask[a:end].any()
            # the sampler's logprobs are kept next to their tokens
            assert (t.sampler_logp[a:end] < 0).all()
        # observations: every obs_mask run is one observation's text, in order
        runs = np.flatnonzero(np.diff(np.concatenate([[0], t.obs_mask.astype(int), [0]])))
        texts = [tok.decode(t.tokens[s:e]) for s, e in zip(runs[::2], runs[1::2])]
        assert texts == t.observations[:len(texts)] and len(texts) >= 1
        assert texts[0].startswith("Task:")
        # everything else is chat scaffolding
        rest = tok.decode(t.tokens[~(t.action_mask | t.obs_mask)])
        assert rest.startswith(f"{IM_START}user\n{FAMILY.instruction()}{IM_END}\n{IM_START}assistant\n")
    assert sorted(in_trajs) == sampled


def test_sync_rollouts_are_reproducible(setup):
    tok, chat, sampler, pool = setup
    runner = RolloutRunner(sampler, pool, "builtin", FAMILY, chat,
                           RolloutConfig(max_rounds=3, max_turn_tokens=6, sync=True))
    tasks = [(t, g) for g, t in enumerate(FAMILY.task_ids("train")[:2]) for _ in range(3)]
    a, _ = runner.run(tasks, jax.random.key(7))
    b, _ = runner.run(tasks, jax.random.key(7))
    c, _ = runner.run(tasks, jax.random.key(8))
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))


def test_an_episode_samples_the_same_wherever_it_runs(setup):
    """Per-episode keys: a plan split in two runs (as on two hosts, with other rows and batches, the
    asynchronous schedule) plays the same episodes as the whole plan at once."""
    tok, chat, sampler, pool = setup
    runner = RolloutRunner(sampler, pool, "builtin", FAMILY, chat, RolloutConfig(max_rounds=3, max_turn_tokens=6))
    tasks = [(t, g) for g, t in enumerate(FAMILY.task_ids("train")[:3]) for _ in range(2)]
    whole, _ = runner.run(tasks, jax.random.key(5))
    first, _ = runner.run(tasks[:2], jax.random.key(5))
    second, _ = runner.run(tasks[2:], jax.random.key(5), episode_ids=range(2, 6))
    assert len({tuple(t.tokens.tolist()) for t in whole}) > 1  # the rollouts of a task differ
    for x, y in zip(whole, first + second):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.sampler_logp, y.sampler_logp, atol=1e-5)
    with pytest.raises(ValueError, match="episode_ids"):
        runner.run(tasks, jax.random.key(5), episode_ids=range(3))


def test_actions_reach_the_environment_while_longer_turns_decode(setup):
    """Streamed turns: an action is submitted as soon as its turn ends, inside the generate call that
    is still decoding the batch's longer turns, and the trajectories hold exactly what was sampled."""
    tok, chat, sampler, pool = setup
    # half the vocabulary ends a turn: turn lengths spread over 1..8 tokens
    uneven = Sampler(sampler.model, batch_size=4, max_len=1024, eos_ids=list(tok.eos_ids) + list(range(150)))
    recorder = Recorder(uneven)
    submits = []

    class Watched:
        def __getattr__(self, name):
            return getattr(pool, name)

        def submit_step(self, episode, action):
            submits.append(recorder.in_generate)
            pool.submit_step(episode, action)

    # lockstep: every call holds every live episode, so the order its turns end in is the sampled
    # lengths' alone (with asynchronous results a loaded host can split the calls into single rows)
    runner = RolloutRunner(recorder, Watched(), "builtin", FAMILY, chat,
                           RolloutConfig(max_rounds=3, max_turn_tokens=8, stream_every=1, sync=True))
    trajs, stats = runner.run([(t, 0) for t in FAMILY.task_ids("train")[:4]], jax.random.key(1))
    assert stats.env_steps == len(submits) > 0
    assert max(len(call.tokens) for call in recorder.calls) == 2  # the pool's two environments
    reordered = 0
    for call, order in zip(recorder.calls, recorder.handed):
        lengths = [len(t) for t in call.tokens]
        # turns are handed over as they end (shortest first), not when the whole call returns
        assert [lengths[i] for i in order] == sorted(lengths) and sorted(order) == list(range(len(lengths)))
        reordered += order != sorted(order)
    assert reordered > 0
    assert all(submits)  # each action went to the pool from inside the call that sampled it
    sampled = sorted(tuple(t.tolist()) for call in recorder.calls for t in call.tokens)
    in_trajs = [tuple(t.tokens[a:b + int(b < len(t.tokens) and t.action_mask[b])].tolist())  # + a sampled <|im_end|>
                for t in trajs for a, b in t.action_spans]
    assert sorted(in_trajs) == sampled


@pytest.mark.parametrize("sync", [False, True])
def test_prefetched_resets_are_picked_up_by_the_next_batch(setup, sync):
    """run(..., prefetch=next batch): the next batch's environments reset during this one; the next
    run plays them without resetting again and samples exactly what a cold run samples; a run of
    other episodes releases what was prefetched for it."""
    tok, chat, sampler, pool = setup
    resets = []

    class Counted:
        def __getattr__(self, name):
            return getattr(pool, name)

        def submit_reset(self, episode, family, task_id, max_rounds=None):
            resets.append(task_id)
            pool.submit_reset(episode, family, task_id, max_rounds=max_rounds)

    cfg = RolloutConfig(max_rounds=3, max_turn_tokens=6, sync=sync)
    runner = RolloutRunner(sampler, Counted(), "builtin", FAMILY, chat, cfg)
    ids = FAMILY.task_ids("train")
    first, second, other = [(t, 0) for t in ids[:3]], [(t, 1) for t in ids[3:9]], [(t, 2) for t in ids[9:11]]
    key = jax.random.key(4)
    runner.run(first, key, prefetch=second, prefetch_ids=range(10, 16))
    assert sorted(resets) == sorted(t for t, _ in first + second)
    resets.clear()
    warm, _ = runner.run(second, key, episode_ids=range(10, 16))
    assert resets == []  # every episode of the batch was already reset
    cold, _ = RolloutRunner(sampler, pool, "builtin", FAMILY, chat, cfg).run(second, key, episode_ids=range(10, 16))
    for a, b in zip(warm, cold):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.observations == b.observations and a.finish_reason == b.finish_reason
    # prefetched for a batch that does not come: released, and the other batch plays normally
    runner.run(first, key, prefetch=second)
    resets.clear()
    played, _ = runner.run(other, key)
    assert sorted(resets) == sorted(t for t, _ in other) and len(played) == 2
    assert all(t.finish_reason in ("done", "max_rounds") for t in played)
    again, _ = runner.run(second, key, episode_ids=range(10, 16))  # every instance is free again
    for a, b in zip(again, cold):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    runner.run(first, key, prefetch=second, prefetch_ids=range(10, 16))
    runner.cancel_prefetch()  # e.g. an evaluation needs the pool
    resets.clear()
    runner.run(second, key, episode_ids=range(10, 16))
    assert sorted(resets) == sorted(t for t, _ in second)  # reset again: nothing was kept
    with pytest.raises(ValueError, match="prefetch_ids"):
        runner.run(first, key, prefetch=second, prefetch_ids=range(2))
    with pytest.raises(ValueError, match="prefetch_ids repeat"):
        runner.run(first, key, prefetch=second[:2], prefetch_ids=[7, 7])


class OneResultPerPoll:
    """The pool, handing out its results one per poll: environment results trickling in."""

    def __init__(self, pool):
        self.pool, self.buffer = pool, []

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def poll(self, timeout=0.0):
        self.buffer = self.buffer or self.pool.poll(timeout)
        return [self.buffer.pop(0)] if self.buffer else []

    def outstanding(self):
        return self.pool.outstanding() + len(self.buffer)


def test_first_sampler_call_waits_for_the_results_that_can_join(setup):
    """Before its first generate call the runner cannot know a call's cost, so it waits for every
    reset that can still join the batch instead of decoding the first arrival alone."""
    tok, chat, sampler, pool = setup
    recorder = Recorder(sampler)
    runner = RolloutRunner(recorder, OneResultPerPoll(pool), "builtin", FAMILY, chat,
                           RolloutConfig(max_rounds=2, max_turn_tokens=4))
    trajs, _ = runner.run([(t, 0) for t in FAMILY.task_ids("train")[:2]], jax.random.key(0))
    assert len(recorder.calls[0].tokens) == 2 and len(trajs) == 2
    # each prompt was prefilled as its reset arrived, before that first call (the device prefills
    # while the loop waits for the other resets)
    assert recorder.events[:3] == [("start", 1), ("start", 1), ("generate", 2)]


def test_a_group_starts_whole_so_its_prompt_is_prefilled_once(setup):
    """Resets arriving one at a time: a group's episodes wait for each other's reset and start in
    one `start` call, where their shared prompt is one prefill."""
    tok, chat, sampler, pool = setup
    recorder = Recorder(sampler)
    runner = RolloutRunner(recorder, OneResultPerPoll(pool), "builtin", FAMILY, chat,
                           RolloutConfig(max_rounds=2, max_turn_tokens=4))
    prompts = []
    start = recorder.start
    recorder.start = lambda p, state=None, rows=None: (prompts.append(p), start(p, state, rows))[1]
    tasks = [(t, g) for g, t in enumerate(FAMILY.task_ids("train")[:2]) for _ in range(2)]
    trajs, _ = runner.run(tasks, jax.random.key(0))
    assert len(trajs) == 4
    assert [e for e in recorder.events if e[0] == "start"] == [("start", 2)] * 2
    assert all(p[0] == p[1] for p in prompts) and prompts[0][0] != prompts[1][0]


def test_expert_demonstrations_are_written_in_the_family_reply_format(setup):
    from cope_jax.run.demos import expert_trajectories

    tok, chat, sampler, pool = setup
    runner = RolloutRunner(sampler, pool, "builtin", FAMILY, chat, RolloutConfig(max_rounds=12))
    ids = FAMILY.task_ids("train")[:4]
    demos = expert_trajectories(runner, ids, max_rounds=12)
    assert len(demos) == 4 and all(d.success for d in demos)
    for d, t in zip(demos, ids):
        want = FAMILY.expert_actions(t)
        assert d.metadata["replies"] == want and d.actions == want  # bare action lines
        start, end = d.action_spans[0]
        assert tok.decode(d.tokens[start:end].tolist()) == want[0]
    react = expert_trajectories(runner, ids[:1], max_rounds=12, reply_format="Action: {action}")
    assert react[0].metadata["replies"][0] == f"Action: {FAMILY.expert_actions(ids[0])[0]}"
    assert react[0].actions == FAMILY.expert_actions(ids[0])


def test_expert_demonstrations_with_mistakes_teach_recovery_not_the_mistake(setup):
    from cope_jax.run.demos import expert_trajectories

    tok, chat, sampler, pool = setup
    runner = RolloutRunner(sampler, pool, "builtin", FAMILY, chat, RolloutConfig(max_rounds=20))
    ids = FAMILY.task_ids("train")[:8]
    demos = expert_trajectories(runner, ids, max_rounds=20, mistakes=0.5, seed=1)
    assert len(demos) == 8 and all(d.success for d in demos)
    slips = 0
    for d in demos:
        want = FAMILY.expert_actions(d.task_id)
        taken = []
        for k, (start, end) in enumerate(d.action_spans):
            if d.action_mask[start:end].any():  # an expert turn: trained on
                assert d.action_mask[start:end].all() and not d.was_rejected(k)
                taken.append(d.metadata["replies"][k])
            else:  # a broken one: context only, and the environment rejected it
                slips += 1
                assert d.observations[k + 1] == FAMILY.invalid_action_message and d.was_rejected(k)
                broken, fixed = d.metadata["replies"][k], d.metadata["replies"][k + 1]
                assert broken in (fixed.rpartition(" ")[0], f"{fixed} it")  # the next action, broken
        assert taken == want
    assert slips > 0
    # the forecasting targets are the expert's actions only (skip_invalid off, the default)
    from cope_jax.batch.forecasting import ForecastConfig, target_windows
    for d in demos:
        for targets in target_windows(d, ForecastConfig(horizon=3)):
            assert all(d.is_trained(j) for j in targets)
        assert sum(map(len, target_windows(d, ForecastConfig(horizon=3)))) > 0
    assert expert_trajectories(runner, ids, max_rounds=20, mistakes=0.5, seed=1)[0].tokens.tolist() == \
        demos[0].tokens.tolist()  # seeded


def test_dawdling_demonstrations_train_the_idle_action_within_the_round_limit(setup):
    from cope_jax.run.demos import expert_trajectories

    tok, chat, sampler, pool = setup
    runner = RolloutRunner(sampler, pool, "builtin", FAMILY, chat, RolloutConfig(max_rounds=12))
    ids = FAMILY.task_ids("train")[:8]
    demos = expert_trajectories(runner, ids, max_rounds=12, dawdle=0.6, seed=2)
    assert len(demos) == 8 and all(d.success for d in demos)
    idle = 0
    for d in demos:
        replies = d.metadata["replies"]
        assert len(replies) <= 12  # idling never costs a demonstration its success
        for start, end in d.action_spans:  # every turn is trained, the idle ones too
            assert d.action_mask[start:end].all()
        assert [r for r in replies if r != FAMILY.idle_action] == FAMILY.expert_actions(d.task_id)
        idle += replies.count(FAMILY.idle_action)
        assert FAMILY.idle_action not in FAMILY.expert_actions(d.task_id)
    assert idle > 0
    plain = expert_trajectories(runner, ids[:2], max_rounds=12, seed=2)
    assert [d.metadata["replies"] for d in plain] == [FAMILY.expert_actions(int(t)) for t in ids[:2]]

    class NoIdle(type(FAMILY)):
        idle_action = None

    with pytest.raises(ValueError, match="idle_action"):
        expert_trajectories(RolloutRunner(sampler, pool, "builtin", NoIdle(), chat, RolloutConfig(max_rounds=12)),
                            ids[:1], max_rounds=12, dawdle=0.5)


def test_length_limits_end_episodes_as_context_full(setup):
    """Tables 9-11's prompt / response limits: an episode past either ends as `context_full`, a
    failure; what it played until then is exactly what it plays without the limit (same keys)."""
    tok, chat, sampler, pool = setup
    tasks = [(t, g) for g, t in enumerate(FAMILY.task_ids("train")[:2]) for _ in range(2)]

    def play(**limits):
        cfg = RolloutConfig(max_rounds=4, max_turn_tokens=6, sync=True, **limits)
        return RolloutRunner(sampler, pool, "builtin", FAMILY, chat, cfg).run(tasks, jax.random.key(5))[0]

    free = play()
    prompts = [int(t.action_spans[0][0]) for t in free]  # instruction, o_0 and the generation prompt
    responses = [len(t) - p for t, p in zip(free, prompts)]
    cut = play(max_prompt_len=min(prompts) - 1)
    assert all(t.finish_reason == "context_full" and t.num_steps == 0 and not t.success for t in cut)
    assert [t.finish_reason for t in play(max_prompt_len=max(prompts))] == [t.finish_reason for t in free]
    n = min(responses) - 3
    for whole, short, p in zip(free, play(max_response_len=n), prompts):
        assert short.finish_reason == "context_full" and not short.success
        np.testing.assert_array_equal(short.tokens, whole.tokens[:len(short)])
        assert len(short) - p >= n and np.flatnonzero(short.action_mask).max() < p + n  # no sampled token past it
    roomy = play(max_response_len=max(responses) + 1)
    assert all(np.array_equal(a.tokens, b.tokens) and a.finish_reason == b.finish_reason for a, b in zip(roomy, free))
