"""A run's ml_collections config -> the typed configs its parts take.

The run (`cope_jax/run/build.py`, `cope_jax/stages/`) and the planner (`cope_jax/plan/`) both read a
config through these functions, so the programs the planner compiles are built from exactly the
settings the run uses.
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections

from cope_jax.batch.forecasting import ForecastConfig
from cope_jax.objective.methods import LossConfig, MethodSpec, get_method
from cope_jax.rollout.runner import RolloutConfig
from cope_jax.train.train_step import OptimizerConfig
from models import presets
from models.config import ConfigError, QwenConfig
from models.lora import PROJECTIONS, LoraConfig, LoraConfigError


WARMSTART_SCHEDULES = ("constant", "cosine")  # warmstart.lr_schedule


def method(c: ml_collections.ConfigDict) -> MethodSpec:
    """The configured method; `train.horizon` < 0 keeps the method's own K."""
    return get_method(c.method, horizon=None if c.train.horizon < 0 else int(c.train.horizon))


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
    t = c.train
    return LossConfig(
        clip_low=t.clip_low, clip_high=t.clip_high, dual_clip=t.dual_clip or None, kl_coef=t.kl_coef,
        entropy_coef=t.entropy_coef, temperature=c.rollout.temperature, aggregation=t.agg_mode,
        af_coef=t.af_coef, af_normalization=t.af_norm, af_mode=t.af_mode, rft_coef=t.rft_coef,
        echo_coef=t.echo_coef, progpo_scale=t.progpo_scale, logits_chunk_tokens=t.logprob_chunk,
        norm_length=int(t.norm_length) or int(c.rollout.max_len), grad_norm_terms=tuple(t.grad_norm_terms),
        rollout_correction=t.rollout_correction, rollout_correction_low=t.rollout_correction_low,
        rollout_correction_high=t.rollout_correction_high, zero_variance=t.zero_variance)


def optimizer_config(c: ml_collections.ConfigDict) -> OptimizerConfig:
    t = c.train
    return OptimizerConfig(learning_rate=t.learning_rate, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                           clip_norm=t.clip_norm, warmup_steps=t.lr_warmup_steps)


def warmstart_configs(c: ml_collections.ConfigDict) -> tuple[LossConfig, OptimizerConfig]:
    """The supervised warm start's loss (method 'warmstart') and optimizer: forecasting examples,
    when `warmstart.af_examples` asks for them, weigh like the demonstrations' actions."""
    ws = c.warmstart
    loss = dataclasses.replace(loss_config(c), rft_coef=1.0, af_coef=1.0 if ws.af_examples else 0.0,
                               af_mode="joint")
    opt = dataclasses.replace(optimizer_config(c), learning_rate=ws.learning_rate,
                              decay_steps=ws.steps if ws.lr_schedule == "cosine" else 0)
    return loss, opt


def rollout_config(c: ml_collections.ConfigDict, kind: str) -> RolloutConfig:
    """The rollout loop's settings for training (`kind` 'train') or evaluation ('eval')."""
    train = kind == "train"
    return RolloutConfig(
        max_rounds=c.env.max_rounds_train if train else c.env.max_rounds_eval,
        max_turn_tokens=c.rollout.max_turn_tokens,
        max_prompt_len=c.rollout.max_prompt_len, max_response_len=c.rollout.max_response_len,
        temperature=c.rollout.temperature if train else c.eval.temperature,
        top_p=c.rollout.top_p, top_k=c.rollout.top_k, greedy=False if train else c.eval.greedy,
        sync=c.rollout.sync, stream_every=c.rollout.stream_every, max_replays=c.env.max_replays)


def forecast_config(c: ml_collections.ConfigDict, family, kind: str, horizon: int) -> ForecastConfig:
    """The forecasting examples of `kind` and `horizon`, laid out for the environment `family`."""
    return ForecastConfig(
        kind=kind, horizon=horizon,
        layout=family.chat_layout,
        skip_invalid=c.train.skip_invalid, skip_no_call=c.train.skip_no_call,
        group_normalized=c.train.af_group_norm)


def execution(c: ml_collections.ConfigDict) -> dict:
    """The QwenConfig execution fields of `config.model`'s base weights: under LoRA they are frozen
    and stored in the compute dtype (no float32 master copy to update)."""
    m = c.model
    base_dtype = m.dtype if lora_config(c) is not None else m.param_dtype
    return dict(dtype=m.dtype, param_dtype=base_dtype, scan_layers=m.scan_layers, remat=m.remat,
                attention=m.attention, attention_block=m.attention_block)


