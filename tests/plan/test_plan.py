"""`launch.plan`: the run's own programs compiled for TPU and GPU targets on this CPU-only host.

The per-chip state bytes are checked against the trainer's real arrays on 8 fake CPU devices, the
temporaries against an independent AOT compile of the step, the TPU limits against the TPU
compiler's refusals, and the trip-count arithmetic against a program without loops.
"""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import models
from configs import demo
from cope_jax.run import run_config
from cope_jax.train import train_step as ts
from cope_jax.objective.methods import get_method
from cope_jax.plan import measure, planner, programs, targets
from models import presets, qwen
from tests.paths import ROOT

GIB = 1 << 30
# the demo's model, with rows small enough that every compile takes seconds
TINY = ["--config.rollout.sampler_rows=8", "--config.rollout.max_len=256", "--config.rollout.max_turn_tokens=16",
        "--config.train.row_len=256", "--config.train.rows_per_micro=0", "--config.train.logprob_chunk=256",
        "--config.warmstart.steps=0"]


def _tiny_config(**train):
    c = demo.get_config("cope")
    c.rollout.update(sampler_rows=8, max_len=256, max_turn_tokens=16)
    c.train.update(dict(dict(row_len=256, rows_per_micro=0, logprob_chunk=256), **train))
    c.warmstart.steps = 0
    return c


