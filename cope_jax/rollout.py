"""The host-side rollout loop: sampler turns and asynchronous environment steps, as token ids.

For a batch of (task, group) pairs, episodes are reset in the environment pool and started in
sampler rows as their first observation arrives. Each iteration generates one assistant turn for
*every* episode that is waiting for one (a single batched sampler call), submits each parsed
action to the pool as soon as its turn ends (turns are streamed out of the call while longer ones
still decode), and appends each returned observation to its row (prefilling only the new tokens).
Environment workers step in their own processes while the sampler decodes the other episodes, so
environment time overlaps with decoding. More episodes than sampler rows is fine: an
episode waits for a free row.

Token layout of an episode (SPEC 1), `P = <|im_start|>assistant\\n`:
    [user: instruction] [assistant: acknowledgement] [user: o_0] P a_0 <|im_end|> \\n [user: o_1] P a_1 ...
(a tool-calling family instead opens with its system message with the tools block, and its tool
results are `tool` turns). Assistant content tokens are the sampler's ids; observations are
encoded once when appended. An episode ends when the environment says done (max rounds is the
environment's step cap), when its row would overflow (`context_full`), or on an environment fault.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from cope_jax.chat import ChatFormat, Turn
from cope_jax.sampler import Sampler, SamplerState
from cope_jax.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_rounds: int = 20  # environment steps per episode
    max_turn_tokens: int = 512  # generation cap per assistant turn
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    poll_interval: float = 0.002  # seconds to wait for the environment when nothing can decode
    # asynchronous rounds: an episode ready to decode waits up to this fraction of a typical
    # generate call for environment results still in flight to join its batch; a sampler call
    # costs nearly the same for 1 row as for many, so a straggler decoded alone costs a whole
    # call: waiting up to one call's time for it is the break-even point. Before the runner's
    # first call (cost unknown) it waits for every result that can join.
    batch_wait: float = 1.0
    # lockstep rounds: wait for every in-flight environment call and handle results in episode
    # order before decoding, so the schedule (hence sampler batches) does not depend on timing and
    # rollouts are bit-reproducible; gives up overlapping environment steps with decoding
    sync: bool = False
    # streaming: finished turns are handed to the pool every this many decode steps (a host sync
    # per chunk: small next to the steps themselves)
    stream_every: int = 16


@dataclasses.dataclass
class RolloutStats:
    """Wall time split of one rollout batch (the overlap benchmark reads it)."""

    wall_s: float = 0.0
    sample_s: float = 0.0  # inside sampler calls (start / extend / generate)
    env_wait_s: float = 0.0  # blocked waiting on the pool with nothing to decode
    env_busy_s: float = 0.0  # sum of environment call durations (worker side, may overlap)
    generated_tokens: int = 0
    env_steps: int = 0
    sampler_calls: int = 0

    @classmethod
    def combined(cls, parts: Sequence["RolloutStats"]) -> "RolloutStats":
        """Stats of rollouts run side by side (one per host): counts and busy times add up, the
        wall time is the slowest one's."""
        out = cls(**{f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(cls)})
        out.wall_s = max((p.wall_s for p in parts), default=0.0)
        return out


@dataclasses.dataclass
class _Episode:
    index: int
    task_id: int
    group_id: int
    uid: int = 0  # names the episode's randomness (see RolloutRunner.run)
    row: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[bool] = dataclasses.field(default_factory=list)
    obs_mask: list[bool] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    action_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    obs_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    actions: list[str | None] = dataclasses.field(default_factory=list)
    replies: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)  # ids not yet given to the sampler
    score: float = 0.0
    success: bool = False
    family: str = ""
    finish_reason: str = ""
    env_info: dict = dataclasses.field(default_factory=dict)
    done: bool = False
    env_key: object = None  # the pool's episode key
    in_env: bool = False  # a reset or step of this episode is at the pool

    def add(self, ids: Sequence[int], *, action=False, obs=False, logp=None) -> tuple[int, int]:
        start = len(self.tokens)
        self.tokens.extend(int(i) for i in ids)
        self.action_mask.extend([action] * len(ids))
        self.obs_mask.extend([obs] * len(ids))
        self.logp.extend([0.0] * len(ids) if logp is None else [float(x) for x in logp])
        self.pending.extend(int(i) for i in ids)
        return start, len(self.tokens)

    def add_turn(self, turn: Turn, *, obs: bool) -> None:
        self.add(turn.ids[:turn.content_start])
        span = self.add(turn.ids[turn.content_start:turn.content_end], obs=obs)
        if obs:
            self.obs_spans.append(span)
        self.add(turn.ids[turn.content_end:])


