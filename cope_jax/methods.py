"""What is optimized: the method registry (`METHODS`, one table) and the loss hyperparameters.

A method is a set of loss terms plus how its inputs are built:

  term      tokens it reads                         weight channel   coefficient
  pg        action tokens of trajectories           pg_weight        1
  kl        action tokens of trajectories           pg_weight        kl_coef
  entropy   action tokens of trajectories           pg_weight        -entropy_coef
  af        target tokens of forecasting examples   target_weight    af_coef (lambda)
  rft       action tokens of successful rollouts    target_weight    rft_coef
  echo      observation tokens of all trajectories  obs_weight       echo_coef

`advantage` picks the advantage estimator (`cope_jax/advantages.py`), `forecast` and `horizon` tell
`cope_jax/forecasting.py` which examples to build ('plan': history up to o_t + planning request ->
the K+1 realized actions; 'sft': history up to o_t -> the full assistant turn), `trajectories`
which rollouts enter as trajectory sequences. Nothing else in the code branches on the method name.
"""
from __future__ import annotations

import dataclasses

from cope_jax import losses

TERMS = ("pg", "kl", "entropy", "af", "rft", "echo")
POLICY_TERMS = ("pg", "kl", "entropy")  # aggregated with the configured mode over action tokens
ADVANTAGES = ("grpo", "progpo")
FORECAST_KINDS = ("plan", "sft")
AF_MODES = ("joint", "sequential")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str
    terms: tuple[str, ...]
    advantage: str | None = "grpo"   # None: no policy-gradient term
    forecast: str | None = None      # forecasting example kind, None: no examples
    horizon: int | None = None       # K: targets a_t .. a_{t+K}
    trajectories: str = "all"        # 'all' | 'success': rollouts that enter as trajectory rows

    def __post_init__(self):
        unknown = set(self.terms) - set(TERMS)
        if unknown:
            raise ValueError(f"{self.name}: unknown loss terms {sorted(unknown)}")
        if ("pg" in self.terms) != (self.advantage is not None):
            raise ValueError(f"{self.name}: an advantage estimator is needed exactly when 'pg' is a term")
        if self.advantage not in (None, *ADVANTAGES):
            raise ValueError(f"{self.name}: unknown advantage {self.advantage!r}")
        if ("af" in self.terms) != (self.forecast is not None):
            raise ValueError(f"{self.name}: forecasting examples are needed exactly when 'af' is a term")
        if self.forecast not in (None, *FORECAST_KINDS):
            raise ValueError(f"{self.name}: unknown forecast kind {self.forecast!r}")
        if self.forecast is not None and (self.horizon is None or self.horizon < 0):
            raise ValueError(f"{self.name}: forecasting needs a horizon K >= 0")
        if self.trajectories not in ("all", "success"):
            raise ValueError(f"{self.name}: trajectories must be 'all' or 'success'")

    def only(self, terms) -> tuple[str, ...]:
        """This method's terms that are in `terms` (table order)."""
        return tuple(t for t in self.terms if t in terms)


_POLICY = POLICY_TERMS
METHODS: dict[str, MethodSpec] = {m.name: m for m in [
    MethodSpec("grpo", _POLICY),
    MethodSpec("cope", _POLICY + ("af",), forecast="plan", horizon=2),
    MethodSpec("cope_k0", _POLICY + ("af",), forecast="plan", horizon=0),
    MethodSpec("sft_success", _POLICY + ("af",), forecast="sft", horizon=0),
    MethodSpec("echo", _POLICY + ("echo",)),
    MethodSpec("rft", ("rft",), advantage=None, trajectories="success"),
    MethodSpec("progpo", _POLICY, advantage="progpo"),
    MethodSpec("cope+progpo", _POLICY + ("af",), advantage="progpo", forecast="plan", horizon=2),
]}


def get_method(name: str, horizon: int | None = None) -> MethodSpec:
    """The registered method; `horizon` overrides K for forecasting methods (ablations)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    spec = METHODS[name]
    if horizon is not None:
        if spec.forecast != "plan":
            raise ValueError(f"method {name!r} has no forecasting horizon to override")
        spec = dataclasses.replace(spec, horizon=int(horizon))
    return spec


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyperparameters (SPEC 2-4 defaults). Frozen: it is a static argument of the jitted step."""

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
        if self.logits_chunk_tokens is not None and self.logits_chunk_tokens < 1:
            raise ValueError("logits_chunk_tokens must be >= 1")

    def coefficient(self, term: str) -> float:
        """Sign and scale of each term in the minimized objective."""
        return {"pg": 1.0, "kl": self.kl_coef, "entropy": -self.entropy_coef, "af": self.af_coef,
                "rft": self.rft_coef, "echo": self.echo_coef}[term]

    def active_terms(self, terms) -> tuple[str, ...]:
        """`terms` without those switched off by a zero coefficient whose inputs are then never
        computed: kl (no reference log-probs) and entropy (no entropy pass). Their metrics would
        report a KL against zeros and an entropy of 0."""
        off = {"kl"} if self.kl_coef == 0 else set()
        off |= {"entropy"} if self.entropy_coef == 0 else set()
        return tuple(t for t in terms if t not in off)

    def coefficients(self, terms) -> dict[str, float]:
        """{term: coefficient} over all TERMS, 0 for terms not in `terms` (a runtime input of the
        step, so term sets and coefficient schedules share one compiled program)."""
        return {t: self.coefficient(t) if t in terms else 0.0 for t in TERMS}

    def device_part(self) -> "LossConfig":
        """Only the fields the jitted step reads (clipping, temperature, chunking); the rest reset to
        defaults, so configs that differ in host-side weighting or coefficients share executables."""
        return LossConfig(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                          temperature=self.temperature, logits_chunk_tokens=self.logits_chunk_tokens)
