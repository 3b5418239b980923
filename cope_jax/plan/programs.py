"""The jitted programs a run executes, on abstract inputs for a target's devices.

`run_programs(config, model_cfg, devices, mesh_shape)` lays the run out as the trainer would (the
global (data, fsdp, tp) mesh, each host's block of it for the sampler, the micro-batch rows) and
returns, per program, a function that lowers **the trainer's own jitted function** on abstract
arrays: `train_step.step_program` (the RL step and, when configured, the warm start's),
`train_step.logprobs_program` (old / reference log-probs) and the sampler's `decode.prefill` and
`decode.decode_loop` (`Sampler.lower`). Nothing is allocated.

Each program also carries what the planner needs beside the compiler: the trip counts of its loops
(`models/loops.py`), the tokens one call processes, the buffers that stay in memory while it runs
without being its arguments (the optimizer state while sampling, the reference model while
training), and an analytical FLOP count (and, for decoding, bytes moved) to cross-check the
compiler's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from cope_jax.run import distributed, run_config
from cope_jax.run import replica as replica_lib
from cope_jax.train import train_step as ts
from cope_jax.train.logprobs import chunk_positions
from cope_jax.objective.methods import get_method, needing
from cope_jax.rollout.sampler import Sampler
import models
from models import attention as attn
from models import lora
from models import qwen
from models import sharding as shd
from models.config import QwenConfig


class Loop(NamedTuple):
    """A loop kind of a program: `trips` iterations, run `times` times by the counted program (a
    loop inside the scanned decoder layer runs once per layer, and the layer body is counted once).
    `whole`: counted unrolled entirely rather than extrapolated from one more iteration (the decode
    step's layers: one layer more of the loop unrolled by two counts 0.98 GB where each of 28
    unrolled layers counts 0.52, Qwen2.5-7B on a v5p host; it compiles so in about a minute, the
    prefill in several, so the prefill stays extrapolated)."""

    trips: int
    times: int = 1
    whole: bool = False
    traced: bool = False  # its trip count is the data's (`loops.fori` on a traced count): `trips` is the planned one


SAMPLER_PROGRAMS = ("prefill", "prefill@group", "decode", "decode@fill")  # the rest are the trainer's


@dataclasses.dataclass
class Program:
    name: str
    lower: Callable[[], "jax.stages.Lowered"]  # traces afresh (under `loops.unrolled` too)
    shape: str                  # what one call processes, for the report
    tokens: int                 # tokens per call, all chips together
    loops: dict[str, Loop]      # loop kind -> its trips
    param_bytes: int            # per chip: parameters among the arguments
    optimizer_bytes: int        # per chip: optimizer state among the arguments
    resident_bytes: int         # per chip: buffers alive meanwhile that are not arguments
    analytic_flops: float       # per chip
    must_bytes: float | None = None  # per chip: the bytes it cannot avoid moving (the sampler's: its
    # weights, the filled KV cache it reads and the KV it writes)
    per_step: bool = False  # a decode loop: its launches are counted per step (`plan/launches.py`)
    note: str = ""  # a line for the report


@dataclasses.dataclass
class Layout:
    """How a run sits on the target: meshes, micro-batch rows and the per-chip size of its state."""

    mesh: "jax.sharding.Mesh | None"
    host_mesh: "jax.sharding.Mesh | None"
    hosts: int
    rows_per_micro: int
    params_bytes: int      # per chip, on the global mesh
    optimizer_bytes: int   # per chip
    replica_bytes: int     # per chip: the sampler's own copy of the parameters (0: it reads the policy)
    reference_bytes: int   # per chip: the frozen reference policy (0: the run has none)


def per_chip_bytes(tree) -> int:
    """Bytes one device holds of a tree of (abstract) arrays with shardings (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.shape if a.sharding is None else a.sharding.shard_shape(a.shape)
        total += math.prod(shape) * np.dtype(a.dtype).itemsize
    return total


def run_programs(c: ml_collections.ConfigDict, model_cfg: QwenConfig, devices, mesh_shape,
                 host_devices=None) -> tuple[Layout, list[Program]]:
    """`host_devices`: where one host's own programs compile (`targets.host_devices`); default
    host 0's devices of the slice."""
    # one device is a mesh too here (the trainer runs it meshless): it names the device compiled for
    mesh = distributed.run_mesh(tuple(mesh_shape), devices) or models.make_mesh((1, 1, 1), devices=list(devices)[:1])
    hosts = len({d.process_index for d in devices})
    graphdef, state = ts.abstract_train_state(model_cfg, run_config.optimizer_config(c), mesh)
    params_bytes, opt_bytes = per_chip_bytes(state[0]), per_chip_bytes(state[1])
    host_mesh, replica = _sampling(c, model_cfg, mesh, hosts, host_devices)
    # the reference policy and the sampler's replica are frozen copies (compute dtype)
    frozen_cfg = qwen.frozen_config(model_cfg)
    spec = get_method(c.method, horizon=None if c.train.horizon < 0 else int(c.train.horizon))
    needs_reference = bool(needing(run_config.loss_config(c).active_terms(spec.terms), "ref_logp"))
    # under LoRA the reference is the base itself (`qwen.base_view`): no bytes of its own
    has_copy = needs_reference and model_cfg.lora is None
    reference = per_chip_bytes(_params(qwen.abstract_placed_model(frozen_cfg, mesh))) if has_copy else 0
    layout = Layout(mesh=mesh, host_mesh=host_mesh, hosts=hosts, rows_per_micro=run_config.rows_per_micro(c, mesh),
                    params_bytes=params_bytes, optimizer_bytes=opt_bytes,
                    replica_bytes=0 if replica is None else per_chip_bytes(_params(replica)),
                    reference_bytes=reference)
    programs = [*_trainer_programs(c, model_cfg, layout, graphdef, state, spec),
                *_sampler_programs(c, model_cfg, layout, replica)]
    return layout, programs


def _sampling(c, model_cfg, mesh, hosts: int, host_devices):
    """(host 0's decode mesh, the sampler's replica or None where it reads the policy), as
    `replica.SamplingReplica` lays them out."""
    if mesh is None:
        return None, None
    if host_devices is None or hosts == 1:
        host_devices = [d for d in mesh.devices.flat if d.process_index == 0]
    host_mesh = replica_lib.decode_mesh(model_cfg, host_devices, run_config.sampler_rows(c, hosts),
                                        int(c.rollout.max_len))
    if replica_lib.reads_policy(model_cfg, mesh, host_mesh, hosts):
        return host_mesh, None
    return host_mesh, qwen.abstract_placed_model(qwen.frozen_config(model_cfg), host_mesh)


# -- the trainer's programs --------------------------------------------------------------------------
def _trainer_programs(c, model_cfg, layout: Layout, graphdef, state, spec) -> list[Program]:
    mesh, rows, T = layout.mesh, layout.rows_per_micro, int(c.train.row_len)
    # the step's donated state and (under LoRA) the frozen base, parted as the Learner parts them
    _, frozen, trained = nnx.split(nnx.merge(graphdef, state), qwen.frozen(model_cfg), ...)
    frozen = frozen if model_cfg.lora is not None else None
    shardings = jax.tree.map(lambda a: a.sharding, trained)
    ways = _row_ways(rows, mesh) * _tp(mesh)
    loss = run_config.loss_config(c)
    chunks = -(-T // chunk_positions(rows, T, loss.logits_chunk_tokens))
    platform = _platform(mesh)
    loops = {"layers": Loop(model_cfg.num_layers), "chunks": Loop(chunks)}
    train_loops = {**loops, **_attention_loop(model_cfg, T, T, True, platform, backward=True)}
    loops.update(_attention_loop(model_cfg, T, T, True, platform))
    shape = f"{rows} x {T}"

    def step(loss_cfg, method):
        terms = loss_cfg.active_terms(method.terms)
        batch = ts.abstract_batch((1, rows, T), terms, mesh)
        coefs = {t: jax.ShapeDtypeStruct((), jnp.float32) for t in terms}
        program = ts.step_program(graphdef, shardings, loss_cfg, mesh)
        return lambda: program.lower(trained, batch, coefs, frozen)

    model_def, params = _model_part(graphdef, state)
    logprobs = ts.logprobs_program(model_def, loss, mesh)
    batch = ts.abstract_batch((1, rows, T), loss.active_terms(spec.terms), mesh)  # weights: which micro-batches run
    out = [
        Program("train_step", step(loss, spec), shape, rows * T, train_loops, layout.params_bytes,
                layout.optimizer_bytes, layout.reference_bytes + layout.replica_bytes,
                _train_flops(model_cfg, T, platform) * rows * T / ways),
        Program("logprobs", lambda: logprobs.lower(params, batch), shape, rows * T, loops, layout.params_bytes, 0,
                layout.optimizer_bytes + layout.reference_bytes + layout.replica_bytes,
                forward_flops(model_cfg, T, T, platform, packed=True, logits=True) * rows * T / ways),
    ]
    if c.warmstart.steps > 0:
        out.append(_warmstart_program(c, model_cfg, layout, shape, train_loops, ways))
    return out


def _warmstart_program(c, model_cfg, layout: Layout, shape: str, loops, ways: int) -> Program:
    """The warm start's step. It trains every weight, LoRA or not (`stages/warmstart.py`): under
    LoRA through the base view, so its state is the frozen-dtype base with AdamW moments of every
    weight, and the adapters are what stays alive beside it."""
    mesh, rows, T = layout.mesh, layout.rows_per_micro, int(c.train.row_len)
    ws_loss, ws_opt = run_config.warmstart_configs(c)
    ws_cfg = model_cfg if model_cfg.lora is None else qwen.frozen_config(model_cfg)
    graphdef, state = ts.abstract_train_state(ws_cfg, ws_opt, mesh)
    params, optimizer = per_chip_bytes(state[0]), per_chip_bytes(state[1])
    adapters = layout.params_bytes - params if model_cfg.lora is not None else 0
    shardings = jax.tree.map(lambda a: a.sharding, state)
    terms = ws_loss.active_terms(get_method("warmstart").terms)
    batch = ts.abstract_batch((1, rows, T), terms, mesh)
    coefs = {t: jax.ShapeDtypeStruct((), jnp.float32) for t in terms}
    program = ts.step_program(graphdef, shardings, ws_loss, mesh)
    return Program("warmstart_step", lambda: program.lower(state, batch, coefs, None), shape, rows * T, loops,
                   params, optimizer, layout.replica_bytes + adapters,
                   _train_flops(ws_cfg, T, _platform(mesh)) * rows * T / ways)


def _model_part(graphdef, state):
    """The model's graphdef and its abstract parameters, from the (model, optimizer) split."""
    model, _ = nnx.merge(graphdef, state)
    return nnx.graphdef(model), _params(model)


def _params(model):
    return nnx.state(model, nnx.Param)


# -- the sampler's programs --------------------------------------------------------------------------
def _sampler_programs(c, model_cfg, layout: Layout, replica) -> list[Program]:
    mesh = layout.host_mesh
    if replica is None:  # the sampler reads the policy itself
        replica = qwen.abstract_placed_model(model_cfg, mesh)
    eos = model_cfg.eos_token_id
    sampler = Sampler(replica, batch_size=run_config.sampler_rows(c, layout.hosts), max_len=int(c.rollout.max_len),
                      eos_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    # the policy's parameters are the sampler's arguments where it reads them, else resident too
    resident = (layout.optimizer_bytes + layout.reference_bytes
                + (layout.params_bytes if layout.replica_bytes else 0))
    param_bytes = per_chip_bytes(_params(replica))
    B, W, chunk = sampler.batch_size, sampler.max_len, sampler.chunks[-1]
    steps = int(min(c.rollout.max_turn_tokens, W))
    ways = _row_ways(B, mesh) * _tp(mesh)
    cache = sampler.abstract_state().cache
    cache_bytes = per_chip_bytes((cache.k, cache.v))
    platform = _platform(mesh)

    group_size, prompt_len = int(c.rollout.group_size), int(c.rollout.max_prompt_len) or W

    def lower(name, rows=None):
        def run():  # each call traces afresh (the planner's unrolled variants)
            return sampler.lower(steps, rows=rows, group_size=group_size, prompt_len=prompt_len)[name]()
        return run

    def decode(name: str, rows: int, filled: int, shape: str) -> Program:
        """The decode step with `rows` rows decoding, each at `filled` of the window's slots."""
        flops = forward_flops(model_cfg, 1, filled, platform, packed=False, logits=True) * rows / ways
        return Program(name, lower("decode", rows), shape, rows,
                       {"layers": Loop(model_cfg.num_layers, whole=True), "cache": _cache_trips(model_cfg, filled)},
                       param_bytes, 0, resident, flops, must_bytes=param_bytes + cache_bytes * rows * filled / (B * W),
                       per_step=True)

    active, half = -(-3 * B // 4), W // 2
    prefill_loops = {"layers": Loop(model_cfg.num_layers)}
    if _chosen(model_cfg, chunk, W, False, platform) != "pallas":  # the kernel has no loop of ours
        prefill_loops["cache"] = _cache_trips(model_cfg, W, model_cfg.num_layers if model_cfg.scan_layers else 1)
    return [
        Program("prefill", lower("prefill"), f"{B} x {chunk} into {W}", B * chunk, prefill_loops, param_bytes, 0,
                resident, forward_flops(model_cfg, chunk, W, platform, packed=False, logits=False) * B * chunk / ways,
                must_bytes=param_bytes + cache_bytes),  # the cache before the chunk read, the chunk written
        _group_prefill(sampler, model_cfg, lower("prefill@group"), group_size, prompt_len, param_bytes,
                       resident + cache_bytes, platform, mesh),
        decode("decode", B, W, f"{B} rows, window {W}"),
        # what a rollout mostly runs: rows half way through their window, a quarter of them idle
        decode("decode@fill", active, half, f"{active} of {B} rows at {half} of {W}"),
    ]


def _group_prefill(sampler: Sampler, model_cfg, lower, group_size: int, prompt_len: int, param_bytes: int,
                   resident: int, platform: str, mesh) -> Program:
    """A first turn's prompt prefill: one row per group (the sampler's prompts' own state of
    `prompt_len` slots; the rows' cache stays resident beside it), a chunk per call."""
    B = sampler.batch_size
    groups, chunk, slots = sampler.group_prefill_shape(B, group_size, prompt_len)
    own = sampler.abstract_state(groups, slots).cache
    ways = _row_ways(groups, mesh) * _tp(mesh)
    loops = {"layers": Loop(model_cfg.num_layers)}
    if _chosen(model_cfg, chunk, slots, False, platform) != "pallas":
        loops["cache"] = _cache_trips(model_cfg, slots, model_cfg.num_layers if model_cfg.scan_layers else 1)
    per_row = forward_flops(model_cfg, chunk, slots, platform, packed=False, logits=False) * chunk
    return Program("prefill@group", lower, f"{groups} x {chunk} into {slots}", groups * chunk, loops, param_bytes,
                   0, resident, per_row * groups / ways, must_bytes=param_bytes + per_chip_bytes((own.k, own.v)),
                   note=f"a first turn's prompts, one row per group of {group_size}: prefilling each of the {B} rows "
                        f"would take {B / groups:.3g}x these FLOPs (analytic {per_row * B / ways:.3g} per chip)")


def _cache_trips(cfg: QwenConfig, filled: int, times: int = 1) -> Loop:
    """The cache loop (`attention.cache_loop`) over `filled` slots: a trip per key block."""
    return Loop(-(-filled // cfg.attention_block), times, traced=True)


# -- analytical counts (per token) ------------------------------------------------------------------
def layer_matmul_params(cfg: QwenConfig) -> int:
    """Weights multiplied per token by the decoder layers (everything but embedding and head)."""
    E, H, K, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return cfg.num_layers * (E * (H + 2 * K) * D + H * D * E + 3 * E * F)


def _attention_flops(cfg: QwenConfig, keys: float) -> float:
    """Scores and weighted values of one query over `keys` keys, all layers (masked keys count)."""
    return 4 * cfg.num_layers * keys * cfg.num_heads * cfg.head_dim


def forward_flops(cfg: QwenConfig, T: int, S: int, platform: str, *, packed: bool, logits: bool) -> float:
    """One token's forward, one of T queries over S keys, with or without the head."""
    head = 2 * cfg.hidden_size * cfg.vocab_size if logits else 0
    return 2 * layer_matmul_params(cfg) + _attention_flops(cfg, _keys_computed(cfg, T, S, packed, platform)) + head


def adapter_matmul_params(cfg: QwenConfig) -> int:
    """Adapter weights multiplied per token (A and B of every targeted projection, all layers)."""
    if cfg.lora is None:
        return 0
    return sum(math.prod(s) for n, s in qwen.param_shapes(cfg).items() if lora.is_adapter(n))


def _train_flops(cfg: QwenConfig, T: int, platform: str) -> float:
    """Per token: the layers' forward 2 N, the gradient to their inputs 2 N, the gradient to their
    weights 2 N unless LoRA freezes them, +2 N recomputed under full remat (the adapters' A, B count
    all of it); attention forward, recomputed under any remat (its dots have batch dimensions), and
    backward (twice the forward for dense; blockwise recomputes each block's scores: 2.5 times); and
    the chunked head: forward, recomputed logits, and the two gradient products (its custom
    backward computes the weight's gradient under LoRA too)."""
    remat = 2 if cfg.remat == "full" else 0
    weight_grads = 2 if cfg.lora is None else 0
    matmul = (4 + weight_grads + remat) * layer_matmul_params(cfg) + (6 + remat) * adapter_matmul_params(cfg)
    backward = 2 if _chosen(cfg, T, T, True, platform) == "dense" else 2.5
    passes = 1 + (1 if cfg.remat != "none" else 0) + backward
    attention = passes * _attention_flops(cfg, _keys_computed(cfg, T, T, True, platform))
    return matmul + attention + 4 * 2 * cfg.hidden_size * cfg.vocab_size


def _chosen(cfg: QwenConfig, T: int, S: int, packed: bool, platform: str) -> str:
    return attn.choose(cfg.attention, T, S, cfg.head_dim, cfg.attention_block, packed, platform)


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def _keys_computed(cfg: QwenConfig, T: int, S: int, packed: bool, platform: str) -> float:
    """Keys each query's scores are computed for: all S (dense), or those of the blocks visited."""
    chosen = _chosen(cfg, T, S, packed, platform)
    if chosen == "dense":
        return S
    blocks = attn.block_layout(T, S, cfg.attention_block, packed, kernel=chosen == "pallas")
    return len(blocks.pairs) * blocks.bq * blocks.bk / T


def _attention_loop(cfg: QwenConfig, T: int, S: int, packed: bool, platform: str,
                    backward: bool = False) -> dict[str, Loop]:
    """The blockwise pair loop of T queries over S keys, inside every decoder layer: none for dense,
    and under `pallas` only the backward's (the forward is the kernel)."""
    chosen = _chosen(cfg, T, S, packed, platform)
    if chosen == "dense" or (chosen == "pallas" and not backward):
        return {}
    pairs = len(attn.block_layout(T, S, cfg.attention_block, packed, kernel=chosen == "pallas").pairs)
    return {"attention": Loop(pairs, cfg.num_layers if cfg.scan_layers else 1)}


def _row_ways(rows: int, mesh) -> int:
    """Devices the rows are actually split over (a mesh axis that does not divide them is dropped)."""
    if mesh is None:
        return 1
    spec = shd.logical_to_spec(("batch",), (rows,), mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)


def _tp(mesh) -> int:
    return 1 if mesh is None else int(mesh.shape.get("tp", 1))
