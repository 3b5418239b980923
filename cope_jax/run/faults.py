"""Environment faults: episodes ended by a crashed, hung or raising environment, not by the agent.

A fault says nothing about the policy, so it is neither a success nor a failure: `drop` takes those
episodes out of a batch before anything learns from or reports on it (forecasting examples,
advantages, the loss, success rates). Their group's statistics are computed over the episodes that
finished; a group left with one episode is method §2.1's group of one (A = Y); a group left with none
contributes nothing. Every fault is counted per reason (`FaultReport.record`: the step record,
TensorBoard, the progress bar) and logged once per worker and reason. A batch where more than
`max_fraction` of the episodes faulted raises `FaultError` instead of training or evaluating on the
rest: that many faults is a broken environment, and what finished would be a biased sample.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

from cope_jax.rollout.trajectory import Trajectory

PREFIX = "env_"  # finish reasons of faults: env_crashed, env_timeout, env_env_error, env_start_failed


class FaultError(RuntimeError):
    """Too many episodes of a batch ended by environment faults."""


def is_fault(t: Trajectory) -> bool:
    return t.finish_reason.startswith(PREFIX)


@dataclasses.dataclass
class FaultReport:
    """Faulted episodes of one batch, by finish reason."""

    episodes: int
    by_reason: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def record(self) -> dict[str, float]:
        """`env_faults` always (a curve that stays at 0 says something too), one count per reason."""
        return {"env_faults": float(self.total), **{k: float(v) for k, v in sorted(self.by_reason.items())}}


def drop(trajectories: Sequence[Trajectory], max_fraction: float, what: str = "batch"
         ) -> tuple[list[Trajectory], FaultReport]:
    """-> (the episodes that finished, in order; the report). Raises FaultError past max_fraction."""
    faults = [t for t in trajectories if is_fault(t)]
    report = FaultReport(len(trajectories), dict(collections.Counter(t.finish_reason for t in faults)))
    _warn(faults, what)
    if faults and len(faults) > max_fraction * len(trajectories):
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(report.by_reason.items()))
        raise FaultError(f"{len(faults)} of {len(trajectories)} episodes of this {what} ended by environment "
                         f"faults ({reasons}), more than rollout.max_fault_fraction={max_fraction:g}; "
                         f"first: {_describe(faults[0])}")
    return [t for t in trajectories if not is_fault(t)], report


def _warn(faults: Sequence[Trajectory], what: str) -> None:
    by_worker = collections.defaultdict(list)
    for t in faults:
        by_worker[(t.metadata.get("env", {}).get("worker_pid"), t.finish_reason)].append(t)
    for (pid, reason), ts in by_worker.items():
        logging.warning("%d episode(s) of this %s left out: %s on environment worker pid %s (first: task %s): %s",
                        len(ts), what, reason, pid, ts[0].task_id, ts[0].metadata.get("env", {}).get("reason", "")[:300])


def _describe(t: Trajectory) -> str:
    env = t.metadata.get("env", {})
    replays = t.metadata.get("replays", 0)
    return (f"{t.finish_reason} on environment worker pid {env.get('worker_pid')} (task {t.task_id}"
            f"{f', after {replays} replays' if replays else ''}): {env.get('reason', '')[:200]}")
