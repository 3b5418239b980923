"""`build(config, workdir) -> Components`: everything a run's stages (`cope_jax/stages/`) work with.

Everything that can refuse the run is checked first, before anything is started or written, so a
failed start leaves the workdir as it was (reusable with the corrected flags). Then the run starts:
the environment pool, the tokenizer (the demo's is trained by process 0 on expert episodes played
through that pool and saved in the workdir), the policy and its sampling replica, the sampler;
config.json is written last, once the run has started.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

import models
from models import model_dir
from models.config import ConfigError
from cope_jax.run import distributed, files, run_config
from cope_jax.run import metrics as metrics_lib
from cope_jax.rollout.chat import ChatFormat
from cope_jax.run.demos import play_actions
from cope_jax.run.faults import FaultError
from cope_jax.learning.forecasting import ForecastConfig
from cope_jax.learning.methods import LossConfig, MethodSpec
from cope_jax.run.replica import SamplingReplica
from cope_jax.rollout.sampler import Sampler
from cope_jax.rollout.tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from cope_jax.learning.train_step import OptimizerConfig
from envs.pool import EnvPool
from envs.registry import make_family

TOKENIZER_FILE = "tokenizer.model"
CORPUS_TASKS = 200  # train tasks whose expert episodes the demo tokenizer is trained on


@dataclasses.dataclass
class Components:
    """One run in `workdir`: its settings, environments, policy and logs."""

    config: ml_collections.ConfigDict
    workdir: str
    is_main: bool  # process 0: writes the logs and files every process shares
    spec: MethodSpec
    loss_cfg: LossConfig
    opt_cfg: OptimizerConfig
    forecast_cfg: ForecastConfig | None  # the method's forecasting examples (None: it has none)
    max_fault_fraction: float
    family: Any  # the environment family's static side (envs/base.py)
    pool: EnvPool
    tokenizer: Any
    chat: ChatFormat
    mesh: Any
    model: Any  # the policy
    replica: SamplingReplica  # this host's sampling copy of the policy
    sampler: Sampler
    log: metrics_lib.MetricsLog

    def close(self) -> None:
        self.pool.close()
        self.log.close()


def build(config: ml_collections.ConfigDict, workdir: str) -> Components:
    """Checks `config` and `workdir` (module docstring), then starts the run; `close()` the result."""
    c = config
    workdir = run_config.check_workdir(workdir)
    is_main = jax.process_index() == 0
    saved_config = _saved_config(c, workdir)
    run_config.check_warmstart(c)
    spec = run_config.method(c)
    loss_cfg, opt_cfg = run_config.loss_config(c), run_config.optimizer_config(c)
    max_fault_fraction = run_config.max_fault_fraction(c)
    run_config.check_lengths(c)
    family = make_family(c.env.family)
    forecast_cfg = None
    if spec.forecast_kind is not None and "af" in loss_cfg.active_terms(spec.terms):  # af_coef 0: no examples
        forecast_cfg = run_config.forecast_config(c, family, spec.forecast_kind, spec.horizon)
    _check_model_path(c)
    run_config.lora_config(c)
    _check_tokenizer(c, family)
    mesh = distributed.run_mesh(tuple(c.mesh))
    rows = run_config.sampler_rows(c, jax.process_count())
    # every check passed: the run starts
    pool = _pool(c, rows)
    try:
        tokenizer = _tokenizer(c, family, pool, workdir, is_main)
        chat = ChatFormat(tokenizer, c.chat_style)
        model = _model(c, tokenizer, mesh)
        # each host samples with a copy of the policy laid out for decoding on its own devices
        replica = SamplingReplica(model, mesh, rows=rows, max_len=c.rollout.max_len)
        sampler = Sampler(replica.model, batch_size=rows, max_len=c.rollout.max_len, eos_ids=tokenizer.eos_ids)
    except BaseException:
        pool.close()
        raise
    if saved_config is None and is_main:
        files.write_json(os.path.join(workdir, "config.json"), json.loads(c.to_json()), indent=2, sort_keys=True)
    log = metrics_lib.MetricsLog(workdir, enabled=is_main)
    return Components(config=c, workdir=workdir, is_main=is_main, spec=spec, loss_cfg=loss_cfg, opt_cfg=opt_cfg,
                      forecast_cfg=forecast_cfg, max_fault_fraction=max_fault_fraction, family=family, pool=pool,
                      tokenizer=tokenizer, chat=chat, mesh=mesh, model=model, replica=replica, sampler=sampler,
                      log=log)


# -- checks ------------------------------------------------------------------------------------------
_MISSING = object()


def _saved_config(c: ml_collections.ConfigDict, workdir: str) -> dict | None:
    """The workdir's config.json, if any. A workdir belongs to one config: resuming with a different
    one is refused. (It is written once the run has started: `build`.)"""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        return None
    current = _flat(json.loads(c.to_json()))
    with open(path) as f:
        saved = _flat(json.load(f))
    # fields added to the project's configs since the run started are not a different config
    diff = sorted(k for k in saved if saved[k] != current.get(k, _MISSING))
    if diff:
        raise ConfigError(f"{workdir} holds a run with a different config ({', '.join(diff[:6])}"
                          f"{', ...' if len(diff) > 6 else ''}); use a new --workdir or the same config")
    return saved


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"train.row_len": 768, ...} of a nested config dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_model_path(c: ml_collections.ConfigDict) -> None:
    """A model path that cannot load fails now, not after the tokenizer is trained into the workdir."""
    m = c.model
    if m.init == "random":
        return
    if not m.path:
        raise ConfigError("config.model.path is empty: give an HF or Orbax directory (or model.init='random')")
    model_dir.kind(m.path)


def _check_tokenizer(c: ml_collections.ConfigDict, family) -> None:
    """A SentencePiece tokenizer is trained on the family's expert episodes: a family without an
    expert is refused before the environments start."""
    if c.tokenizer.startswith("sentencepiece:") and not hasattr(family, "expert_actions"):
        raise ConfigError(f"tokenizer={c.tokenizer}: a SentencePiece tokenizer is trained on the family's expert "
                          f"episodes, and {c.env.family} has no expert (the built-in house has); "
                          "use tokenizer='qwen2.5' or 'qwen3'")


# -- the run's parts ---------------------------------------------------------------------------------
def _pool(c: ml_collections.ConfigDict, rows: int) -> EnvPool:
    # fewer environment slots than sampler rows would leave rows idle: only that many live episodes
    envs = c.env.envs_per_worker or -(-rows // c.env.workers)
    return EnvPool({c.env.family: c.env.workers}, envs_per_worker=envs, call_timeout=c.env.call_timeout or None)


def _tokenizer(c: ml_collections.ConfigDict, family, pool: EnvPool, workdir: str, is_main: bool):
    spec = c.tokenizer
    if spec == "model":
        return load_tokenizer(c.model.path)
    if not spec.startswith("sentencepiece:"):
        return load_tokenizer(spec)
    # a small tokenizer trained on the environment's own text (the demo's tiny model), once, by
    # process 0; every host gets its bytes
    path = os.path.join(workdir, TOKENIZER_FILE)
    proto = None
    if is_main:
        if not os.path.isfile(path):
            vocab = int(spec.split(":")[1])
            trained = train_sentencepiece(_corpus(c, family, pool), vocab_size=vocab)
            files.write_bytes(path, trained.model_proto)
        with open(path, "rb") as f:
            proto = f.read()
    return SentencePieceTokenizer(distributed.broadcast_object(proto), name=TOKENIZER_FILE)


def _corpus(c: ml_collections.ConfigDict, family, pool: EnvPool) -> list[str]:
    """Text the demo tokenizer is trained on: the prompts, and the expert episodes of the first
    train tasks (each played to its end, without a round limit)."""
    texts = [family.instruction(), family.acknowledgement(), family.invalid_action_message]
    plans = [(t, list(family.expert_actions(t))) for t in family.task_ids(c.env.train_split)[:CORPUS_TASKS]]
    for (t, actions), played in zip(plans, play_actions(pool, c.env.family, plans, max_rounds=None)):
        if played["error"]:  # the corpus is the same text every time, or the tokenizer would differ
            raise FaultError(f"the tokenizer's corpus: the expert episode of task {t} ended by an environment "
                             f"fault ({played['error']}); rerun to retry")
        texts.append(played["obs"][0])
        for action, obs in zip(actions, played["obs"][1:]):
            texts += [f"Action: {action}", obs]
    return texts


def _model(c: ml_collections.ConfigDict, tokenizer, mesh):
    m = c.model
    if m.init == "random":
        cfg = run_config.random_model_config(c, tokenizer.vocab_size)
        return models.create_model(cfg, seed=c.seed, mesh=mesh)
    model, _ = models.load_model(m.path, mesh=mesh, **run_config.execution(c))
    lora = run_config.lora_config(c)
    if lora is None:
        return model
    return models.qwen.with_adapters(model, lora, param_dtype=m.param_dtype, seed=c.seed)
