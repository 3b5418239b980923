"""The host-side rollout loop: sampler turns and asynchronous environment steps, as token ids.

For a batch of (task, group) pairs, episodes are reset in the environment pool and started in
sampler rows as their first observation arrives. Each iteration generates one assistant turn for
*every* episode that is waiting for one (a single batched sampler call), submits each parsed
action to the pool as soon as its turn ends (turns are streamed out of the call while longer ones
still decode), and appends each returned observation to its row (prefilling only the new tokens).
Environment workers step in their own processes while the sampler decodes the other episodes, so
environment time overlaps with decoding. More episodes than sampler rows is fine: an
episode waits for a free row.

An episode's tokens are laid out by `cope_jax/rollout/episode.py`. It ends when the environment says done
(max rounds is the environment's step cap), on an environment fault, or as `context_full` (a
failure, as verl counts it) when it outgrows a length limit: its prompt (everything up to the first
assistant turn: instruction and o_0) is longer than `max_prompt_len`, its response (every token after
the prompt: turns and observations) reaches `max_response_len`, or its row would overflow `max_len`.
A turn is never cut by the response limit's arrival mid-turn: the limit caps the turn's tokens, and
a turn that ends there ends the episode.

An episode lost to its worker (the process died or hung: `crashed`, `timeout`) is not its own
fault: it is replayed from its start (a fresh reset of the same task and group, a fresh sampling
key) up to `max_replays` times, and only then ends as a fault. The replay does not look at how far
the lost episode got or how it was doing, so replays add no bias. An exception raised by the
environment itself (`env_error`) is the episode's own and is not replayed.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from cope_jax.rollout import parking
from cope_jax.rollout.chat import ChatFormat
from cope_jax.rollout.episode import EpisodeLayout, PlayedEpisode
from cope_jax.rollout.sampler import Sampler, SamplerState
from cope_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_rounds: int = 20  # environment steps per episode
    max_turn_tokens: int = 512  # generation cap per assistant turn
    max_prompt_len: int = 0  # tokens before the first assistant turn (0: only the row's max_len)
    max_response_len: int = 0  # tokens after the prompt, turns and observations (0: only max_len)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    # asynchronous rounds: an episode ready to decode waits up to this fraction of a typical
    # generate call for environment results still in flight to join its batch; a sampler call
    # costs nearly the same for 1 row as for many, so a straggler decoded alone costs a whole
    # call: waiting up to one call's time for it is the break-even point. Before the runner's
    # first call (cost unknown) it waits for every result that can join.
    batch_wait: float = 1.0
    # lockstep rounds: wait for every in-flight environment call and handle results in episode
    # order before decoding, so the order of events (hence sampler batches) does not depend on timing and
    # rollouts are bit-reproducible; gives up overlapping environment steps with decoding
    sync: bool = False
    # streaming: finished turns are handed to the pool every this many decode steps (a host sync
    # per chunk: small next to the steps themselves)
    stream_every: int = 16
    # replays of an episode lost to its worker (module docstring) before it counts as a fault
    max_replays: int = 2


@dataclasses.dataclass
class RolloutStats:
    """What one rollout batch did, and how long it took.

    Occupancy is how full the sampler's calls were: the rows a call decodes over the sampler's rows.
    A rollout's tail is the wall time after a call that decoded under half the rows, until the next
    call or the rollout's end (`low_occupancy_s`; counted from the first call: the resets before it
    are not tail). Every field adds up over rollouts and hosts, but `wall_s`, the slowest host's."""

    wall_s: float = 0.0
    generated_tokens: int = 0
    env_steps: int = 0
    replays: int = 0  # episodes started again after their worker was lost
    decode_calls: int = 0  # sampler calls that generated a turn
    # tokens put into the cache (`SamplerState.prefilled`): prompts, observations, and a continued
    # parked episode's whole context again (partial rollouts' cost), beside the sampled ones
    prefill_tokens: int = 0
    rows_decoded: int = 0  # rows in those calls
    row_capacity: int = 0  # the sampler's rows, once per call
    low_occupancy_s: float = 0.0  # wall seconds in the tail (above)
    host_wall_s: float = 0.0  # wall seconds, summed over hosts and rollouts

    @property
    def occupancy(self) -> float:
        """Mean rows decoding per call over the sampler's rows (0 without calls)."""
        return self.rows_decoded / self.row_capacity if self.row_capacity else 0.0

    @property
    def low_occupancy_share(self) -> float:
        """The share of the rollouts' wall time spent in the tail (under half occupancy)."""
        return self.low_occupancy_s / self.host_wall_s if self.host_wall_s else 0.0

    @classmethod
    def combined(cls, parts: Sequence["RolloutStats"]) -> "RolloutStats":
        """Stats of rollouts run side by side (one per host): counts add up, the wall time is the
        slowest one's."""
        out = cls(**{f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(cls)})
        out.wall_s = max((p.wall_s for p in parts), default=0.0)
        return out


