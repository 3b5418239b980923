"""Host-side records of one episode (`Trajectory`) and one forecasting example (`ForecastExample`).

Both hold token ids exactly as the model saw or produced them (method §1): assistant content tokens
are the sampler's ids, observation text is encoded once when appended, nothing is re-tokenized for
training. All per-token arrays are numpy and share the length of `tokens`; every mask marks the
*token itself* (e.g. `action_mask[t] = 1` means token t was sampled), not the position predicting it.

The rollout loop fills `Trajectory`; `cope_jax/batch/forecasting.py` builds `ForecastExample`s from the
successful ones; `cope_jax/batch/batching.py` turns both into packed training rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


def _spans(value, name: str, length: int) -> np.ndarray:
    spans = np.asarray(value, np.int32).reshape(-1, 2)
    if spans.size and (spans.min() < 0 or spans.max() > length or np.any(spans[:, 0] > spans[:, 1])):
        raise ValueError(f"{name}: every span must satisfy 0 <= start <= end <= {length}, got {spans.tolist()}")
    return spans


def _per_token(value, name: str, length: int, dtype) -> np.ndarray:
    arr = np.zeros(length, dtype) if value is None else np.asarray(value)
    if arr.shape != (length,):
        raise ValueError(f"{name} has shape {arr.shape}; expected ({length},) like tokens")
    return arr.astype(dtype, copy=False)


@dataclasses.dataclass(eq=False)
class Trajectory:
    """One episode as one token sequence in the chat format.

    tokens:           int32 [T]  the whole episode (instruction, acknowledgement, then alternating
                                  observation and action turns).
    action_mask:      bool [T]   sampled assistant tokens, including the closing `<|im_end|>`.
    obs_mask:         bool [T]   observation content tokens (the ECHO target).
    sampler_logp:     float32 [T] the sampler's logprob of each sampled token (0 elsewhere); kept for
                                  the sampler/trainer drift metric only.
    action_spans:     int32 [n_actions, 2] [start, end) token range of each assistant turn's content.
    observation_spans: int32 [n_obs, 2] [start, end) token range of each observation's content;
                                  observation i is o_i (o_0 = the first observation after the
                                  instruction).
    actions:          parsed action of each assistant turn (None when the reply did not parse).
    observations:     observation strings o_0 .. o_T (ProGPO's coverage reads them).
    rejected:         per action, whether the environment rejected it (its step info's `invalid`:
                      unparseable, or not applicable in the state); the forecasting filter
                      `skip_invalid` reads it. Missing entries (an unanswered last action): False.
    score, success:   raw environment score and the outcome Y (method §5).
    task_id, group_id: the task, and the rollout group (the n rollouts of one task in one batch).
    family:           sub-task family for per-family metrics.
    finish_reason:    why the episode ended ('done', 'max_rounds', 'context_full', 'env_error', ...).
    metadata:         anything else the environment reports (the trainer reads only its fault
                      details, for warnings: `cope_jax/run/faults.py`).
    """

    tokens: np.ndarray
    action_mask: np.ndarray
    obs_mask: np.ndarray
    sampler_logp: np.ndarray | None = None
    action_spans: np.ndarray | None = None
    observation_spans: np.ndarray | None = None
    actions: list[str | None] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    rejected: list[bool] = dataclasses.field(default_factory=list)
    score: float = 0.0
    success: bool = False
    task_id: int = -1  # -1: not from an environment task (hand-built)
    group_id: int = 0
    family: str = ""
    finish_reason: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        n = len(self.tokens)
        self.action_mask = _per_token(self.action_mask, "action_mask", n, bool)
        self.obs_mask = _per_token(self.obs_mask, "obs_mask", n, bool)
        if np.any(self.action_mask & self.obs_mask):
            raise ValueError("a token cannot be both an action and an observation token")
        self.sampler_logp = _per_token(self.sampler_logp, "sampler_logp", n, np.float32)
        self.action_spans = _spans([] if self.action_spans is None else self.action_spans, "action_spans", n)
        self.observation_spans = _spans([] if self.observation_spans is None else self.observation_spans,
                                        "observation_spans", n)
        self.success = bool(self.success)
        self.score = float(self.score)
        self.group_id = int(self.group_id)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_steps(self) -> int:
        """T in the paper: the number of actions taken."""
        return len(self.action_spans)

    def is_trained(self, step: int) -> bool:
        """Whether action `step`'s tokens are action tokens: False for a context-only reply (an
        expert demonstration's deliberate mistake); True where no span says otherwise."""
        start, end = (int(x) for x in self.action_spans[step])
        return end <= start or bool(self.action_mask[start:end].any())

    def was_rejected(self, step: int) -> bool:
        """Whether the environment rejected action `step` (`rejected`)."""
        return step < len(self.rejected) and bool(self.rejected[step])


@dataclasses.dataclass(eq=False)
class ForecastExample:
    """One forecasting (or success-filtered imitation) sequence built from a successful trajectory.

    tokens:      int32 [T]  history up to o_t, the planning request (or none for `sft_success`), and
                            the target assistant turn(s).
    target_mask: bool [T]   tokens that carry the loss (the target turns' content and `<|im_end|>`).
    weight:      group normalization 1 / max(1, |S_x|) of the source trajectory's group (method §3).
    group_id:    the source trajectory's rollout group.
    source:      index of the source trajectory in the train batch it was built from.
    step:        the action step t whose history the example starts from.
    kind:        how it was built ('forecast' = CoPE forecasting, 'sft' = success-filtered imitation).
    prefix_len:  tokens[:prefix_len] are the source trajectory's first tokens, shared with its other
                 examples (packed once, `cope_jax/batch/batching.py`); no target among them or right
                 after them (the first token past a shared prefix has no prediction in a packed tree).
    """

    tokens: np.ndarray
    target_mask: np.ndarray
    weight: float
    group_id: int
    source: int
    step: int
    kind: str = "forecast"
    prefix_len: int = 0

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        self.target_mask = _per_token(self.target_mask, "target_mask", len(self.tokens), bool)
        self.weight = float(self.weight)
        if not np.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {self.weight}")
        self.group_id = int(self.group_id)
        self.prefix_len = int(self.prefix_len)
        if not 0 <= self.prefix_len < len(self.tokens):
            raise ValueError(f"prefix_len {self.prefix_len} outside [0, {len(self.tokens)})")
        if self.prefix_len and self.target_mask[:self.prefix_len + 1].any():
            raise ValueError(f"a target within the shared prefix (or right after it, at {self.prefix_len})")

    def __len__(self) -> int:
        return len(self.tokens)