class RolloutRunner:
    """Runs batches of episodes of one environment family with one sampler and one pool."""

    def __init__(self, sampler: Sampler, pool, family_name: str, family, chat: ChatFormat,
                 cfg: RolloutConfig):
        self.sampler, self.pool, self.family_name, self.family = sampler, pool, family_name, family
        self.chat, self.cfg = chat, cfg
        self.im_end = chat.im_end_id
        self._gen_prompt = chat.generation_prompt()
        self._preambles: dict[int, list[Turn]] = {}
        self._generate_s = 0.0  # running mean of a generate call's time (0: none yet)
        self._ahead: dict[tuple[int, int, int], object] = {}  # prefetched (task, group, id) -> env key
        self._early: dict[object, object] = {}  # env key -> its reset result, arrived before its run

    def preamble(self, task_id: int) -> list[Turn]:
        """Turns before o_0: instruction + acknowledgement (ReAct), or the system message with the
        native tools block (a 'tool_calling' family, e.g. tau2's per-domain policy and tools)."""
        if task_id not in self._preambles:
            fam, chat = self.family, self.chat
            if getattr(fam, "chat_layout", "react") == "tool_calling":
                system = fam.system_prompt(task_id)
                messages = [] if system is None else [{"role": "system", "content": system}]
                turns = chat.turns(messages, tools=fam.tools(task_id))
            else:
                turns = [] if chat.style.default_system is None else [
                    chat.turn("system", chat.style.default_system)]
                turns += [chat.turn("user", fam.instruction()), chat.turn("assistant", fam.acknowledgement())]
            self._preambles[task_id] = turns
        return self._preambles[task_id]

    def _observation_turn(self, text: str, info: dict) -> Turn:
        role = info.get("role", "user")
        if role == "tool":
            return self.chat.turns([{"role": "tool", "content": text}])[0]
        return self.chat.turn(role, text)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, tasks: Sequence[tuple[int, int]], key: jax.Array, *,
            episode_ids: Sequence[int] | None = None, prefetch: Sequence[tuple[int, int]] = (),
            prefetch_ids: Sequence[int] | None = None, on_progress: Callable[[int], None] | None = None
            ) -> tuple[list[Trajectory], RolloutStats]:
        """Plays one episode per (task_id, group_id); returns trajectories in input order.

        Turn j of episode i samples with fold_in(fold_in(key, episode_ids[i]), j) (default ids:
        0, 1, ...), so an episode's tokens do not depend on the sampler row or batch it runs in,
        nor on which host of a multi-host run plays it.

        prefetch: the next batch's (task_id, group_id) pairs (ids `prefetch_ids`, default 0, 1, ...).
        Their resets are submitted behind this batch's, so their environments reset while this batch
        decodes and while the caller trains on it; the next run of this runner picks up the
        episodes it plays again (same task, group and id) with their first observation ready and
        releases the others. Until then the pool must serve no other runner.

        on_progress(ended): called as episodes end, with how many have (a progress bar's hook).
        """
        cfg, sampler = self.cfg, self.sampler
        stats = RolloutStats()
        t_start = time.perf_counter()
        state = sampler.init_state()
        uids = range(len(tasks)) if episode_ids is None else [int(u) for u in episode_ids]
        if len(uids) != len(tasks):
            raise ValueError(f"{len(uids)} episode_ids for {len(tasks)} episodes")
        ahead_ids = range(len(prefetch)) if prefetch_ids is None else [int(u) for u in prefetch_ids]
        if len(ahead_ids) != len(prefetch):
            raise ValueError(f"{len(ahead_ids)} prefetch_ids for {len(prefetch)} episodes")
        if len(set(ahead_ids)) != len(ahead_ids):
            raise ValueError("prefetch_ids repeat an id")
        episodes = [_Episode(i, int(t), int(g), uid=u, family=self.family_name)
                    for i, ((t, g), u) in enumerate(zip(tasks, uids))]
        ids = {}
        early = []  # first observations of prefetched episodes that arrived before this run
        for ep in episodes:
            ep.env_key = self._ahead.pop((ep.task_id, ep.group_id, ep.uid), None)
            ep.in_env = True
            if ep.env_key is None:
                ep.env_key = (id(self), ep.index, time.perf_counter_ns())
                self.pool.submit_reset(ep.env_key, self.family_name, ep.task_id, max_steps=cfg.max_rounds)
            elif ep.env_key in self._early:
                early.append(self._early.pop(ep.env_key))
            ids[ep.env_key] = ep
        self.cancel_prefetch()  # what is left was prefetched for a batch that did not come
        for (t, g), u in zip(prefetch, ahead_ids):  # the next batch's resets
            env_key = (id(self), "ahead", u, time.perf_counter_ns())
            self._ahead[(int(t), int(g), u)] = env_key
            self.pool.submit_reset(env_key, self.family_name, int(t), max_steps=cfg.max_rounds)
        upcoming = set(self._ahead.values())
        need_row: list[_Episode] = []  # got o_0, waiting for a sampler row
        ready: list[_Episode] = []  # row holds everything up to a generation prompt
        live = len(episodes)
        hold = 0.0  # seconds the ready episodes still wait for results to join their batch
        ready_since = None
        try:
            while live:
                if on_progress is not None:
                    on_progress(len(episodes) - live)  # episodes ended so far (a progress bar)
                t0 = time.perf_counter()
                if cfg.sync:
                    results = self.pool.wait_all()
                else:
                    results = self.pool.poll(0.0)
                    if not results and self.pool.pending() and (hold > 0 or not (ready or need_row)):
                        results = self.pool.poll(min(hold, 1.0) if hold > 0 else cfg.poll_interval)
                for r in [r for r in results if r.episode in upcoming]:
                    self._early[r.episode] = r
                results = early + [r for r in results if r.episode not in upcoming]
                early = []
                if cfg.sync:
                    results.sort(key=lambda r: ids[r.episode].index)
                stats.env_wait_s += time.perf_counter() - t0
                for r in results:
                    ep = ids[r.episode]
                    ep.in_env = False
                    stats.env_busy_s += r.elapsed
                    stats.env_steps += r.kind == "step"
                    live -= self._on_env_result(ep, r, state, need_row, ready)
                if need_row and not cfg.sync:
                    # prefill new episodes' prompts as their resets arrive: the call returns at once
                    # (asynchronous dispatch), so the device prefills while the loop waits for the
                    # other resets (observation turns are short: they stay batched)
                    self._assign_rows(state, need_row, ready, stats)
                if not cfg.sync and (ready or need_row):
                    # hold the sampler calls (prefills included) while results can still join
                    ready_since = ready_since or time.perf_counter()
                    wait = cfg.batch_wait * self._generate_s if self._generate_s else float("inf")
                    hold = ready_since + wait - time.perf_counter()
                    if hold > 0 and self._can_join(episodes, len(state.free_rows()) - len(need_row)):
                        continue
                hold, ready_since = 0.0, None
                self._assign_rows(state, need_row, ready, stats)
                self._flush_pending(state, ready, stats)
                ended = [ep for ep in ready if ep.done]
                for ep in ended:
                    ready.remove(ep)
                    self._finish(ep, state)
                    live -= 1
                if ready:
                    t_gen = time.perf_counter()
                    live -= self._generate(state, ready, key, stats)
                    took = time.perf_counter() - t_gen
                    self._generate_s = took if not self._generate_s else 0.8 * self._generate_s + 0.2 * took
                    ready.clear()
            if on_progress is not None:
                on_progress(len(episodes))
        except BaseException:
            self.cancel_prefetch()  # the next batch may not come
            raise
        finally:
            for ep in episodes:
                if not ep.done or ep.row is not None:
                    self._abandon(ep, state)
        stats.wall_s = time.perf_counter() - t_start
        return [self._trajectory(ep) for ep in episodes], stats

    def cancel_prefetch(self) -> None:
        """Releases the environments prefetched for a next run (e.g. before another runner uses the
        pool)."""
        for env_key in self._ahead.values():
            self.pool.release(env_key)
            self._early.pop(env_key, None)
        self._ahead = {}

    def _on_env_result(self, ep: _Episode, r, state, need_row, ready) -> int:
        """Records a reset/step result; returns 1 if the episode ended."""
        if not r.ok:
            ep.finish_reason = f"env_{r.error}"
            ep.env_info = {"error": r.error, "reason": r.reason, "worker_pid": r.worker_pid}
            ep.score, ep.success = float(r.score), False
            return self._end(ep, state)
        ep.observations.append(r.observation)
        ep.score = float(r.score)
        if r.kind == "reset":
            for turn in self.preamble(ep.task_id):
                ep.add_turn(turn, obs=False)
        if r.done:
            ep.success = bool(r.success)
            ep.finish_reason = "max_rounds" if r.info.get("truncated") else "done"
            ep.env_info = dict(r.info)
            return self._end(ep, state)
        ep.add_turn(self._observation_turn(r.observation, r.info), obs=True)
        ep.add(self._gen_prompt)
        (need_row if ep.row is None else ready).append(ep)
        return 0

    def _assign_rows(self, state: SamplerState, need_row: list, ready: list, stats: RolloutStats) -> None:
        free = state.free_rows()
        starting = need_row[:len(free)]
        if not starting:
            return
        del need_row[:len(starting)]
        t0 = time.perf_counter()
        rows = free[:len(starting)]
        self.sampler.start([ep.pending for ep in starting], state, rows=rows)
        stats.sample_s += time.perf_counter() - t0
        stats.sampler_calls += 1
        for ep, row in zip(starting, rows):
            ep.row, ep.pending = row, []
            if state.full[row]:
                ep.finish_reason = "context_full"
                ep.done = True
        ready.extend(starting)

    def _flush_pending(self, state: SamplerState, ready: list, stats: RolloutStats) -> None:
        todo = [ep for ep in ready if ep.pending and not ep.done]
        if not todo:
            return
        t0 = time.perf_counter()
        fits = self.sampler.extend(state, [ep.row for ep in todo], [ep.pending for ep in todo])
        stats.sample_s += time.perf_counter() - t0
        stats.sampler_calls += 1
        for ep, ok in zip(todo, fits):
            ep.pending = []
            if not ok:
                ep.finish_reason = "context_full"
                ep.done = True

    def _generate(self, state: SamplerState, ready: list, key, stats: RolloutStats) -> int:
        """One turn for every ready episode. Turns are streamed: each one's action goes to the pool
        as soon as the turn ends, so its environment steps while longer turns are still decoding."""
        cfg = self.cfg
        t0 = time.perf_counter()
        keys = None if key is None else _turn_keys(key, np.array([ep.uid for ep in ready], np.int32),
                                                   np.array([len(ep.action_spans) for ep in ready], np.int32))
        ended = 0

        def on_finish(i, tokens, logprobs, reason):
            nonlocal ended
            ended += self._turn_ended(ready[i], tokens, logprobs, reason, state, stats)

        self.sampler.generate(state, [ep.row for ep in ready], cfg.max_turn_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, greedy=cfg.greedy, key=keys,
                              on_finish=on_finish, stream_every=cfg.stream_every)
        stats.sample_s += time.perf_counter() - t0
        stats.sampler_calls += 1
        return ended

    def _turn_ended(self, ep: _Episode, tokens, logprobs, reason: str, state: SamplerState,
                    stats: RolloutStats) -> int:
        """Records a finished turn and submits its action; returns 1 if the episode ended."""
        stats.generated_tokens += len(tokens)
        toks = [int(t) for t in tokens]
        start = len(ep.tokens)
        ep.tokens.extend(toks)
        ep.action_mask.extend([True] * len(toks))
        ep.obs_mask.extend([False] * len(toks))
        ep.logp.extend(float(x) for x in logprobs)
        closed = bool(toks) and toks[-1] == self.im_end
        content_end = len(ep.tokens) - int(closed)
        ep.action_spans.append((start, content_end))
        reply = self.chat.tokenizer.decode(ep.tokens[start:content_end])
        ep.replies.append(reply)
        if reason == "context_full":
            ep.actions.append(None)
            ep.finish_reason = "context_full"
            return self._end(ep, state)
        if not closed:  # turn cut at the per-turn cap: close it (not a sampled token)
            ep.add([self.im_end])
        ep.add(self.chat.end_of_turn())
        action = self.family.parse_action(reply)
        ep.actions.append(action)
        ep.in_env = True
        self.pool.submit_step(ep.env_key, action)
        return 0

    def _can_join(self, episodes: Sequence[_Episode], spare_rows: int) -> bool:
        """Whether a result still at the pool could join the next sampler call: a step of an
        episode that holds a row, or a reset at a worker while a row is free for it (a reset queued
        for an environment slot waits for an episode to end, which needs this call)."""
        return any(ep.in_env and (ep.row is not None or (spare_rows > 0 and self.pool.has_slot(ep.env_key)))
                   for ep in episodes)

    # -- endings -----------------------------------------------------------------------------------
    def _end(self, ep: _Episode, state: SamplerState) -> int:
        ep.done = True
        self._finish(ep, state)
        return 1

    def _finish(self, ep: _Episode, state: SamplerState) -> None:
        if ep.row is not None:
            self.sampler.free(state, [ep.row])
            ep.row = None
        if ep.finish_reason in ("context_full",):
            self.pool.release(ep.env_key)

    def _abandon(self, ep: _Episode, state: SamplerState) -> None:
        """Cleanup after an exception: free the row and the environment slot."""
        if ep.row is not None:
            self.sampler.free(state, [ep.row])
            ep.row = None
        if not ep.done:
            try:
                self.pool.release(ep.env_key)
            except Exception:  # the pool may already be closed
                pass

    def _trajectory(self, ep: _Episode) -> Trajectory:
        return Trajectory(
            tokens=np.asarray(ep.tokens, np.int32), action_mask=np.asarray(ep.action_mask, bool),
            obs_mask=np.asarray(ep.obs_mask, bool), sampler_logp=np.asarray(ep.logp, np.float32),
            action_spans=np.asarray(ep.action_spans, np.int32).reshape(-1, 2),
            observation_spans=np.asarray(ep.obs_spans, np.int32).reshape(-1, 2),
            actions=list(ep.actions), observations=list(ep.observations), score=ep.score,
            success=ep.success, task_id=str(ep.task_id), group_id=ep.group_id, family=self.family_name,
            finish_reason=ep.finish_reason,
            metadata={"replies": ep.replies, "env": ep.env_info,
                      "task_family": self.family.task_family(ep.task_id)})


