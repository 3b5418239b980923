"""Parked episodes: what a partial rollout leaves running, as the next rollout and a checkpoint see it.

With partial rollouts (`RolloutRunner.run(..., complete_groups=n)`) a rollout ends once n groups have
every episode ended. The episodes of the other groups are *parked*: they keep their tokens, their
sampler log-probs and the policy version of each sampled turn, and the next rollout continues them
first, under the newer policy (its rows are prefilled again). A group trains only when it is
complete, so a parked group's episodes that did end wait with it.

A parked episode's environment normally stays alive at the pool. When it is gone (the trainer was
killed and resumed, an evaluation needed the instances, a worker was lost), the runner catches the
episode up: its environment is reset and given the recorded actions again, and each observation is
checked against the recorded one. A mismatch (an environment that does not replay) starts the
episode again from its reset, outcome-blind, like an episode lost to its worker.

This module holds what needs no pool or sampler: the checkpoint form of a parked episode, and
which groups are complete or too stale to train.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from cope_jax.rollout.episode import PlayedEpisode

# what a parked episode keeps across a checkpoint (the rest is where it is played: row, environment)
_KEPT = ("index", "task_id", "group_id", "uid", "tokens", "action_mask", "obs_mask", "sampler_logp",
         "action_spans", "observation_spans", "actions", "replies", "observations", "rejected", "prompt_len",
         "score", "success", "finish_reason", "env_info", "done", "replays", "versions")


def episode_state(ep: PlayedEpisode) -> dict[str, Any]:
    """A parked episode as a JSON-serialisable dict (a checkpoint's data state)."""
    state = {name: getattr(ep, name) for name in _KEPT}
    state["action_spans"] = [list(s) for s in ep.action_spans]
    state["observation_spans"] = [list(s) for s in ep.observation_spans]
    return state


def episode_from_state(state: dict[str, Any]) -> PlayedEpisode:
    """The parked episode `episode_state` wrote, with no environment (the runner catches it up)."""
    missing = [name for name in _KEPT if name not in state]
    if missing:
        raise ValueError(f"a parked episode's state lacks {missing}")
    ep = PlayedEpisode(int(state["index"]), int(state["task_id"]), int(state["group_id"]))
    for name in _KEPT:
        setattr(ep, name, state[name])
    ep.action_spans = [tuple(s) for s in state["action_spans"]]
    ep.observation_spans = [tuple(s) for s in state["observation_spans"]]
    ep.sampler_logp = [float(x) for x in state["sampler_logp"]]
    ep.to_prefill = list(ep.tokens)  # no row holds it
    return ep


def complete_groups(episodes: Iterable[PlayedEpisode]) -> list[int]:
    """The group ids whose every episode has ended, in first-seen order."""
    groups: dict[int, bool] = {}
    for ep in episodes:
        groups[ep.group_id] = groups.get(ep.group_id, True) and ep.done
    return [g for g, done in groups.items() if done]


def oldest_version(ep: PlayedEpisode) -> int | None:
    """The policy version of the episode's first sampled turn (None before any)."""
    return min(ep.versions) if ep.versions else None


def stale_groups(episodes: Sequence[PlayedEpisode], version: int, max_staleness: int) -> list[int]:
    """The groups with an episode whose oldest turn is more than `max_staleness` versions behind
    `version` (the policy that would train on it): dropped whole, never trained."""
    stale = {ep.group_id for ep in episodes
             if (v := oldest_version(ep)) is not None and version - v > max_staleness}
    return [g for g in dict.fromkeys(ep.group_id for ep in episodes) if g in stale]


@dataclasses.dataclass
class Staleness:
    """Versions behind of the trained tokens: each sampled token counts with its turn's version."""

    tokens: int = 0
    behind_sum: int = 0
    behind_max: int = 0

    def add(self, versions: Sequence[int], turn_lengths: Sequence[int], version: int) -> None:
        for v, n in zip(versions, turn_lengths):
            self.tokens += int(n)
            self.behind_sum += int(n) * (version - int(v))
            self.behind_max = max(self.behind_max, version - int(v))

    def record(self) -> dict[str, float]:
        return {"staleness_mean": self.behind_sum / self.tokens if self.tokens else 0.0,
                "staleness_max": float(self.behind_max)}
