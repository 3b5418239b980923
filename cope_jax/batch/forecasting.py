"""Action-forecasting (and success-filtered imitation) examples from successful trajectories (method §3).

Every example starts from a *prefix of the recorded token ids* of a successful episode, the history
up to and including observation o_t (everything before the generation prompt of action t), so the
history is never re-tokenized, and examples of one episode share it (`prefix_len`: the train step
packs their histories once, as one tree; `cope_jax/batch/batching.py`). What follows depends on the kind:

- 'forecast' (CoPE): a user turn with the planning request of appendix C.6, then the realized actions
  a_t .. a_{t+K} as the target. ReAct layout: one assistant turn, one action per line.
  tool_calling layout (tau2): one assistant turn per action, separated by `Next action?` user turns
  that carry no loss.
- 'sft' (`sft_success`): no planning request; the target is the assistant turn the policy actually
  sampled at step t (its exact ids, including `<|im_end|>`).

Decisions where the paper is silent (kept in one place, here):
- Target actions are the parsed action strings (`Trajectory.actions`). An unparseable step (None)
  has no action string and is never a target. Without `skip_invalid`, examples are built only for
  steps t whose own action a_t is a target (the request says "starting with the action you take
  right now"); the window a_t .. a_{t+K} is clamped at the episode end and filtered, never padded,
  and `{k}` is the number of targets that remain.
- `skip_invalid` (the invalid-action filter of the paper's section 8, method §3.4): an action the
  environment rejected (`Trajectory.rejected`, from its step info) is no target; each rejected
  target is *replaced by the next valid action of the episode*: the window from step t is the first
  K+1 valid actions at or after t, so it keeps K+1 targets where the episode has them, and a step
  whose own action was rejected still gets its example, with the refilled target (K=0: the next
  valid action). A step with no valid action at or after it has none. For 'sft' examples the target
  is the step's own sampled turn, which a refill would change into another step's: rejected steps
  are dropped there.
- A target turn is laid out as the sampler would produce it: the generation prompt
  `<|im_start|>assistant\\n`, then the target text encoded on its own, then `<|im_end|>`; the loss
  covers the text and the `<|im_end|>`.
- Weight: 1 / max(1, |S_x|) with |S_x| the number of successful rollouts in the trajectory's group
  among the trajectories passed in (one train batch); `group_normalized=False` (the paper's
  ablation, section 8) gives every example weight 1, so a group's share grows with its successes.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cope_jax.objective.advantages import forecast_weights
from cope_jax.rollout.chat import ChatFormat
from cope_jax.rollout.trajectory import ForecastExample, Trajectory

PLAN_REQUEST = {
    "react": ("Plan ahead: list the next {k} actions you will take to make progress on the task, "
              "starting with the action you take right now, one action per line."),
    "tool_calling": ("Plan ahead: give the next {k} actions you will take to make progress on the task, one "
             "action per reply, starting with the action you take right now. Reply with the action only."),
}
NEXT_ACTION = "Next action?"
LAYOUTS = tuple(PLAN_REQUEST)
TOOL_CALL_OPEN = "<tool_call>"


@dataclasses.dataclass(frozen=True)
class ForecastConfig:
    kind: str = "forecast"  # 'forecast' | 'sft'
    horizon: int = 2  # K: targets a_t .. a_{t+K}
    layout: str = "react"  # the family's chat_layout: 'react' | 'tool_calling'
    skip_invalid: bool = False  # refill rejected targets with the next valid action (module docstring)
    skip_no_call: bool = False  # tau2: drop an example when none of its targets calls a tool
    group_normalized: bool = True  # weight 1/max(1,|S_x|); False: 1 (ablation)

    def __post_init__(self):
        if self.kind not in ("forecast", "sft"):
            raise ValueError(f"forecast kind must be 'forecast' or 'sft', got {self.kind!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"forecast layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.horizon < 0:
            raise ValueError(f"horizon K must be >= 0, got {self.horizon}")


def build_examples(trajectories: Sequence[Trajectory], chat: ChatFormat,
                   cfg: ForecastConfig) -> list[ForecastExample]:
    """All examples of one train batch; trajectory indices refer to `trajectories`."""
    weights = forecast_weights([t.success for t in trajectories], [t.group_id for t in trajectories])
    if not cfg.group_normalized:
        weights = np.ones(len(trajectories))
    out: list[ForecastExample] = []
    for index, (traj, weight) in enumerate(zip(trajectories, weights)):
        if not traj.success:
            continue
        windows = target_windows(traj, cfg)
        for t, window in enumerate(windows):
            if not window:
                continue
            if cfg.kind == "sft":
                tokens, mask = _sft_example(traj, t, chat)
                # the branch starts one token before the target, which it then predicts
                shared = int(traj.action_spans[t][0]) - 1
            else:
                targets = [traj.actions[j] for j in window]
                if cfg.skip_no_call and not any(TOOL_CALL_OPEN in a for a in targets):
                    continue
                tokens, mask = _plan_example(traj, t, targets, chat, cfg.layout)
                shared = len(history_prefix(traj, t, chat))
            out.append(ForecastExample(tokens=tokens, target_mask=mask, weight=float(weight), group_id=traj.group_id,
                                       source=index, step=t, kind=cfg.kind, prefix_len=max(shared, 0)))
    return out


def history_prefix(traj: Trajectory, t: int, chat: ChatFormat) -> np.ndarray:
    """The episode's ids up to and including observation o_t (before action t's generation prompt)."""
    start = int(traj.action_spans[t][0]) - len(chat.generation_prompt())
    if start < 0:
        raise ValueError(f"action {t} starts at {traj.action_spans[t][0]}, before any generation prompt")
    return traj.tokens[:start]


def target_windows(traj: Trajectory, cfg: ForecastConfig) -> list[list[int]]:
    """Per step t, the steps whose actions are its example's targets ([]: no example at t). An
    action is a target only where it parsed and the policy is trained on it: a demonstration's
    context-only reply (`demos.py`'s deliberate mistake) is never one, with or without skip_invalid."""
    n = traj.num_steps
    parsed = [j < len(traj.actions) and traj.actions[j] is not None and traj.is_trained(j) for j in range(n)]
    if not cfg.skip_invalid:
        return [[j for j in range(t, min(t + cfg.horizon + 1, n)) if parsed[j]] if parsed[t] else []
                for t in range(n)]
    valid = [j for j in range(n) if parsed[j] and not traj.was_rejected(j)]
    if cfg.kind == "sft":
        return [[t] if t in valid else [] for t in range(n)]
    return [[j for j in valid if j >= t][:cfg.horizon + 1] for t in range(n)]


def _assistant_target(text: str, chat: ChatFormat) -> tuple[list[int], list[bool]]:
    prompt = chat.generation_prompt()
    body = chat.tokenizer.encode(text) + [chat.im_end_id]
    tail = chat.end_of_turn()
    return prompt + body + tail, [False] * len(prompt) + [True] * len(body) + [False] * len(tail)


def _plan_example(traj, t, targets, chat, layout):
    ids = list(history_prefix(traj, t, chat))
    mask = [False] * len(ids)
    request = chat.turn("user", PLAN_REQUEST[layout].format(k=len(targets))).ids
    ids += request
    mask += [False] * len(request)
    turns = ["\n".join(targets)] if layout == "react" else targets
    for i, text in enumerate(turns):
        if i:
            sep = chat.turn("user", NEXT_ACTION).ids
            ids += sep
            mask += [False] * len(sep)
        t_ids, t_mask = _assistant_target(text, chat)
        ids += t_ids
        mask += t_mask
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def _sft_example(traj, t, chat):
    """History up to o_t, then the assistant turn exactly as sampled (content + `<|im_end|>`)."""
    start = int(traj.action_spans[t][0])
    stop = start
    while stop < len(traj.tokens) and traj.action_mask[stop]:
        stop += 1
    ids = np.concatenate([traj.tokens[:stop], np.asarray(chat.end_of_turn(), np.int32)])
    mask = np.zeros(len(ids), bool)
    mask[start:stop] = True
    return ids, mask