class RolloutRunner:
    """Runs batches of episodes of one environment family with one sampler and one pool."""

    def __init__(self, sampler: Sampler, pool, family_name: str, family, chat: ChatFormat,
                 cfg: RolloutConfig):
        self.sampler, self.pool, self.family_name, self.family = sampler, pool, family_name, family
        self.chat, self.cfg = chat, cfg
        self.layout = EpisodeLayout(chat, family_name, family)
        self._version = 0  # the policy version of this run's turns
        self._generate_s = 0.0  # running mean of a generate call's time (0: none yet)
        self._ahead: dict[tuple[int, int, int], object] = {}  # prefetched (task, group, id) -> env key
        self._early: dict[object, object] = {}  # env key -> its reset result, arrived before its run
        self._last_call: tuple[float, bool] | None = None  # (start, under half the rows) of this run's last call
        self.parked: list[PlayedEpisode] = []  # partial rollouts: the episodes the next run continues first

    def run(self, tasks: Sequence[tuple[int, int]], key: jax.Array, *,
            episode_ids: Sequence[int] | None = None, prefetch: Sequence[tuple[int, int]] = (),
            prefetch_ids: Sequence[int] | None = None, on_progress: Callable[[int], None] | None = None,
            complete_groups: int = 0, version: int = 0) -> tuple[list[Trajectory], RolloutStats]:
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

        complete_groups > 0 (partial rollouts, `cope_jax/rollout/parking.py`): the parked episodes
        continue first, before the new ones, and the run ends once that many groups have every
        episode ended; it returns those groups' trajectories (parked ones first) and parks the
        others' episodes. `version` is the policy version each turn sampled in this run records.
        Episode ids must then be unique across runs: a parked episode keeps its id.
        """
        stats = RolloutStats()
        t_start = time.perf_counter()
        state = self.sampler.init_state()
        self._last_call = None
        self._version = int(version)
        fresh = self._episodes(tasks, episode_ids)
        ahead_ids = range(len(prefetch)) if prefetch_ids is None else [int(u) for u in prefetch_ids]
        if len(ahead_ids) != len(prefetch):
            raise ValueError(f"{len(ahead_ids)} prefetch_ids for {len(prefetch)} episodes")
        if len(set(ahead_ids)) != len(ahead_ids):
            raise ValueError("prefetch_ids repeat an id")
        parked, self.parked = self.parked, []
        episodes = parked + fresh
        for i, ep in enumerate(episodes):
            ep.index = i
        by_key, need_row = self._continue(parked)
        reset, early = self._submit_resets(fresh)
        by_key |= reset
        self.cancel_prefetch()  # what is left was prefetched for a batch that did not come
        for (t, g), u in zip(prefetch, ahead_ids):  # the next batch's resets
            env_key = (id(self), "ahead", u, time.perf_counter_ns())
            self._ahead[(int(t), int(g), u)] = env_key
            self.pool.submit_reset(env_key, self.family_name, int(t), max_rounds=self.cfg.max_rounds)
        try:
            self._play(episodes, by_key, early, need_row, state, key, stats, on_progress, complete_groups)
            if complete_groups:
                episodes = self._park(episodes, state)
            if on_progress is not None:
                on_progress(len(episodes))
        except BaseException:
            self.cancel_prefetch()  # the next batch may not come
            raise
        finally:
            for ep in episodes:
                if not ep.done or ep.row is not None:
                    self._abandon(ep, state)
            self.sampler.drop_unrolled_params()  # the update needs the memory; the next run's policy differs
        end = time.perf_counter()
        self._count_tail(stats, end)
        stats.wall_s = stats.host_wall_s = end - t_start
        stats.prefill_tokens = state.prefilled
        return [self.layout.trajectory(ep) for ep in episodes], stats

    def cancel_prefetch(self) -> None:
        """Releases the environments prefetched for a next run (e.g. before another runner uses the
        pool)."""
        for env_key in self._ahead.values():
            self.pool.release(env_key)
            self._early.pop(env_key, None)
        self._ahead = {}

    def release_parked(self) -> None:
        """Gives the parked episodes' environments back to the pool (e.g. before another runner uses
        it); the next run catches them up (`cope_jax/rollout/parking.py`)."""
        for ep in self.parked:
            self._release(ep)

    def drop_parked(self, groups: Sequence[int]) -> list[PlayedEpisode]:
        """Removes the parked episodes of `groups` (never trained: too stale) and frees their
        environments; returns them."""
        groups = set(groups)
        dropped = [ep for ep in self.parked if ep.group_id in groups]
        self.parked = [ep for ep in self.parked if ep.group_id not in groups]
        for ep in dropped:
            self._release(ep)
        return dropped

    def _release(self, ep: PlayedEpisode) -> None:
        """Gives a parked episode's environment back (a call of it in flight is answered, then dropped)."""
        if ep.env_key is not None and not ep.done:
            self.pool.release(ep.env_key)
        ep.env_key, ep.in_env = None, False

    def _park(self, episodes: list[PlayedEpisode], state: SamplerState) -> list[PlayedEpisode]:
        """Parks the episodes of the groups not complete; returns the others (their groups are)."""
        complete = set(parking.complete_groups(episodes))
        for ep in episodes:
            if ep.group_id in complete:
                continue
            if ep.row is not None:
                self.sampler.free(state, [ep.row])
                ep.row = None
            ep.to_prefill = list(ep.tokens)  # the next run prefills it again, under its weights
            self.parked.append(ep)
        return [ep for ep in episodes if ep.group_id in complete]

    def _continue(self, parked: list[PlayedEpisode]) -> tuple[dict, list]:
        """Continues parked episodes -> (env key -> episode, the ones waiting for a row). One whose
        environment is gone is caught up: one reset call that replays the actions its recorded
        observations answer (`_catch_up` checks them)."""
        by_key, need_row = {}, []
        for ep in parked:
            if ep.done:
                continue
            if ep.env_key is None:
                ep.caught, ep.in_env = bool(ep.observations), True
                ep.env_key = (id(self), "continue", ep.uid, time.perf_counter_ns())
                self.pool.submit_reset(ep.env_key, self.family_name, ep.task_id, max_rounds=self.cfg.max_rounds,
                                       actions=ep.actions[:len(ep.observations) - 1])
            elif not ep.in_env:
                need_row.append(ep)
            by_key[ep.env_key] = ep
        return by_key, need_row

    def _catch_up(self, ep: PlayedEpisode, r, need_row: list) -> bool:
        """The result of a parked episode's catch-up: True if it replayed the recorded observations
        (the action that was in flight is sent again, or the episode waits for a row), False if
        not (the environment does not replay: the episode plays again from its reset)."""
        ep.caught = False
        if not r.ok or r.done or (r.replayed or [r.observation]) != ep.observations:
            return False
        if len(ep.actions) == len(ep.observations):  # parked with its last action at the environment
            ep.in_env = True
            self.pool.submit_step(ep.env_key, ep.actions[-1])
        else:
            need_row.append(ep)
        return True

    def _episodes(self, tasks: Sequence[tuple[int, int]], episode_ids) -> list[PlayedEpisode]:
        uids = range(len(tasks)) if episode_ids is None else [int(u) for u in episode_ids]
        if len(uids) != len(tasks):
            raise ValueError(f"{len(uids)} episode_ids for {len(tasks)} episodes")
        return [PlayedEpisode(i, int(t), int(g), uid=u) for i, ((t, g), u) in enumerate(zip(tasks, uids))]

    def _submit_resets(self, episodes: list[PlayedEpisode]) -> tuple[dict, list]:
        """Resets each episode, or picks up its prefetched environment; returns (env key -> episode,
        the first observations of prefetched episodes that arrived before this run)."""
        by_key, early = {}, []
        for ep in episodes:
            ep.env_key = self._ahead.pop((ep.task_id, ep.group_id, ep.uid), None)
            ep.in_env = True
            if ep.env_key is None:
                ep.env_key = (id(self), ep.index, time.perf_counter_ns())
                self.pool.submit_reset(ep.env_key, self.family_name, ep.task_id, max_rounds=self.cfg.max_rounds)
            elif ep.env_key in self._early:
                early.append(self._early.pop(ep.env_key))
            by_key[ep.env_key] = ep
        return by_key, early

    # -- the loop ----------------------------------------------------------------------------------
    def _play(self, episodes, by_key, early, need_row, state, key, stats, on_progress, complete_groups) -> None:
        """Plays the episodes until every one has ended, or `complete_groups` groups have (> 0).
        need_row: the episodes waiting for a sampler row (o_0 or a parked episode's observation)."""
        cfg = self.cfg
        upcoming = set(self._ahead.values())
        ready: list[PlayedEpisode] = []  # row holds everything up to a generation prompt
        live = sum(not ep.done for ep in episodes)
        hold = 0.0  # seconds the ready episodes still wait for results to join their batch
        ready_since = None
        quiet_since = time.monotonic()  # the last result or decode round
        while live and not (complete_groups and len(parking.complete_groups(episodes)) >= complete_groups):
            if on_progress is not None:
                on_progress(len(episodes) - live)  # episodes ended so far (a progress bar)
            results = self._collect(hold, bool(ready or need_row), upcoming)
            results = early + results
            early = []
            if results or ready or need_row:
                quiet_since = time.monotonic()
            else:
                self._unblock(live, quiet_since)
            if cfg.sync:
                results.sort(key=lambda r: by_key[r.env_key].index)
            for r in results:
                ep = by_key[r.env_key]
                ep.in_env = False
                stats.env_steps += r.kind == "step"
                caught = self._catch_up(ep, r, need_row) if ep.caught else None
                if caught:
                    continue
                if caught is False or (not r.ok and r.error in REPLAYED and ep.replays < cfg.max_replays):
                    by_key[self._replay(ep, state, need_row, ready)] = ep
                    stats.replays += 1
                    continue
                live -= self._on_env_result(ep, r, state, need_row, ready)
            if need_row and not cfg.sync:
                # prefill new episodes' prompts as their groups' resets arrive: the call returns at
                # once (asynchronous dispatch), so the device prefills while the loop waits for the
                # other resets (observation turns are short: they stay batched). A group starts
                # whole, so its shared prompt is prefilled once (`Sampler.start`)
                self._assign_rows(state, need_row, ready, held=_resetting_groups(episodes))
            if not cfg.sync and (ready or need_row):
                # hold the sampler calls (prefills included) while results can still join
                ready_since = ready_since or time.perf_counter()
                wait = cfg.batch_wait * self._generate_s if self._generate_s else float("inf")
                hold = ready_since + wait - time.perf_counter()
                if hold > 0 and self._can_join(episodes, len(state.free_rows()) - len(need_row)):
                    continue
            hold, ready_since = 0.0, None
            live -= self._decode_round(state, need_row, ready, key, stats)

    def _unblock(self, live: int, quiet_since: float) -> None:
        """Called when nothing arrived and nothing can decode. If no result can arrive either, the
        batch's resets wait for environment instances held by the next batch's prefetched episodes
        (the instances of episodes lost to a worker went to them before the replays were submitted):
        the prefetch is released. Past that, or after `quiet_limit` seconds without a result, the rollout stops
        with one line saying where each outstanding call is (a hang becomes an error)."""
        if not self.pool.can_progress() and self._ahead:
            self.cancel_prefetch()
            return
        quiet = time.monotonic() - quiet_since
        why = ("none can arrive" if not self.pool.can_progress()
               else "past every deadline" if quiet > self.pool.quiet_limit() + WATCHDOG_MARGIN_S else None)
        if why:
            raise RolloutStalled(f"rollout stalled: {live} episodes live, nothing to decode, no environment result "
                                 f"for {quiet:.0f}s ({why}): {self.pool.describe()}")

    def _collect(self, hold: float, can_decode: bool, upcoming: set) -> list:
        """The pool's results for this batch, waiting for them while nothing can decode or while
        the ready episodes are held; results for the next batch's prefetched episodes are kept.
        A wait ends by `quiet_limit` at the latest, so `_unblock` sees a stalled pool."""
        limit = self.pool.quiet_limit() + WATCHDOG_MARGIN_S
        if self.cfg.sync:  # every call that can answer, however long they take together
            results = []
            while got := self.pool.wait_all(timeout=limit):
                results += got
                if not self.pool.can_progress():
                    break
        else:
            results = self.pool.poll(0.0)
            if not results and self.pool.can_progress() and (hold > 0 or not can_decode):
                # poll returns at the first result: the bound only lets `_unblock` look
                results = self.pool.poll(min(hold, 1.0) if hold > 0 else limit)
        for r in [r for r in results if r.env_key in upcoming]:
            self._early[r.env_key] = r
        return [r for r in results if r.env_key not in upcoming]

    def _decode_round(self, state: SamplerState, need_row: list, ready: list, key, stats: RolloutStats) -> int:
        """Starts waiting episodes in free rows, prefills what the ready ones got since their last
        turn and generates their next turn; returns how many episodes ended."""
        self._assign_rows(state, need_row, ready)
        self._extend_ready(state, ready)
        ended = [ep for ep in ready if ep.done]
        for ep in ended:
            ready.remove(ep)
            self._finish(ep, state)
        if not ready:
            return len(ended)
        t_gen = time.perf_counter()
        self._count_tail(stats, t_gen, low=2 * len(ready) < self.sampler.batch_size)
        stats.decode_calls += 1
        stats.rows_decoded += len(ready)
        stats.row_capacity += self.sampler.batch_size
        generated = self._generate(state, ready, key, stats)
        took = time.perf_counter() - t_gen
        self._generate_s = took if not self._generate_s else 0.8 * self._generate_s + 0.2 * took
        ready.clear()
        return len(ended) + generated

    def _count_tail(self, stats: RolloutStats, now: float, low: bool | None = None) -> None:
        """Adds the time since the last call to the tail if that call was under half occupancy, and
        starts the next interval at `now` (with the new call's `low`; None: the rollout ended)."""
        if self._last_call is not None and self._last_call[1]:
            stats.low_occupancy_s += now - self._last_call[0]
        self._last_call = None if low is None else (now, low)

    def _replay(self, ep: PlayedEpisode, state: SamplerState, need_row: list, ready: list):
        """Starts `ep` again from its reset (module docstring); returns its new environment key."""
        if ep.row is not None:
            self.sampler.free(state, [ep.row])
        for waiting in (need_row, ready):
            if ep in waiting:
                waiting.remove(ep)
        ep.restart()
        ep.env_key = (id(self), ep.index, ep.replays, time.perf_counter_ns())
        ep.in_env = True
        self.pool.submit_reset(ep.env_key, self.family_name, ep.task_id, max_rounds=self.cfg.max_rounds)
        return ep.env_key

    def _on_env_result(self, ep: PlayedEpisode, r, state, need_row, ready) -> int:
        """Records a reset/step result; returns 1 if the episode ended."""
        if not r.ok:
            ep.finish_reason = f"env_{r.error}"
            ep.env_info = {"error": r.error, "reason": r.reason, "worker_pid": r.worker_pid}
            ep.score, ep.success = float(r.score), False
            return self._end(ep, state)
        ep.observations.append(r.observation)
        if r.kind == "step":
            ep.rejected.append(bool(r.info.get("invalid", False)))
        ep.score = float(r.score)
        if r.kind == "reset":
            self.layout.open(ep)
        if r.done:
            ep.success = bool(r.success)
            ep.finish_reason = "max_rounds" if r.info.get("truncated") else "done"
            ep.env_info = dict(r.info)
            return self._end(ep, state)
        self.layout.add_observation(ep, r.observation, r.info)
        if r.kind == "reset":
            ep.prompt_len = len(ep.tokens)
        if self._over_length(ep):
            ep.finish_reason = "context_full"
            return self._end(ep, state)
        (need_row if ep.row is None else ready).append(ep)
        return 0

    def _over_length(self, ep: PlayedEpisode) -> bool:
        """Whether the prompt is over `max_prompt_len` or the response leaves no token under
        `max_response_len` (0: no such limit)."""
        cfg = self.cfg
        return bool((cfg.max_prompt_len and ep.prompt_len > cfg.max_prompt_len)
                    or (cfg.max_response_len and self._response_room(ep) <= 0))

    def _response_room(self, ep: PlayedEpisode) -> int:
        """Tokens the episode's response may still grow by (`max_response_len` set)."""
        return self.cfg.max_response_len - (len(ep.tokens) - ep.prompt_len)

    def _assign_rows(self, state: SamplerState, need_row: list, ready: list, held: set = frozenset()) -> None:
        """Starts waiting episodes in free rows, in arrival order, but those of the groups `held`."""
        free = state.free_rows()
        starting = [ep for ep in need_row if (ep.task_id, ep.group_id) not in held][:len(free)]
        if not starting:
            return
        started = {id(ep) for ep in starting}
        need_row[:] = [ep for ep in need_row if id(ep) not in started]
        rows = free[:len(starting)]
        self.sampler.start([ep.to_prefill for ep in starting], state, rows=rows)
        for ep, row in zip(starting, rows):
            ep.row, ep.to_prefill = row, []
            if state.full[row]:
                ep.finish_reason = "context_full"
                ep.done = True
        ready.extend(starting)

    def _extend_ready(self, state: SamplerState, ready: list) -> None:
        """Prefills the tokens the ready episodes got since their last turn."""
        todo = [ep for ep in ready if ep.to_prefill and not ep.done]
        if not todo:
            return
        fits = self.sampler.extend(state, [ep.row for ep in todo], [ep.to_prefill for ep in todo])
        for ep, ok in zip(todo, fits):
            ep.to_prefill = []
            if not ok:
                ep.finish_reason = "context_full"
                ep.done = True

    def _generate(self, state: SamplerState, ready: list, key, stats: RolloutStats) -> int:
        """One turn for every ready episode. Turns are streamed: each one's action goes to the pool
        as soon as the turn ends, so its environment steps while longer turns are still decoding."""
        cfg = self.cfg
        keys = None if key is None else _turn_keys(key, np.array([ep.uid for ep in ready], np.int32),
                                                   np.array([len(ep.action_spans) for ep in ready], np.int32),
                                                   np.array([ep.replays for ep in ready], np.int32))
        ended = 0

        def on_finish(i, tokens, logprobs, reason):
            nonlocal ended
            ended += self._turn_ended(ready[i], tokens, logprobs, reason, state, stats)

        max_new = cfg.max_turn_tokens
        if cfg.max_response_len:
            max_new = np.array([min(cfg.max_turn_tokens, self._response_room(ep)) for ep in ready])
        self.sampler.generate(state, [ep.row for ep in ready], max_new, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, greedy=cfg.greedy, key=keys,
                              on_finish=on_finish, stream_every=cfg.stream_every)
        return ended

    def _turn_ended(self, ep: PlayedEpisode, tokens, logprobs, reason: str, state: SamplerState,
                    stats: RolloutStats) -> int:
        """Records a finished turn and submits its action; returns 1 if the episode ended."""
        stats.generated_tokens += len(tokens)
        start = ep.add_sampled(tokens, logprobs, self._version)
        closed = len(tokens) > 0 and ep.tokens[-1] == self.layout.im_end
        content_end = len(ep.tokens) - int(closed)
        ep.action_spans.append((start, content_end))
        reply = self.chat.tokenizer.decode(ep.tokens[start:content_end])
        ep.replies.append(reply)
        if reason == "context_full" or (self.cfg.max_response_len and self._response_room(ep) <= 0):
            ep.actions.append(None)
            ep.finish_reason = "context_full"
            return self._end(ep, state)
        if not closed:  # turn cut at the per-turn cap: close it (not a sampled token)
            ep.add([self.layout.im_end])
        ep.add(self.chat.end_of_turn())
        action = self.family.parse_action(reply)
        ep.actions.append(action)
        ep.in_env = True
        self.pool.submit_step(ep.env_key, action)
        return 0

    def _can_join(self, episodes: Sequence[PlayedEpisode], spare_rows: int) -> bool:
        """Whether a result still at the pool could join the next sampler call: a step of an
        episode that holds a row, or a reset at a worker while a row is free for it (a reset queued
        for an environment instance waits for an episode to end, which needs this call)."""
        return any(ep.in_env and (ep.row is not None or (spare_rows > 0 and self.pool.has_instance(ep.env_key)))
                   for ep in episodes)

    # -- endings -----------------------------------------------------------------------------------
    def _end(self, ep: PlayedEpisode, state: SamplerState) -> int:
        ep.done = True
        self._finish(ep, state)
        return 1

    def _finish(self, ep: PlayedEpisode, state: SamplerState) -> None:
        if ep.row is not None:
            self.sampler.free(state, [ep.row])
            ep.row = None
        if ep.finish_reason == "context_full":  # the environment still holds the episode
            self.pool.release(ep.env_key)

    def _abandon(self, ep: PlayedEpisode, state: SamplerState) -> None:
        """Cleanup after an exception: free the row and the environment instance."""
        if ep.row is not None:
            self.sampler.free(state, [ep.row])
            ep.row = None
        if not ep.done:
            try:
                self.pool.release(ep.env_key)
            except Exception:  # the pool may already be closed
                pass


REPLAYED = ("crashed", "timeout")  # pool errors that are the worker's, not the episode's
WATCHDOG_MARGIN_S = 30.0  # beyond the pool's `quiet_limit`, before a silent rollout is an error


class RolloutStalled(RuntimeError):
    """No environment result can arrive, or none did within every deadline, and nothing can decode."""


def _resetting_groups(episodes: Sequence[PlayedEpisode]) -> set[tuple[int, int]]:
    """(task, group) of the episodes whose reset is still at the pool."""
    return {(ep.task_id, ep.group_id) for ep in episodes if ep.in_env and not ep.observations}


@jax.jit
def _turn_keys(key, uids, turns, replays):
    """[n] keys fold_in(fold_in(key, uids[i]), turns[i]): one per (episode, turn); a replay r > 0
    folds r in too (a fresh key, the first play's unchanged)."""
    def one(u, t, r):
        k = jax.random.fold_in(jax.random.fold_in(key, u), t)
        return jax.lax.cond(r > 0, lambda: jax.random.fold_in(k, r), lambda: k)
    return jax.vmap(one)(uids, turns, replays)
