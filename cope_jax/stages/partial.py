"""Partial rollouts in the RL stage (`rollout.partial`): a step trains the groups that completed, and
the long episodes of the others go on in the next step instead of holding this one.

Each step, on every host:
  1. groups parked more than `rollout.max_staleness` policy versions ago are dropped whole (counted);
  2. new groups top the host's groups up to its share of `rollout.groups_in_flight` (the task ids
     come from the run's task iterator, the group ids from a counter; both in the checkpoint);
  3. the rollout continues the parked episodes first and ends once the host's share of
     `rollout.tasks_per_step` groups is complete (`RolloutRunner.run(complete_groups=...)`); the last
     step of the run plays every group to its end, so nothing is left parked;
  4. every host's complete groups train together.

Every host parks and continues its own episodes, so no host's decode waits for another host's tail:
the hosts meet only when the step's groups are gathered. The parked episodes of every host are part
of the checkpoint's data state; a resumed run catches them up (`cope_jax/rollout/parking.py`), or,
when the run's settings changed, plays them again from their reset.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from cope_jax.rollout import parking
from cope_jax.rollout.runner import RolloutRunner, RolloutStats
from cope_jax.run import distributed
from cope_jax.run.build import Components
from models.config import ConfigError


def _shares(n: int) -> list[int]:
    """Every process's `process_share` size of n."""
    p = jax.process_count()
    return [n // p + (k < n % p) for k in range(p)]


class PartialRollouts:
    """The RL stage's rollouts under `rollout.partial` (module docstring). `tasks.take(n)` gives the
    next n task ids; `before_run` runs before each rollout (the sampling replica's refresh);
    `played_under` names the settings a parked episode can be continued under."""

    def __init__(self, runner: RolloutRunner, tasks, *, group_size: int, tasks_per_step: int,
                 groups_in_flight: int = 0, max_staleness: int, played_under: dict[str, Any],
                 before_run: Callable[[], None] = lambda: None):
        self.runner, self.tasks, self.before_run = runner, tasks, before_run
        self.group_size, self.max_staleness, self.played_under = group_size, max_staleness, played_under
        self.in_flight = _shares(groups_in_flight or 2 * tasks_per_step)
        self.complete = _shares(tasks_per_step)
        if min(self.complete) == 0:
            raise ConfigError(f"rollout.partial: rollout.tasks_per_step={tasks_per_step} gives a host no group "
                              f"to complete on {jax.process_count()} hosts")
        self.next_group = 0  # groups started over the run, all hosts together

    @classmethod
    def of_run(cls, parts: Components, runner: RolloutRunner, tasks) -> "PartialRollouts":
        c, r = parts.config, parts.config.rollout
        played_under = {"family": c.env.family, "max_rounds": int(c.env.max_rounds_train),
                        "group_size": int(r.group_size), "chat_style": c.chat_style,
                        "vocab_size": int(parts.chat.tokenizer.vocab_size),
                        "rollout": {k: r[k] for k in ("max_turn_tokens", "max_len", "max_prompt_len", "max_response_len")}}
        return cls(runner, tasks, group_size=int(r.group_size), tasks_per_step=int(r.tasks_per_step),
                   groups_in_flight=int(r.groups_in_flight), max_staleness=int(r.max_staleness),
                   played_under=played_under, before_run=parts.replica.refresh)

    def step(self, i: int, key, last: bool) -> tuple[list, RolloutStats, dict[str, float]]:
        """Step i's rollout -> (the complete groups' trajectories, every host's, in host order; the
        rollout stats of all hosts; the step record's counts)."""
        runner, p = self.runner, jax.process_index()
        stale = parking.stale_groups(runner.parked, i, self.max_staleness)
        runner.drop_parked(stale)
        parked = len({ep.group_id for ep in runner.parked})
        target = self.complete[p] if last else self.in_flight[p]
        wants = distributed.allgather_objects(max(0, target - parked))
        task_ids = self.tasks.take(sum(wants))
        first = self.next_group + sum(wants[:p])
        self.next_group += sum(wants)
        groups = [(task_ids[sum(wants[:p]) + k], first + k) for k in range(wants[p])]
        schedule = [(t, g) for t, g in groups for _ in range(self.group_size)]
        uids = [g * self.group_size + m for _, g in groups for m in range(self.group_size)]
        self.before_run()
        key = jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key))
        trajs, stats = runner.run(schedule, key, episode_ids=uids, complete_groups=0 if last else self.complete[p],
                                  version=i)
        counts = distributed.allgather_objects((len(stale), len({ep.group_id for ep in runner.parked})))
        record = {"groups_started": float(sum(wants)), "stale_groups_dropped": float(sum(c[0] for c in counts)),
                  "parked_groups": float(sum(c[1] for c in counts))}
        return distributed.gather_shares(trajs), RolloutStats.combined(distributed.allgather_objects(stats)), record

    def release(self) -> None:
        """Gives the parked episodes' environments back (before an evaluation on the same pool)."""
        self.runner.release_parked()

    def state(self) -> dict[str, Any]:
        """The checkpoint's part: every host's parked episodes, the group counter, and what the
        parked episodes were played under (a resumed run with other settings replays them)."""
        hosts = distributed.allgather_objects([parking.episode_state(ep) for ep in self.runner.parked])
        return {"next_group": self.next_group, "hosts": hosts, "played_under": self.played_under}

    def restore(self, state: dict[str, Any]) -> int:
        """Takes this host's parked episodes back; returns how many start again from their reset
        (all, when the settings they were played under changed, the host count included)."""
        self.next_group = int(state["next_group"])
        hosts = state["hosts"]
        continuable = state["played_under"] == self.played_under and len(hosts) == jax.process_count()
        if continuable:
            parked = [parking.episode_from_state(s) for s in hosts[jax.process_index()]]
        else:  # whole groups, dealt over the hosts there are now
            every = [parking.episode_from_state(s) for host in hosts for s in host]
            order = list(dict.fromkeys(ep.group_id for ep in every))
            mine = set(order[jax.process_index()::jax.process_count()])
            parked = [ep for ep in every if ep.group_id in mine]
            for ep in parked:
                ep.restart()
                ep.replays -= 1  # a restart for a changed setting is not a replay of a lost episode
        self.runner.parked = parked
        return 0 if continuable else len(parked)


def staleness(trajs, version: int) -> dict[str, float]:
    """The step record's staleness of the trained tokens: mean and max policy versions behind
    `version` (each sampled token counts with its turn's version)."""
    s = parking.Staleness()
    for t in trajs:
        lengths = [int(e - b) + 1 for b, e in t.action_spans]  # + the closing token
        s.add(t.metadata.get("versions", []), lengths, version)
    return s.record()