@jax.jit
def _turn_keys(key, uids, turns):
    """[n] keys fold_in(fold_in(key, uids[i]), turns[i]): one per (episode, turn)."""
    return jax.vmap(lambda u, t: jax.random.fold_in(jax.random.fold_in(key, u), t))(uids, turns)


def scripted_trajectory(runner: RolloutRunner, task_id: int, group_id: int, observations: Sequence[str],
                        infos: Sequence[dict], replies: Sequence[str], *, score: float, success: bool,
                        finish_reason: str = "done", context_only: Sequence[int] = ()) -> Trajectory:
    """A trajectory whose assistant turns are given text (expert demonstrations), laid out exactly as
    the live loop lays out sampled turns: observations[i] (with infos[i]) precedes replies[i].
    Replies whose index is in `context_only` are not action tokens (no loss reads them)."""
    tok = runner.chat.tokenizer
    ep = _Episode(0, int(task_id), int(group_id), family=runner.family_name)
    for turn in runner.preamble(ep.task_id):
        ep.add_turn(turn, obs=False)
    for i, obs in enumerate(observations):
        ep.observations.append(obs)
        if i >= len(replies):
            break
        ep.add_turn(runner._observation_turn(obs, infos[i]), obs=True)
        ep.add(runner._gen_prompt)
        start = len(ep.tokens)
        act = i not in context_only
        ep.add(tok.encode(replies[i]), action=act)
        ep.action_spans.append((start, len(ep.tokens)))
        ep.add([runner.im_end], action=act)
        ep.add(runner.chat.end_of_turn())
        ep.replies.append(replies[i])
        ep.actions.append(runner.family.parse_action(replies[i]))
    ep.score, ep.success, ep.finish_reason = float(score), bool(success), finish_reason
    return runner._trajectory(ep)
