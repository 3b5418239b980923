"""`build(config, workdir) -> Components`: everything a run's stages (`cope_jax/stages/`) work with.

Everything that can refuse the run is checked first (every config value: `config_check`), before
anything is started or written, so a refused start leaves the workdir as it was. Then the run
starts: the environment pool, the tokenizer (the demo's is trained by process 0 on expert episodes
played through that pool and saved in the workdir), the policy and its sampling replica, the
sampler; config.json is written last, once the run has started. A start that fails later leaves
config.json without results; the same command resumes it, and another config sets its files aside.
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
from cope_jax.run import config_check, distributed, files, run_config
from cope_jax.run import metrics as metrics_lib
from cope_jax.rollout.chat import ChatFormat
from cope_jax.run.demos import play_actions
from cope_jax.run.faults import FaultError
from cope_jax.run.progress import say
from cope_jax.batch.forecasting import ForecastConfig
from cope_jax.objective.methods import LossConfig, MethodSpec
from cope_jax.run.replica import SamplingReplica
from cope_jax.rollout.sampler import Sampler
from cope_jax.rollout.tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from cope_jax.train.train_step import OptimizerConfig
from envs.pool import EnvPool
from envs.registry import get_spec, make_family

TOKENIZER_FILE = "tokenizer.model"
CHECKPOINT_DIR, WARMSTART_DIR = "checkpoints", "warmstart"  # a run's results (cope_jax/stages/)
SUPERSEDED_DIR = "superseded"
USER_SHARE = 0.8  # of an environment step's deadline, for its simulated customer's calls
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
    config_check.check(c)
    workdir = run_config.check_workdir(workdir)
    is_main = jax.process_index() == 0
    saved_config, supersede = _saved_config(c, workdir)
    spec = run_config.method(c)
    loss_cfg, opt_cfg = run_config.loss_config(c), run_config.optimizer_config(c)
    max_fault_fraction = run_config.max_fault_fraction(c)
    family = make_family(c.env.family)
    _check_splits(c, family)
    forecast_cfg = None
    if spec.forecast_kind is not None and "af" in loss_cfg.active_terms(spec.terms):  # af_coef 0: no examples
        forecast_cfg = run_config.forecast_config(c, family, spec.forecast_kind, spec.horizon)
    user = _user(c)
    _check_model_path(c)
    _check_tokenizer(c, family)
    mesh = distributed.run_mesh(tuple(c.mesh))
    rows = run_config.sampler_rows(c, jax.process_count())
    # every check passed: the run starts
    if supersede and is_main:
        _supersede(workdir)
    pool = _pool(c, rows, user)
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
    if saved_config is None and is_main:  # (a superseded start's is set aside above)
        files.write_json(os.path.join(workdir, "config.json"), json.loads(c.to_json()), indent=2, sort_keys=True)
    log = metrics_lib.MetricsLog(workdir, enabled=is_main)
    return Components(config=c, workdir=workdir, is_main=is_main, spec=spec, loss_cfg=loss_cfg, opt_cfg=opt_cfg,
                      forecast_cfg=forecast_cfg, max_fault_fraction=max_fault_fraction, family=family, pool=pool,
                      tokenizer=tokenizer, chat=chat, mesh=mesh, model=model, replica=replica, sampler=sampler,
                      log=log)


# -- checks ------------------------------------------------------------------------------------------
_MISSING = object()


def _saved_config(c: ml_collections.ConfigDict, workdir: str) -> tuple[dict | None, bool]:
    """(the workdir's config.json or None, whether an earlier start's files are to be set aside). A
    workdir with results (a checkpoint or a finished warm start) belongs to its config: another is
    refused. One without is an earlier start that failed: another config supersedes it."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        return None, False
    current = config_check.flat(c)
    with open(path) as f:
        saved = config_check.flat(json.load(f))
    # fields added to the project's configs since the run started are not a different config
    diff = sorted(k for k in saved if saved[k] != current.get(k, _MISSING))
    if diff and _has_results(workdir):
        raise ConfigError(f"{workdir} holds a run with a different config ({', '.join(diff[:6])}"
                          f"{', ...' if len(diff) > 6 else ''}); use a new --workdir or the same config")
    return (None, True) if diff else (saved, False)


def _has_results(workdir: str) -> bool:
    checkpoints = os.path.join(workdir, CHECKPOINT_DIR)
    return os.path.isdir(os.path.join(workdir, WARMSTART_DIR)) or bool(
        os.path.isdir(checkpoints) and os.listdir(checkpoints))


def _supersede(workdir: str) -> None:
    """Moves a failed earlier start's files (config, log, tokenizer) into superseded/<n>/: nothing of
    it is lost, and nothing of it mixes into the new run."""
    entries = [e for e in os.listdir(workdir) if e != SUPERSEDED_DIR]
    root = os.path.join(workdir, SUPERSEDED_DIR)
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, str(len(os.listdir(root)) + 1))
    os.makedirs(target)
    for e in entries:
        os.replace(os.path.join(workdir, e), os.path.join(target, e))
    say(f"{workdir}: an earlier start with another config left no results; its files are in {target}", True)


def _check_splits(c: ml_collections.ConfigDict, family) -> None:
    """The family has both splits (a family whose data is missing says so here, by name)."""
    for field in ("train_split", "eval_split"):
        try:
            family.task_ids(c.env[field])
        except ValueError as e:
            raise ConfigError(f"env.{field}={c.env[field]!r}: {e}") from None


def _user(c: ml_collections.ConfigDict) -> dict | None:
    """`env.user` as the spec tau2's workers build their customer from (None: no customer); an `llm`
    customer without an endpoint is refused, naming the flags."""
    u = c.env.user
    spec = dict(kind=u.kind, base_url=u.base_url, model=u.model, temperature=float(u.temperature),
                api_key_env=u.api_key_env or None, timeout=float(u.timeout))
    if spec["kind"] == "llm" and not (spec["base_url"] and spec["model"]):
        raise ConfigError("env.user: tau2's customer is an LLM (the paper's setting) and no endpoint is set: pass "
                          "--config.env.user.base_url=http://HOST:PORT/v1 and --config.env.user.model=NAME "
                          "(any OpenAI-compatible server), or --config.env.user.kind=gold for the scripted customer")
    return spec if spec["kind"] else None


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
def _pool(c: ml_collections.ConfigDict, rows: int, user: dict | None) -> EnvPool:
    # fewer environment instances than sampler rows would leave rows idle: only that many live episodes
    envs = c.env.envs_per_worker or -(-rows // c.env.workers)
    deadline = c.env.call_timeout or get_spec(c.env.family).call_timeout
    # the customer's calls of one step share most of the step's deadline (envs/tau2.py): a slow
    # endpoint ends that episode as a fault before the pool would kill the worker for a hang
    kwargs = {c.env.family: dict(user=user, user_seconds=USER_SHARE * deadline)} if user else {}
    key = (user or {}).get("api_key_env")  # the one credential a worker gets: its customer's
    return EnvPool({c.env.family: c.env.workers}, envs_per_worker=envs, call_timeout=deadline, family_kwargs=kwargs,
                   env_vars={c.env.family: (key,)} if key else None)


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
    scripts = [(t, list(family.expert_actions(t))) for t in family.task_ids(c.env.train_split)[:CORPUS_TASKS]]
    for (t, actions), played in zip(scripts, play_actions(pool, c.env.family, scripts, max_rounds=None)):
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
