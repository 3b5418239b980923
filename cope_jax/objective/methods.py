"""What is optimized: the loss-term table (`TERMS`), the method registry (`METHODS`) and the loss
hyperparameters (`LossConfig`).

A loss term is one `Term` record: which tokens carry its weight, the host function that turns their
counts into per-token weights (exact aggregation over the whole mini-batch: `cope_jax/objective/losses.py`),
the device function of its loss, its coefficient in the minimized objective, the metrics it
reports and the inputs it needs beyond the log-probs. `cope_jax/batch/batching.py` gives a packed batch
one weight array per term in use; `cope_jax/train/train_step.py` sums `coefficient * loss` over them.

  term      tokens                                   weights                 coefficient
  pg        action tokens of trajectory rows         aggregation mode        1
  kl        action tokens of trajectory rows         aggregation mode        kl_coef
  entropy   action tokens of trajectory rows         aggregation mode        -entropy_coef
  af        target tokens of forecasting examples    1/max(1,|S_x|) / groups af_coef (lambda)
  rft       action tokens of trajectory rows         aggregation mode        rft_coef
  echo      observation tokens of trajectory rows    token mean              echo_coef

A method is a list of terms plus how their inputs are built: `advantage` picks the estimator
(`advantages.py`), `forecast_kind` and `horizon` tell `forecasting.py` which examples
to build ('forecast': history up to o_t + planning request -> the K+1 realized actions; 'sft': history
up to o_t -> the full assistant turn), `trajectories` which rollouts enter as trajectory rows.
Nothing else in the code branches on a method's or a term's name. docs/architecture.md walks
through adding a baseline.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from cope_jax.objective import losses

TOKEN_KINDS = ("action", "observation", "target")   # Term.tokens
NEEDS = ("old_logp", "ref_logp", "entropy")          # Term.needs


@dataclasses.dataclass(frozen=True)
class WeightInputs:
    """What a term's host weight function reads for the S sequences of one mini-batch.

    counts [S]: the term's loss tokens per sequence (after truncation, first token excluded).
    example_weight [S]: each forecasting example's 1/max(1,|S_x|) (target terms only).
    num_groups: the forecasting normalizer's group count (target terms only).
    """

    counts: np.ndarray
    example_weight: np.ndarray | None = None
    num_groups: int = 0


@dataclasses.dataclass(frozen=True)
class Term:
    """One loss term (module docstring).

    weights(inputs: WeightInputs, cfg: LossConfig) -> [S] float32: per-token weight of each sequence.
    loss(logp, entropy, weight, batch, cfg) -> (value, additive metrics): logp / entropy / weight
        [rows, L] in token coordinates; batch the micro-batch (`PackedBatch`) for the other inputs.
    coefficient(cfg) -> float: sign and scale in the minimized objective; 0 switches the term off.
    metrics: prefixes of the metrics the loss reports (shown only while the term is in use).
    needs: inputs besides logp: 'old_logp', 'ref_logp' (a forward pass each), 'entropy'.
    policy: the policy term or one of its regularizers (KL, entropy): `zero_variance='mask'` takes
        the sequences of groups without signal out of these terms (imitation and forecasting keep them).
    """

    name: str
    tokens: str
    weights: Callable
    loss: Callable
    coefficient: Callable
    metrics: tuple[str, ...]
    needs: frozenset = frozenset()
    policy: bool = False  # part of the RL objective on sampled actions (masked on flat groups)

    def __post_init__(self):
        if self.tokens not in TOKEN_KINDS:
            raise ValueError(f"term {self.name}: tokens must be one of {TOKEN_KINDS}")
        if set(self.needs) - set(NEEDS):
            raise ValueError(f"term {self.name}: unknown needs {sorted(set(self.needs) - set(NEEDS))}")


def _sequence_weights(inputs: WeightInputs, cfg) -> np.ndarray:
    return losses.sequence_token_weights(inputs.counts, cfg.aggregation, cfg.norm_length)


def _token_mean(inputs: WeightInputs, cfg) -> np.ndarray:
    return losses.sequence_token_weights(inputs.counts, "token-mean")


def _forecast_weights(inputs: WeightInputs, cfg) -> np.ndarray:
    return losses.forecast_token_weights(inputs.example_weight, inputs.counts, inputs.num_groups,
                                         cfg.af_normalization)


TERMS: dict[str, Term] = {t.name: t for t in [
    Term("pg", "action", _sequence_weights,
         lambda logp, ent, w, b, cfg: losses.clipped_policy_loss(
             logp, b.old_logp, b.advantage, w, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
             dual_clip=cfg.dual_clip),
         lambda cfg: 1.0, ("pg_", "ppo_kl", "sampler_drift", "rollout_"), frozenset({"old_logp"}), policy=True),
    Term("kl", "action", _sequence_weights,
         lambda logp, ent, w, b, cfg: losses.low_var_kl(logp, b.ref_logp, w),
         lambda cfg: cfg.kl_coef, ("kl",), frozenset({"ref_logp"}), policy=True),
    Term("entropy", "action", _sequence_weights,
         lambda logp, ent, w, b, cfg: losses.entropy_bonus(ent, w),
         lambda cfg: -cfg.entropy_coef, ("entropy",), frozenset({"entropy"}), policy=True),
    Term("af", "target", _forecast_weights,
         lambda logp, ent, w, b, cfg: losses.weighted_nll(logp, w, "af"),
         lambda cfg: cfg.af_coef, ("af_",)),
    Term("rft", "action", _sequence_weights,
         lambda logp, ent, w, b, cfg: losses.weighted_nll(logp, w, "rft"),
         lambda cfg: cfg.rft_coef, ("rft_",)),
    Term("echo", "observation", _token_mean,
         lambda logp, ent, w, b, cfg: losses.weighted_nll(logp, w, "echo"),
         lambda cfg: cfg.echo_coef, ("echo_",)),
]}
TERM_ORDER = tuple(TERMS)


def ordered(terms) -> tuple[str, ...]:
    """`terms` in table order (unknown names refused)."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown loss terms {sorted(unknown)}; expected some of {TERM_ORDER}")
    return tuple(t for t in TERM_ORDER if t in terms)


