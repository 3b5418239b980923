"""One episode laid out in tokens as the rollout plays it, and the `Trajectory` it becomes.

Token layout of an episode (method §1), `P = <|im_start|>assistant\\n`:
    [user: instruction] [assistant: acknowledgement] [user: o_0] P a_0 <|im_end|> \\n [user: o_1] P a_1 ...
(a tool-calling family instead opens with its system message with the tools block, and its tool
results are `tool` turns). Assistant content tokens are the sampler's ids; observations are
encoded once when appended. `EpisodeLayout` writes one family's turns in one chat format,
`PlayedEpisode` holds an episode's tokens so far, and `scripted_trajectory` lays out given replies
(expert demonstrations) exactly as the live loop (`cope_jax/rollout/runner.py`) lays out sampled ones.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cope_jax.rollout.chat import ChatFormat, Turn
from cope_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass
class PlayedEpisode:
    """An episode being played: its tokens, masks and turns so far, and where it is played (its
    sampler row and its environment at the pool)."""

    index: int
    task_id: int
    group_id: int
    uid: int = 0  # names the episode's randomness (see RolloutRunner.run)
    row: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[bool] = dataclasses.field(default_factory=list)
    obs_mask: list[bool] = dataclasses.field(default_factory=list)
    sampler_logp: list[float] = dataclasses.field(default_factory=list)
    action_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    observation_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    actions: list[str | None] = dataclasses.field(default_factory=list)
    replies: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    rejected: list[bool] = dataclasses.field(default_factory=list)  # per answered action (Trajectory)
    to_prefill: list[int] = dataclasses.field(default_factory=list)  # ids not yet in the sampler's row
    prompt_len: int = 0  # tokens before the first assistant turn (set once o_0 is laid out)
    score: float = 0.0
    success: bool = False
    finish_reason: str = ""
    env_info: dict = dataclasses.field(default_factory=dict)
    done: bool = False
    env_key: object = None  # the pool's episode key
    in_env: bool = False  # a reset or step of this episode is at the pool
    replays: int = 0  # times it was started again after its worker was lost (runner.py)
    versions: list[int] = dataclasses.field(default_factory=list)  # the policy version of each sampled turn
    # a parked episode whose environment is gone is caught up (runner.py): its environment is reset and
    # given its recorded actions again, in one call; whether that call is at the pool
    caught: bool = False

    def restart(self) -> None:
        """Back to before its reset (a replay): everything played is dropped, `replays` counts one
        more; the task, group, index and uid stay."""
        fresh = PlayedEpisode(self.index, self.task_id, self.group_id, uid=self.uid, replays=self.replays + 1)
        self.__dict__.update(fresh.__dict__)

    def add(self, ids: Sequence[int], *, action=False, obs=False) -> tuple[int, int]:
        """Appends ids the sampler has not seen (queued for prefill); returns their span."""
        start = len(self.tokens)
        self.tokens.extend(int(i) for i in ids)
        self.action_mask.extend([action] * len(ids))
        self.obs_mask.extend([obs] * len(ids))
        self.sampler_logp.extend([0.0] * len(ids))
        self.to_prefill.extend(int(i) for i in ids)
        return start, len(self.tokens)

    def add_turn(self, turn: Turn, *, obs: bool) -> None:
        self.add(turn.ids[:turn.content_start])
        span = self.add(turn.ids[turn.content_start:turn.content_end], obs=obs)
        if obs:
            self.observation_spans.append(span)
        self.add(turn.ids[turn.content_end:])

    def add_sampled(self, tokens: Sequence[int], logprobs: Sequence[float], version: int = 0) -> int:
        """Appends a turn sampled by policy `version` (already in the sampler's row); returns where
        it starts."""
        toks = [int(t) for t in tokens]
        start = len(self.tokens)
        self.tokens.extend(toks)
        self.action_mask.extend([True] * len(toks))
        self.obs_mask.extend([False] * len(toks))
        self.sampler_logp.extend(float(x) for x in logprobs)
        self.versions.append(int(version))
        return start


class EpisodeLayout:
    """The turns of one environment family's episodes in one chat format, and their trajectories."""

    def __init__(self, chat: ChatFormat, family_name: str, family):
        self.chat, self.family_name, self.family = chat, family_name, family
        self.im_end = chat.im_end_id
        self.generation_prompt = chat.generation_prompt()
        self._preambles: dict[int, list[Turn]] = {}

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

    def open(self, ep: PlayedEpisode) -> None:
        """Adds the turns before the first observation."""
        for turn in self.preamble(ep.task_id):
            ep.add_turn(turn, obs=False)

    def add_observation(self, ep: PlayedEpisode, text: str, info: dict) -> None:
        """Adds an observation turn (a `tool` turn when the environment says so) and the generation
        prompt of the assistant turn that answers it."""
        role = info.get("role", "user")
        if role == "tool":
            turn = self.chat.turns([{"role": "tool", "content": text}])[0]
        else:
            turn = self.chat.turn(role, text)
        ep.add_turn(turn, obs=True)
        ep.add(self.generation_prompt)

    def trajectory(self, ep: PlayedEpisode) -> Trajectory:
        return Trajectory(
            tokens=np.asarray(ep.tokens, np.int32), action_mask=np.asarray(ep.action_mask, bool),
            obs_mask=np.asarray(ep.obs_mask, bool), sampler_logp=np.asarray(ep.sampler_logp, np.float32),
            action_spans=np.asarray(ep.action_spans, np.int32).reshape(-1, 2),
            observation_spans=np.asarray(ep.observation_spans, np.int32).reshape(-1, 2),
            actions=list(ep.actions), observations=list(ep.observations), rejected=list(ep.rejected),
            score=ep.score,
            success=ep.success, task_id=ep.task_id, group_id=ep.group_id, family=self.family_name,
            finish_reason=ep.finish_reason,
            metadata={"replies": ep.replies, "env": ep.env_info, "replays": ep.replays,
                      "task_family": self.family.task_family(ep.task_id), "versions": list(ep.versions)})


def scripted_trajectory(layout: EpisodeLayout, task_id: int, group_id: int, observations: Sequence[str],
                        infos: Sequence[dict], replies: Sequence[str], *, score: float, success: bool,
                        finish_reason: str = "done", context_only: Sequence[int] = ()) -> Trajectory:
    """A trajectory whose assistant turns are given text (expert demonstrations), laid out exactly as
    the live loop lays out sampled turns: observations[i] (with infos[i]) precedes replies[i].
    Replies whose index is in `context_only` are not action tokens (no loss reads them)."""
    tok = layout.chat.tokenizer
    ep = PlayedEpisode(0, int(task_id), int(group_id))
    layout.open(ep)
    for i, obs in enumerate(observations):
        ep.observations.append(obs)
        if i > 0:  # o_i answers reply i - 1
            ep.rejected.append(bool(infos[i].get("invalid", False)))
        if i >= len(replies):
            break
        layout.add_observation(ep, obs, infos[i])
        start = len(ep.tokens)
        act = i not in context_only
        ep.add(tok.encode(replies[i]), action=act)
        ep.action_spans.append((start, len(ep.tokens)))
        ep.add([layout.im_end], action=act)
        ep.add(layout.chat.end_of_turn())
        ep.replies.append(replies[i])
        ep.actions.append(layout.family.parse_action(replies[i]))
    ep.score, ep.success, ep.finish_reason = float(score), bool(success), finish_reason
    return layout.trajectory(ep)