def lora_config(c: ml_collections.ConfigDict) -> LoraConfig | None:
    """`train.lora` as adapters (None: rank unset, full fine-tuning); a bad field is refused."""
    lora = c.train.lora
    if lora.rank is None:  # full fine-tuning: another LoRA field set means a rank was forgotten
        unset = dict(alpha=0.0, dropout=0.0, targets=PROJECTIONS)
        stray = [f"train.lora.{k}" for k, v in unset.items() if (tuple(lora[k]) if k == "targets" else lora[k]) != v]
        if stray:
            raise ConfigError(f"{', '.join(stray)} set without train.lora.rank: give a rank (e.g. "
                              "--config.train.lora.rank=64) to train adapters, or drop them for full fine-tuning")
        return None
    if lora.dropout:
        raise ConfigError(f"train.lora.dropout={lora.dropout}: only 0 is supported (a dropped-out forward would "
                          "give the trained log-probs a different policy than the sampled and old ones)")
    try:
        return LoraConfig(rank=lora.rank, alpha=float(lora.alpha), targets=tuple(lora.targets))
    except LoraConfigError as e:
        raise ConfigError(str(e)) from None


def adapted(c: ml_collections.ConfigDict, cfg: QwenConfig) -> QwenConfig:
    """The trained model's config on the base architecture `cfg`: with `train.lora`'s adapters,
    stored in `model.param_dtype`, or `cfg` itself."""
    lora = lora_config(c)
    return cfg if lora is None else cfg.replace(lora=lora, param_dtype=c.model.param_dtype)


def random_model_config(c: ml_collections.ConfigDict, tokenizer_vocab: int | None) -> QwenConfig:
    """The architecture of `model.init='random'`: the named `model.preset`, or the config's own
    fields (vocab_size 0: the tokenizer's)."""
    m = c.model
    if m.preset:
        return adapted(c, presets.preset_config(m.preset, **execution(c)))
    vocab = m.vocab_size or tokenizer_vocab
    if not vocab:
        raise ConfigError("model.vocab_size is 0 and no tokenizer vocabulary is known")
    return adapted(c, QwenConfig(
        family=m.family, vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        rms_norm_eps=1e-6, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
        qkv_bias=m.family == "qwen2", qk_norm=m.family == "qwen3", **execution(c)))


def sampler_rows(c: ml_collections.ConfigDict, hosts: int) -> int:
    """Rows of each host's sampler: `rollout.sampler_rows`, or with 0 the most episodes of a train step
    one host runs (tasks_per_step x group_size over the hosts, rounded up). Rows a step never fills
    would each hold a whole `max_len` of KV cache for nothing: on a 4-host slice, 128 rows of 16k
    tokens of Qwen2.5-7B are 28 GiB of cache per chip where 32 rows (one host's share) are 7."""
    rows = int(c.rollout.sampler_rows)
    if rows < 0:
        raise ConfigError(f"rollout.sampler_rows={rows}: expected a positive number, or 0 for each host's share")
    return rows or -(-int(c.rollout.tasks_per_step) * int(c.rollout.group_size) // hosts)


# the project's own checkout: a run written here would mix its files into the source tree
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # of cope_jax/run/


def check_workdir(workdir: str | None) -> str:
    """The absolute run directory; refuses an empty one (it would be the current directory) and the
    repository's root."""
    if not workdir or not str(workdir).strip():
        raise ConfigError("--workdir is empty: name a run directory (it is created)")
    path = os.path.abspath(workdir)
    if path == REPO_ROOT:
        raise ConfigError(f"--workdir={workdir} is the repository's root: name a run directory of its own")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir={workdir} exists and is not a directory")
    return path


def check_lengths(c: ml_collections.ConfigDict) -> None:
    """A packed row must hold a whole episode: a shorter `train.row_len` would cut every long one.
    The prompt and response limits are counts (0: off) that together fit the row's `max_len`."""
    r = c.rollout
    if int(c.train.row_len) < int(r.max_len):
        raise ConfigError(f"train.row_len={c.train.row_len} is shorter than rollout.max_len={r.max_len}: "
                          "episodes up to max_len tokens would be cut to fit a row; set row_len >= max_len")
    if min(int(r.max_prompt_len), int(r.max_response_len)) < 0:
        raise ConfigError("rollout.max_prompt_len and rollout.max_response_len must be >= 0 (0: no limit)")
    if r.max_prompt_len and r.max_response_len and r.max_prompt_len + r.max_response_len > r.max_len:
        raise ConfigError(f"rollout.max_prompt_len + max_response_len = {r.max_prompt_len + r.max_response_len} "
                          f"exceeds rollout.max_len={r.max_len}: an episode within both limits would not fit its row")


def max_fault_fraction(c: ml_collections.ConfigDict) -> float:
    """`rollout.max_fault_fraction`: a fraction of a batch's episodes (cope_jax/run/faults.py; its
    range is checked with every other field's, `cope_jax/run/config_check.py`)."""
    return float(c.rollout.max_fault_fraction)


def batch_width(mesh) -> int:
    """Devices a batch's rows are split over (data x fsdp); 1 without a mesh."""
    if mesh is None:
        return 1
    return int(mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))


def rows_per_micro(c: ml_collections.ConfigDict, mesh) -> int:
    """`train.rows_per_micro`, 0 meaning one row per device of the batch axes: fewer rows than that
    are computed on every device of a group (replicated), which wastes the rest."""
    return int(c.train.rows_per_micro) or batch_width(mesh)
