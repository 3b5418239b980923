"""Every config value checked once, before a run touches its workdir (`check`).

In order: the fields are those of `configs/base.py` (a misspelt one is named with the field it was
probably meant to be), each value has its field's type, lies in its declared range or set (`RULES`),
and the cross-field rules and typed configs the run builds (`cope_jax/run/run_config.py`) accept
it. Each refusal is one `ConfigError` line naming the field, its value and what is expected.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

import ml_collections

from configs.base import base_config
from cope_jax.objective.losses import ROLLOUT_CORRECTIONS
from cope_jax.objective.methods import AF_MODES, ZERO_VARIANCE
from cope_jax.rollout.chat import STYLES
from cope_jax.run import run_config
from envs.registry import FAMILIES
from models.attention import IMPLEMENTATIONS
from models.config import ConfigError
from models.qwen import REMAT_POLICIES

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Range:
    """A number in [low, high] (None: unbounded); `whole`: an integer; `multiple`: of it."""

    low: float | None = None
    high: float | None = None
    whole: bool = True
    what: str = ""  # how the message names it (default: a whole number / a number)
    multiple: int = 1

    def problem(self, value: Any) -> str | None:
        inside = (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        whole = not self.whole or float(value).is_integer()
        if inside and whole and (self.multiple == 1 or value % self.multiple == 0):
            return None
        kind = self.what or ("a whole number" if self.whole else "a number")
        if self.low is not None and self.high is not None:
            return f"expected {kind} in [{self.low:g}, {self.high:g}]"
        return f"expected {kind} >= {self.low:g}" if self.low is not None else f"expected {kind} <= {self.high:g}"


@dataclasses.dataclass(frozen=True)
class OneOf:
    choices: tuple

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else f"expected one of {', '.join(map(repr, self.choices))}"


FAMILIES_WITH_A_CUSTOMER = {"tau2": "'llm' (the paper's) or 'gold' (scripted, for tests)"}
COUNT, SIZE, NONNEG = Range(1), Range(0), Range(0, whole=False)  # SIZE: 0 means "derived" or "off"
FRACTION = Range(0, 1, whole=False, what="a fraction")

# field -> its range or set; 0 is allowed where the field's comment gives 0 a meaning
RULES: dict[str, Range | OneOf] = {
    "seed": SIZE,
    "model.init": OneOf(("pretrained", "random")),
    "model.dtype": OneOf(DTYPES), "model.param_dtype": OneOf(DTYPES),
    "model.remat": OneOf(tuple(REMAT_POLICIES)), "model.attention": OneOf(IMPLEMENTATIONS),
    "model.attention_block": Range(8, multiple=8, what="a multiple of 8"), "model.family": OneOf(("qwen2", "qwen3")),
    **{f"model.{k}": SIZE for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                     "num_heads", "num_kv_heads", "head_dim")},
    "model.rope_theta": Range(0, whole=False),
    "chat_style": OneOf(tuple(STYLES)),
    "env.family": OneOf(tuple(sorted(FAMILIES))),
    "env.workers": COUNT, "env.envs_per_worker": SIZE, "env.max_rounds_train": COUNT,
    "env.max_rounds_eval": COUNT, "env.call_timeout": NONNEG, "env.max_replays": SIZE,
    "env.user.kind": OneOf(("", "gold", "llm")), "env.user.temperature": NONNEG,
    "env.user.timeout": Range(1, whole=False),
    "rollout.tasks_per_step": COUNT, "rollout.group_size": COUNT, "rollout.max_turn_tokens": COUNT,
    "rollout.temperature": NONNEG, "rollout.top_p": Range(0, 1, whole=False), "rollout.top_k": SIZE,
    "rollout.max_len": Range(2), "rollout.max_prompt_len": SIZE, "rollout.max_response_len": SIZE,
    "rollout.sampler_rows": SIZE, "rollout.stream_every": COUNT, "rollout.max_fault_fraction": FRACTION,
    "rollout.groups_in_flight": SIZE, "rollout.max_staleness": SIZE,
    "train.steps": SIZE, "train.learning_rate": NONNEG, "train.weight_decay": NONNEG,
    "train.clip_norm": NONNEG, "train.b1": Range(0, 1, whole=False), "train.b2": Range(0, 1, whole=False),
    "train.lr_warmup_steps": SIZE, "train.minibatch_tasks": COUNT, "train.row_len": COUNT,
    "train.rows_per_micro": SIZE, "train.clip_low": NONNEG, "train.clip_high": NONNEG,
    "train.dual_clip": NONNEG, "train.kl_coef": NONNEG, "train.entropy_coef": NONNEG,
    "train.af_coef": NONNEG, "train.af_mode": OneOf(AF_MODES), "train.horizon": Range(-1),
    "train.echo_coef": NONNEG, "train.rft_coef": NONNEG, "train.progpo_scale": NONNEG,
    "train.logprob_chunk": COUNT, "train.norm_length": SIZE,
    "train.rollout_correction": OneOf(ROLLOUT_CORRECTIONS), "train.rollout_correction_low": FRACTION,
    "train.rollout_correction_high": Range(1, whole=False),
    "train.zero_variance": OneOf(ZERO_VARIANCE), "train.refill_rounds": SIZE,
    "warmstart.steps": SIZE, "warmstart.learning_rate": NONNEG, "warmstart.batch_episodes": COUNT,
    "warmstart.tasks": SIZE, "warmstart.af_examples": SIZE,
    "warmstart.lr_schedule": OneOf(run_config.WARMSTART_SCHEDULES),
    "warmstart.mistakes": FRACTION, "warmstart.dawdle": FRACTION,
    "eval.every": SIZE, "eval.tasks": SIZE, "eval.samples": COUNT, "eval.temperature": NONNEG,
    "checkpoint.every": COUNT, "checkpoint.keep": COUNT,
}


def check(c: ml_collections.ConfigDict) -> None:
    """Refuses (ConfigError) the first field of `c` that a run cannot take (module docstring)."""
    values, shipped = flat(c), flat(base_config(c.method))
    for field in values:
        if field not in shipped:
            raise ConfigError(f"config.{field}: no such field{_did_you_mean(field, shipped)}")
    for field, value in values.items():
        expected = shipped[field]
        if not _same_type(value, expected):
            raise ConfigError(f"config.{field}={value!r}: expected type {type(expected).__name__} (like {expected!r})")
        rule = RULES.get(field)
        problem = rule.problem(value) if rule is not None and value is not None else None
        if problem:
            shown = f"{value:g}" if isinstance(value, float) else repr(value)
            raise ConfigError(f"config.{field}={shown}: {problem}")
    _cross_field(c)


def _cross_field(c: ml_collections.ConfigDict) -> None:
    """The rules between fields, and the typed configs the run builds from them."""
    run_config.check_lengths(c)
    run_config.lora_config(c)
    customer = FAMILIES_WITH_A_CUSTOMER.get(c.env.family)
    if customer and not c.env.user.kind:
        raise ConfigError(f"env.user.kind is empty: {c.env.family} runs each episode against a simulated "
                          f"customer: {customer}")
    if c.env.user.kind and not customer:
        raise ConfigError(f"env.user.kind={c.env.user.kind!r}: {c.env.family} has no simulated customer")
    try:  # the tables these read validate their own names (loss terms, advantage, aggregation)
        spec = run_config.method(c)
        run_config.loss_config(c)
        run_config.optimizer_config(c)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _partial(c)
    if c.train.zero_variance != "keep" and spec.advantage is None:
        raise ConfigError(f"train.zero_variance={c.train.zero_variance!r}: method {c.method!r} has no group-relative "
                          f"advantage, so no group is without signal (use 'keep')")


def _partial(c: ml_collections.ConfigDict) -> None:
    """Partial rollouts train on tokens of older policies: they need the rollout correction, and
    the zero-variance filter's refill rounds would play groups outside the in-flight ones."""
    r = c.rollout
    if not r.partial:
        return
    if c.train.rollout_correction == "none":
        raise ConfigError("rollout.partial trains on tokens sampled by older policies: set "
                          "train.rollout_correction to 'tis' or 'mis' (docs/training.md)")
    if c.train.zero_variance == "filter":
        raise ConfigError("rollout.partial with train.zero_variance='filter' is not supported: use 'keep'")
    if r.groups_in_flight and r.groups_in_flight < r.tasks_per_step:
        raise ConfigError(f"rollout.groups_in_flight={r.groups_in_flight} is under rollout.tasks_per_step="
                          f"{r.tasks_per_step}: a step could never complete its groups")


def flat(c: ml_collections.ConfigDict | dict) -> dict[str, Any]:
    """{"train.row_len": 768, ...}: every leaf of a config (or of its JSON) by its dotted path."""
    out = {}

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(c if isinstance(c, dict) else json.loads(c.to_json()), "")
    return out


def _same_type(value: Any, expected: Any) -> bool:
    if value is None or expected is None:  # placeholders (train.lora.rank) and unset values
        return True
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool)
    if isinstance(expected, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(expected))


def _did_you_mean(field: str, known) -> str:
    close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
    return f" (did you mean config.{close[0]}?)" if close else ""