def needing(terms, what: str) -> tuple[str, ...]:
    """The terms among `terms` that need `what` ('old_logp', 'ref_logp', 'entropy')."""
    return tuple(t for t in ordered(terms) if what in TERMS[t].needs)


def reported(metric: str, terms) -> bool:
    """Whether a step metric is shown for a step over `terms`: a term's own metrics only while
    it is in use; the rest (loss, tokens, grad_norm) always."""
    owners = [t for t, term in TERMS.items() if metric.startswith(term.metrics)]
    return not owners or any(t in terms for t in owners)


ADVANTAGES = ("grpo", "progpo")
FORECAST_KINDS = ("forecast", "sft")
AF_MODES = ("joint", "sequential")
ZERO_VARIANCE = ("keep", "mask", "filter")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A registered method: its loss terms (`TERMS` names) and how their inputs are built."""

    name: str
    terms: tuple[str, ...]
    advantage: str | None = "grpo"   # None: no policy-gradient term
    forecast_kind: str | None = None  # forecasting example kind, None: no examples
    horizon: int | None = None       # K: targets a_t .. a_{t+K}
    trajectories: str = "all"        # 'all' | 'success': rollouts that enter as trajectory rows

    def __post_init__(self):
        if ordered(self.terms) != tuple(self.terms):
            raise ValueError(f"{self.name}: terms must be given in table order {TERM_ORDER}")
        if ("pg" in self.terms) != (self.advantage is not None):
            raise ValueError(f"{self.name}: an advantage estimator is needed exactly when 'pg' is a term")
        if self.advantage not in (None, *ADVANTAGES):
            raise ValueError(f"{self.name}: unknown advantage {self.advantage!r}")
        if ("af" in self.terms) != (self.forecast_kind is not None):
            raise ValueError(f"{self.name}: forecasting examples are needed exactly when 'af' is a term")
        if self.forecast_kind not in (None, *FORECAST_KINDS):
            raise ValueError(f"{self.name}: unknown forecast kind {self.forecast_kind!r}")
        if self.forecast_kind is not None and (self.horizon is None or self.horizon < 0):
            raise ValueError(f"{self.name}: forecasting needs a horizon K >= 0")
        if self.trajectories not in ("all", "success"):
            raise ValueError(f"{self.name}: trajectories must be 'all' or 'success'")


_POLICY = ("pg", "kl", "entropy")
METHODS: dict[str, MethodSpec] = {m.name: m for m in [
    MethodSpec("grpo", _POLICY),
    MethodSpec("cope", _POLICY + ("af",), forecast_kind="forecast", horizon=2),
    MethodSpec("cope_k0", _POLICY + ("af",), forecast_kind="forecast", horizon=0),
    MethodSpec("sft_success", _POLICY + ("af",), forecast_kind="sft", horizon=0),
    MethodSpec("echo", _POLICY + ("echo",)),
    MethodSpec("rft", ("rft",), advantage=None, trajectories="success"),
    MethodSpec("progpo", _POLICY, advantage="progpo"),
    MethodSpec("cope+progpo", _POLICY + ("af",), advantage="progpo", forecast_kind="forecast", horizon=2),
    # the supervised warm start on expert demonstrations (all successful): imitation of their actions
    # plus, with `warmstart.af_examples`, forecasting examples in the planning format
    MethodSpec("warmstart", ("af", "rft"), advantage=None, forecast_kind="forecast", horizon=2,
               trajectories="success"),
]}


def get_method(name: str, horizon: int | None = None) -> MethodSpec:
    """The registered method; `horizon` overrides K for forecasting methods (ablations)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    spec = METHODS[name]
    if horizon is not None:
        if spec.forecast_kind != "forecast":
            raise ValueError(f"method {name!r} has no forecasting horizon to override")
        spec = dataclasses.replace(spec, horizon=int(horizon))
    return spec


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyperparameters (method §2-4 defaults). Frozen: it is a static argument of the jitted step."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None         # c = 3.0 when enabled
    kl_coef: float = 1e-3                  # 1e-2 for AppWorld
    entropy_coef: float = 1e-3
    temperature: float = 1.0               # logits / T for logp, ratios and entropy (as sampled)
    aggregation: str = "seq-mean-token-mean"
    norm_length: int | None = None         # horizon of seq-mean-token-sum-norm
    af_coef: float = 0.01                  # lambda
    af_normalization: str = "success_groups"
    af_mode: str = "joint"
    rft_coef: float = 1.0
    echo_coef: float = 0.01
    progpo_scale: float = 0.3
    logits_chunk_tokens: int | None = 512   # tokens per logits chunk; None = full logits (benchmarks)
    # terms whose own gradient norm each step reports (`grad_norm_<term>`, before clipping): one more
    # forward and backward pass each over the micro-batches holding its tokens, so only when asked
    grad_norm_terms: tuple[str, ...] = ()
    # the sampler / trainer mismatch corrected per token in the terms that read old_logp
    # (`losses.rollout_correction`): 'none', 'tis' (weights capped at high) or 'mis' (tokens outside
    # [low, high] masked)
    rollout_correction: str = "none"
    # groups whose advantages are all zero (`advantages.flat_groups`): 'keep' them, 'mask' them out of
    # the policy terms (host side), or 'filter' them out of the batch (the RL loop refills it)
    zero_variance: str = "keep"
    rollout_correction_low: float = 0.5
    rollout_correction_high: float = 2.0

    def __post_init__(self):
        if self.aggregation not in losses.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; expected one of {losses.AGGREGATIONS}")
        if self.aggregation == "seq-mean-token-sum-norm" and not self.norm_length:
            raise ValueError("aggregation seq-mean-token-sum-norm needs norm_length")
        if self.af_normalization not in losses.FORECAST_NORMALIZATIONS:
            raise ValueError(f"unknown af_normalization {self.af_normalization!r}")
        if self.af_mode not in AF_MODES:
            raise ValueError(f"unknown af_mode {self.af_mode!r}; expected one of {AF_MODES}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.zero_variance not in ZERO_VARIANCE:
            raise ValueError(f"unknown zero_variance {self.zero_variance!r}; expected one of {ZERO_VARIANCE}")
        if self.rollout_correction not in losses.ROLLOUT_CORRECTIONS:
            raise ValueError(f"unknown rollout_correction {self.rollout_correction!r}; "
                             f"expected one of {losses.ROLLOUT_CORRECTIONS}")
        if not 0 <= self.rollout_correction_low <= 1 <= self.rollout_correction_high:
            raise ValueError(f"rollout correction band [{self.rollout_correction_low}, "
                             f"{self.rollout_correction_high}] must hold 1 (0 <= low <= 1 <= high)")
        if self.logits_chunk_tokens is not None and self.logits_chunk_tokens < 1:
            raise ValueError("logits_chunk_tokens must be >= 1")
        object.__setattr__(self, "grad_norm_terms", ordered(self.grad_norm_terms))

    def coefficient(self, term: str) -> float:
        """Sign and scale of a term in the minimized objective (`Term.coefficient`)."""
        return float(TERMS[term].coefficient(self))

    def active_terms(self, terms) -> tuple[str, ...]:
        """`terms` (table order) without those a zero coefficient switches off: their weights,
        inputs (reference log-probs, the entropy pass, forecasting examples) and metrics are never
        computed. (Kept, a zero-coefficient KL would report a KL against zeros.)"""
        return tuple(t for t in ordered(terms) if self.coefficient(t) != 0)

    def coefficients(self, terms) -> dict[str, float]:
        """{term: coefficient} of the active `terms`: a runtime input of the step, so coefficient
        schedules share one compiled program."""
        return {t: self.coefficient(t) for t in self.active_terms(terms)}

    def device_part(self) -> "LossConfig":
        """Only the fields the jitted step reads (clipping, temperature, chunking); the rest reset to
        defaults, so configs that differ in host-side weighting or coefficients share executables."""
        return LossConfig(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                          temperature=self.temperature, logits_chunk_tokens=self.logits_chunk_tokens,
                          grad_norm_terms=self.grad_norm_terms, rollout_correction=self.rollout_correction,
                          rollout_correction_low=self.rollout_correction_low,
                          rollout_correction_high=self.rollout_correction_high)