def _run(*args, env=None):
    env = dict(os.environ, XLA_FLAGS="", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _records(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_every_target_makes_its_devices_and_hosts():
    for target in targets.TARGETS.values():
        devices = targets.devices(target)
        assert len(devices) == target.chips, target.name
        assert len({d.process_index for d in devices}) == target.hosts, target.name
        assert devices[0].platform == ("tpu" if target.platform == "tpu" else "gpu"), target.name


@pytest.mark.parametrize("name", ["v4-8", "v5e-8", "v5p-8", "v6e-8", "tpu7x-8"])
def test_tpu_limits_are_the_compilers(name):
    """The usable memory in the table is what the TPU compiler itself allows (its refusal says so)."""
    target = targets.get_target(name)
    devices = targets.devices(target)
    mesh = Mesh(np.array(devices), ("x",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((len(devices) * 1024, 65536), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(Exception, match="exceeds available HBM") as e:
        jax.jit(lambda a: jnp.tile(jnp.exp(a), (1, 512)) * 2).lower(x).compile()
    available = float(str(e.value).split("available HBM (")[1].split("G)")[0])
    assert abs(available * GIB - target.usable_bytes) < 0.01 * GIB


def test_state_bytes_per_chip_are_the_trainers_own():
    """Plan on v5e-8 (mesh 1 x 8 x 1): parameter and optimizer bytes per chip equal those of a
    real Learner's arrays laid out on 8 CPU devices with the same mesh."""
    c = _tiny_config()
    cfg = run_config.random_model_config(c, 1024)
    layout, _ = programs.run_programs(c, cfg, targets.devices(targets.get_target("v5e-8")), (1, 8, 1))
    mesh = models.make_mesh((1, 8, 1))
    learner = ts.Learner(models.create_model(cfg, mesh=mesh), run_config.loss_config(c),
                         run_config.optimizer_config(c), mesh=mesh)
    shard_bytes = lambda tree: sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
    assert layout.params_bytes == shard_bytes(nnx.state(learner.model, nnx.Param))
    assert layout.optimizer_bytes == shard_bytes(nnx.state(learner.optimizer))
    # and a count from the shapes alone: every parameter has a dimension of 128 (hidden) or 1024
    # (vocabulary) that fsdp=8 divides, except the norms
    split = sum(np.prod(s) for n, s in qwen.param_shapes(cfg).items() if not n.endswith("norm")) // 8
    whole = sum(np.prod(s) for n, s in qwen.param_shapes(cfg).items() if n.endswith("norm"))
    assert layout.params_bytes == 4 * (split + whole)


def test_lora_state_bytes_follow_the_adapters():
    """A LoRA plan on v5e-8 (fsdp 8): the frozen base in the compute dtype, the adapters and their
    two AdamW moments in float32, no reference copy, counted here from the shapes alone; and the
    plan's train step compiles with the base as its own (undonated) input."""
    c = _tiny_config()
    c.model.dtype = "bfloat16"
    c.train.lora.update(rank=8)
    cfg = run_config.random_model_config(c, 1024)
    assert cfg.lora.rank == 8 and cfg.param_dtype == "float32"
    layout, progs = programs.run_programs(c, cfg, targets.devices(targets.get_target("v5e-8")), (1, 8, 1))
    shapes = qwen.param_shapes(cfg)
    adapters = {n: s for n, s in shapes.items() if models.lora.is_adapter(n)}
    assert len(adapters) == 14  # seven projections, A and B each
    # fsdp 8 splits every dimension named `embed` (hidden 128); norms, and the rank-side halves of
    # adapters on mlp / heads inputs, stay whole
    def per_chip(name, shape):
        axes = qwen.PARAM_AXES[name]
        return int(np.prod(shape)) // (8 if "embed" in axes and shape[axes.index("embed")] % 8 == 0 else 1)
    base = sum(per_chip(n, s) for n, s in shapes.items() if n not in adapters)
    lora_params = sum(per_chip(n, s) for n, s in adapters.items())
    assert layout.params_bytes == 2 * base + 4 * lora_params
    assert layout.optimizer_bytes == 2 * 4 * lora_params + 8  # mu, nu; two int32 counts (nnx, Adam)
    assert layout.reference_bytes == 0
    step = next(p for p in progs if p.name == "train_step")
    compiled = step.lower().compile()
    assert compiled.memory_analysis().argument_size_in_bytes > layout.params_bytes


def test_temporaries_equal_an_independent_compile():
    """The plan's train step temporaries on v4-8 equal those of the same step compiled by hand
    (jax.jit of the step function on a mesh made directly from the topology)."""
    c = _tiny_config()
    cfg = run_config.random_model_config(c, 1024)
    target = targets.get_target("v4-8")
    result = planner.plan(c, "demo", target, cfg, "tiny", (1, 4, 1), cost=False)
    step = next(r for r in result.results if r.program == "train_step")

    devices = targets.devices(target)
    mesh = Mesh(np.array(devices).reshape(1, 4, 1), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    opt = ts.make_optimizer(run_config.optimizer_config(c))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: (lambda m: (m, nnx.Optimizer(m, opt, wrt=nnx.Param)))(
        qwen.Qwen(cfg, rngs=nnx.Rngs(0), mesh=mesh))))
    shard = lambda axes, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=models.sharding.named_sharding(
        axes, a.shape, mesh))

    def place(path, a):
        name = qwen.param_path(path).split("/", 1)[1]
        name = name.split("/mu/")[-1].split("/nu/")[-1]
        return shard(qwen.PARAM_AXES.get(name, (None,) * a.ndim), a)
    state = jax.tree_util.tree_map_with_path(place, state)
    rows = 4
    loss = run_config.loss_config(c)
    terms = loss.active_terms(get_method(c.method).terms)
    batch = ts.abstract_batch((1, rows, 256), terms, mesh)
    coefs = {t: jax.ShapeDtypeStruct((), jnp.float32) for t in terms}
    fn = jax.jit(lambda s, b, k: ts._train_step(graphdef, s, b, k, cfg=loss.device_part(), on_policy=False,
                                                mesh=mesh), donate_argnums=0)
    mem = fn.lower(state, batch, coefs).compile().memory_analysis()
    assert step.temporaries == mem.temp_size_in_bytes


def test_cost_counts_every_loop_iteration():
    """The log-prob pass with scanned layers and 4 logits chunks, extrapolated from its unrolled-by-two
    variants, costs what the same pass without any loop costs (layers unrolled, one chunk)."""
    target = targets.get_target("v5e-8")
    devices = targets.devices(target)

    def logprobs(c, scan):
        cfg = run_config.random_model_config(c, 1024).replace(scan_layers=scan, num_layers=4)
        _, progs = programs.run_programs(c, cfg, devices, (1, 8, 1))
        return measure.measure(next(p for p in progs if p.name == "logprobs"), target)

    looped = logprobs(_tiny_config(logprob_chunk=512), True)  # 8 rows x 256 -> chunks of 64 positions
    flat = logprobs(_tiny_config(logprob_chunk=2048), False)
    assert looped.cost_source == flat.cost_source == "compiler"
    assert looped.flops == pytest.approx(flat.flops, rel=0.01)
    assert looped.flops == pytest.approx(looped.analytic_flops, rel=0.1)


def test_the_sampler_programs_report_the_bytes_they_must_move():
    """A decode step must read its weights and the window of KV cache: the planner's `must_bytes` equals
    that count made here, the compiler's count (layers unrolled entirely) is at least it, and the ratio
    is the two's quotient. (At this size the vocabulary's sampling work outweighs the weights: the
    ratio is ~12; Qwen2.5-7B's is in the closing notes of issue 31.)"""
    target = targets.get_target("v5e-8")
    c = _tiny_config()
    cfg = run_config.random_model_config(c, 1024).replace(num_layers=2)
    layout, progs = programs.run_programs(c, cfg, targets.devices(target), (1, 8, 1))
    decode = next(p for p in progs if p.name == "decode")
    mesh = layout.host_mesh
    assert mesh.devices.shape[1] == 1  # not the training mesh's fsdp
    B, W = run_config.sampler_rows(c, 1), int(c.rollout.max_len)
    frozen = qwen.frozen_config(cfg)
    weights = programs.per_chip_bytes(programs._params(qwen.abstract_placed_model(frozen, mesh)))
    kv_spec = models.sharding.named_sharding(qwen.CACHE_AXES, (2, B, W, cfg.num_kv_heads, cfg.head_dim), mesh)
    kv = 2 * np.prod(kv_spec.shard_shape((2, B, W, cfg.num_kv_heads, cfg.head_dim))) * jnp.dtype(cfg.dtype).itemsize
    assert decode.must_bytes == weights + kv
    r = measure.measure(decode, target)
    assert r.must_bytes == decode.must_bytes and r.cost_source == "compiler"
    assert r.must_bytes <= r.hbm_bytes
    assert r.bytes_ratio == pytest.approx(r.hbm_bytes / r.must_bytes)


def test_the_first_turns_prefill_is_one_row_per_group():
    """sciworld:cope (its rows, group size 8, 2,048-token prompts, on a small model) on a v5p host:
    by the TPU compiler's count, `prefill@group` costs an eighth of the same prefill with one row
    per episode (group size 1), and the report says what it stands for."""
    from configs import sciworld
    from tests.plan.test_fit_table import TINY_MODEL

    target = targets.get_target("v5p-8")

    def group_prefill(group_size):
        c = sciworld.get_config("cope")
        c.model.update(TINY_MODEL)
        c.rollout.update(group_size=group_size, sampler_rows=128)  # the rows of 16 tasks x 8 either way
        cfg = run_config.random_model_config(c, None)
        _, progs = programs.run_programs(c, cfg, targets.devices(target), (1, 4, 1))
        return next(p for p in progs if p.name == "prefill@group")

    grouped, per_row = group_prefill(8), group_prefill(1)
    assert grouped.shape == "16 x 512 into 2048" and per_row.shape == "128 x 512 into 2048"
    a, b = measure.measure(grouped, target), measure.measure(per_row, target)
    assert a.cost_source == b.cost_source == "compiler"
    assert a.flops == pytest.approx(b.flops / 8, rel=0.02)
    assert a.note.startswith("a first turn's prompts, one row per group of 8: prefilling each of the 128 rows "
                             "would take 8x these FLOPs")


def test_a_short_row_in_a_long_window_costs_what_a_short_window_costs():
    """The decode step reads only the filled key blocks. By the TPU compiler's count (v5e-8, a
    small model with 128-wide heads in bf16, key blocks of 128): a call whose rows hold at most 100
    tokens costs in a window of 4,096 slots what it costs in a window of 128, and a full window of
    4,096 costs more by at least the KV cache it then reads."""
    target = targets.get_target("v5e-8")

    def decode(window, filled):
        c = _tiny_config()
        c.rollout.max_len = window
        cfg = run_config.random_model_config(c, 1024).replace(num_layers=2, attention_block=128, head_dim=128,
                                                                dtype="bfloat16")
        _, progs = programs.run_programs(c, cfg, targets.devices(target), (1, 8, 1))
        p = next(p for p in progs if p.name == "decode")
        assert p.loops["cache"].trips == window // 128
        p = dataclasses.replace(p, loops=dict(p.loops, cache=programs._cache_trips(cfg, filled)))
        return measure.measure(p, target).hbm_bytes, p.must_bytes - p.param_bytes

    short, _ = decode(128, 100)
    long, _ = decode(4096, 100)
    full, kv = decode(4096, 4096)
    assert long <= 1.05 * short, (long, short)
    assert full - long >= 0.95 * kv, (full, long, kv)


@pytest.mark.parametrize("topology", ["v5e-8", "v4-8"])
def test_tiny_plan_on_v5e_and_v4_fits_and_reports_every_program(topology):
    """(The cost compiles are tested in-process: test_cost_counts_every_loop_iteration.)"""
    rc, out, err = _run("--config=configs/demo.py", f"--topology={topology}", "--json", "--nocost", *TINY)
    assert rc == 0, err
    records = _records(out)
    assert [r["program"] for r in records[:-1]] == ["train_step", "logprobs", "prefill", "prefill@group", "decode",
                                                   "decode@fill"]
    rc, out, err = _run("--config=configs/demo.py", f"--topology={topology}", "--json", "--nocost", *TINY,
                        "--programs=decode,prefill")
    assert rc == 0, err
    assert [r["program"] for r in _records(out)[:-1]] == ["prefill", "decode"]
    assert all(r["fits"] and r["total"] > r["params"] > 0 for r in records[:-1])
    # AdamW: mu and nu like the parameters, and two scalar step counters
    assert records[0]["temporaries"] > 0 and records[0]["optimizer"] == 2 * records[0]["params"] + 8
    assert records[-1]["summary"] and records[-1]["fits"] and records[-1]["topology"] == topology


def test_a_run_that_does_not_fit_exits_2_with_the_compilers_numbers():
    """The tiny model on 65,536-token rows with dense attention: the scores alone need tens of GiB per
    chip of a v5e-8 (15.75 GiB usable); the TPU compiler refuses, the planner reports it."""
    dense = ["--config.train.row_len=65536", "--config.model.attention=dense"]
    rc, out, err = _run("--config=configs/demo.py", "--topology=v5e-8", "--json", "--nocost", *TINY, *dense)
    assert rc == 2, err
    records = _records(out)
    step = records[0]
    assert step["program"] == "train_step" and not step["fits"] and "exceeds available HBM" in step["refused"]
    assert step["total"] > 5 * step["usable_bytes"] and not records[-1]["fits"]
    rc, out, _ = _run("--config=configs/demo.py", "--topology=v5e-8", "--nocost", *TINY, *dense)
    assert rc == 2 and "does NOT fit" in out and "NO (" in out and "train_step: does not fit: " in out


@pytest.mark.parametrize("topology", ["1xH100", "tpu7x-8"])
def test_a_one_gpu_host_and_an_ironwood_slice_are_planned(topology):
    """One device is a mesh of one (the trainer runs it meshless); TPU7x's devices are TensorCores,
    two a chip, with the compiler's own limit per device."""
    rc, out, err = _run("--config=configs/demo.py", f"--topology={topology}", "--json", "--nocost", *TINY)
    assert rc == 0, err
    records = _records(out)
    assert records[-1]["fits"] and [r["program"] for r in records[:-1]][:2] == ["train_step", "logprobs"]
    assert records[-1]["chips"] == (1 if topology == "1xH100" else 8)
    by_name = {r["program"]: r for r in records[:-1]}
    if topology == "1xH100":  # the GPU compiler's launches: a decode step steers nothing from the host
        assert all(r["kernels"] > 0 and r["kernels_per_layer"] > 0 for r in by_name.values())
        assert by_name["decode"]["host_synced"] == by_name["decode@fill"]["host_synced"] == 0
        assert by_name["decode"]["kernels_per_layer"] < 50
    else:
        assert all(r["kernels"] is None and r["host_synced"] is None for r in by_name.values())


def test_gpu_target_compiles_and_the_planner_checks_its_memory():
    rc, out, err = _run("--config=configs/demo.py", "--topology=8xH100", "--json", *TINY)
    assert rc == 0, err
    records = _records(out)
    assert records[-1]["fits"] and all(r["cost_source"] == "analytic" for r in records[:-1])
    # the GPU compiler checks nothing: the planner compares with the allocator's share of memory
    rc, out, err = _run("--config=configs/demo.py", "--topology=8xH100", "--json", "--nocost", *TINY,
                        env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.0000001"})
    assert rc == 2 and not _records(out)[-1]["fits"]


@pytest.mark.parametrize("args, reason", [
    (["--topology=v9-8"], "unknown topology 'v9-8'"),
    (["--topology=v5e-8", "--mesh=1,4,1"], "mesh (1, 4, 1) has 4 devices but v5e-8 has 8 chips"),
    (["--topology=v5e-8", "--mesh=1,x,1"], "expected 'auto' or three integers"),
    (["--topology=v5e-8", "--model=Qwen9-1B"], "unknown model preset 'Qwen9-1B'"),
    (["--topology=v5e-8", "--programs=decode,decoder", *TINY], "--programs: no program decoder; this run has"),
])
def test_bad_input_exits_1_with_one_line(args, reason):
    rc, out, err = _run("--config=configs/demo.py", *args)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: error:") and reason in lines[0], err


def test_a_model_dir_without_config_json_exits_1(tmp_path):
    rc, _, err = _run("--config=configs/sciworld.py:cope", "--topology=v5p-8", f"--config.model.path={tmp_path}")
    assert rc == 1 and err.strip() == f"plan: error: no config.json in '{tmp_path}'"


def test_every_host_of_a_slice_samples_on_a_decode_mesh_of_its_own_chips():
    """On v5p-32 (4 hosts of 4 chips) each host's sampler mesh holds its own 4 chips, laid out for
    decoding whatever the training mesh: Qwen2.5-7B's 28 heads over tp 4 (no weight moves between
    chips in a decode step), not the training mesh's block of fsdp."""
    from cope_jax.run import distributed, replica

    cfg = presets.preset_config("Qwen2.5-7B-Instruct")
    devices = targets.devices(targets.get_target("v5p-32"))
    for shape in ((1, 16, 1), (1, 8, 2), (2, 4, 2), (1, 4, 4)):
        mesh = distributed.run_mesh(shape, devices)
        for host in range(4):
            sub = replica.host_decode_mesh(cfg, mesh, host, 32, 16384)
            assert sub.devices.shape == (1, 1, 4) and {d.process_index for d in sub.devices.flat} == {host}


def test_each_host_samples_its_share_on_a_compute_dtype_replica():
    """v5p-32 has 4 hosts: with `rollout.sampler_rows` 0 each host's sampler holds its share of a
    step's 16 x 8 episodes (32 rows of KV cache, not 128), on a bfloat16 copy of the policy (half the
    float32 parameters' bytes per chip); the reference policy is bfloat16 too."""
    c = _tiny_config()
    c.rollout.update(sampler_rows=0, tasks_per_step=16, group_size=8)
    c.model.update(dtype="bfloat16", param_dtype="float32")
    cfg = run_config.random_model_config(c, 1024)
    devices = targets.devices(targets.get_target("v5p-32"))
    layout, progs = programs.run_programs(c, cfg, devices, (1, 16, 1))
    assert [p.shape for p in progs if p.name == "decode"] == ["32 rows, window 256"]
    host_f32 = programs.per_chip_bytes(programs._params(qwen.abstract_placed_model(cfg, layout.host_mesh)))
    assert layout.replica_bytes * 2 == host_f32
    assert layout.reference_bytes * 2 == layout.params_bytes
    c.rollout.sampler_rows = 48
    assert [p.shape for p in programs.run_programs(c, cfg, devices, (1, 16, 1))[1] if p.name == "decode"] == \
        ["48 rows, window 256"]
    c.rollout.sampler_rows = -1
    with pytest.raises(models.ConfigError, match="sampler_rows"):
        run_config.sampler_rows(c, 4)


def test_host_programs_compile_on_a_one_host_slice_where_the_compiler_wants_whole_slices():
    """v5e / v6e's TPU compiler refuses (or aborts on) a program over one host's chips of a larger
    slice: the sampler's programs compile on a one-host slice of the same chips; elsewhere on the
    slice's own host 0."""
    for name in ("v5e-64", "v6e-32"):
        devices = targets.host_devices(targets.get_target(name))
        assert len(devices) == 4 and {d.process_index for d in devices} == {0}
    assert targets.host_devices(targets.get_target("v5p-32")) is None
    assert targets.host_devices(targets.get_target("v5e-8")) is None  # one host: the slice itself


def test_a_compiler_failure_is_one_line_naming_the_program():
    """Not every compiler error is a refusal for memory (the TPU compiler has aborted on a host's
    device assignment): the planner names the program and target instead of a traceback."""
    def fail():
        raise RuntimeError("INTERNAL: RET_CHECK failure (compiler.cc:12) something\nmore detail")

    program = programs.Program("prefill", fail, "8 x 512 into 256", 1, {}, 0, 0, 0, 0.0)
    with pytest.raises(measure.CompileError, match=r"^the TPU compiler failed on prefill \(8 x 512 into 256\) "
                                                    r"for v5e-8: INTERNAL: RET_CHECK failure \(compiler.cc:12\) "
                                                    r"something$"):
        measure.measure(program, targets.get_target("v5e-8"), cost=False)


def test_the_warm_start_step_is_planned_when_configured():
    c = _tiny_config()
    cfg = run_config.random_model_config(c, 1024)
    devices = targets.devices(targets.get_target("v5e-8"))
    names = lambda c: [p.name for p in programs.run_programs(c, cfg, devices, (1, 8, 1))[1]]
    sampler = list(programs.SAMPLER_PROGRAMS)
    assert names(c) == ["train_step", "logprobs", *sampler]
    c.warmstart.steps = 10
    assert names(c) == ["train_step", "logprobs", "warmstart_step", *sampler]


def test_every_target_takes_every_mesh_auto_tries():
    """`jax.make_mesh` cannot split a physical axis (except on v5e): tp=2 on a 4x8 v6e slice failed.
    Every training mesh `--mesh=auto` tries, and every decode mesh a host may take, builds."""
    from cope_jax.run import distributed, replica

    cfg = presets.preset_config("Qwen3-8B")  # 32 heads: every tp width of a host is a candidate
    for target in targets.TARGETS.values():
        devices = targets.devices(target)
        host = targets.host_devices(target) or [d for d in devices if d.process_index == 0]
        for tp in (t for t in (1, 2, 4, 8) if t <= target.chips_per_host):
            distributed.run_mesh((1, -1, tp), devices)
        local = replica.decode_mesh(cfg, host, 64, 16384)
        assert local.devices.size == target.chips_per_host, target.name
