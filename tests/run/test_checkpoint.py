"""TrainCheckpointer: a run killed mid-training resumes bit-identically; restores onto other meshes."""
import functools
import os
import signal
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from cope_jax.run.checkpoint import TrainCheckpointer
from models import qwen
from tests.paths import ROOT

TOY_CONFIG = {"lr": 0.05, "batch": 4, "save_every": 3, "method": "toy"}
TOTAL_STEPS, KILL_AFTER = 13, 9  # killed right after starting the step-9 save


# -- the toy run (also executed in a subprocess that is SIGKILLed) -------------------------------------
class Toy(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.tanh(self.hidden(x)))


def _data():
    rs = np.random.RandomState(0)
    x = rs.randn(40, 6).astype(np.float32)
    return x, np.sin(x.sum(-1, keepdims=True)).astype(np.float32)


def _dataset():
    # shuffled epochs, so the data order depends on the iterator state
    return grain.MapDataset.range(40).shuffle(seed=5).repeat().batch(TOY_CONFIG["batch"]).to_iter_dataset()


@functools.lru_cache(maxsize=None)
def _toy_fns():
    tx = optax.adam(TOY_CONFIG["lr"])
    graphdef, params = nnx.split(Toy(nnx.Rngs(0)), nnx.Param)
    x_all, y_all = (jnp.asarray(a) for a in _data())

    @jax.jit
    def step(state, idx):
        rng, noise_key = jax.random.split(state["rng"])

        def loss(p):
            x = x_all[idx] + 0.1 * jax.random.normal(noise_key, (idx.shape[0], 6))  # uses the RNG
            return jnp.mean((nnx.merge(graphdef, p)(x) - y_all[idx]) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "rng": rng}

    def init():
        return {"params": params, "opt_state": tx.init(params), "rng": jax.random.key(42)}

    return init, step


def toy_run(workdir: str, total_steps: int, kill_after: int | None = None):
    """Trains with a checkpoint every `save_every` steps, resuming from the latest one in `workdir`.

    Returns (final state, final data state, {step: batch indices} of the steps this run took).
    """
    init, step_fn = _toy_fns()
    state, it = init(), iter(_dataset())
    start = 0
    ckpt = TrainCheckpointer(workdir, keep=2, async_save=True)
    if ckpt.latest_step() is not None:
        start, state, data_state, config = ckpt.restore(abstract_state=state)
        assert config == TOY_CONFIG
        it.set_state(data_state)
    batches = {}
    for step in range(start, total_steps):
        idx = next(it)
        batches[step] = idx.tolist()
        state = step_fn(state, jnp.asarray(idx))
        if (step + 1) % TOY_CONFIG["save_every"] == 0:
            ckpt.save(step + 1, state, data_state=it.get_state(), config=TOY_CONFIG)
        if kill_after == step + 1:
            # killed right after starting an async save: that save may or may not have committed
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    ckpt.close()
    return state, it.get_state(), batches


def _bits(state):
    leaves = jax.tree.leaves(jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, state))
    return [np.asarray(x).tobytes() for x in leaves]


def test_killed_run_resumes_bit_identically(tmp_path):
    ref_state, ref_data, ref_batches = toy_run(str(tmp_path / "ref"), TOTAL_STEPS)
    workdir = str(tmp_path / "run")
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from tests.run.test_checkpoint import toy_run; "
            f"toy_run({workdir!r}, {TOTAL_STEPS}, kill_after={KILL_AFTER})")
    killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    survivors = [int(n) for n in os.listdir(workdir) if n.isdigit()]
    assert survivors and max(survivors) <= KILL_AFTER
    state, data, batches = toy_run(workdir, TOTAL_STEPS)
    resumed_from = min(batches)
    assert resumed_from in (KILL_AFTER - 3, KILL_AFTER)  # the step-9 save may not have committed
    assert not [n for n in os.listdir(workdir) if "tmp" in n]  # a half-written step is cleaned up
    assert batches == {s: b for s, b in ref_batches.items() if s >= resumed_from}  # same data order
    assert data == ref_data
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    assert isinstance(state["params"], nnx.State) and jax.dtypes.issubdtype(state["rng"].dtype, jax.dtypes.prng_key)
    assert _bits(state) == _bits(ref_state)  # params, both Adam moments, step count, rng
    assert _bits(state) != _bits(_toy_fns()[0]())  # and training did move them


def test_keep_last_n_json_items_and_explicit_steps(tmp_path):
    init, step_fn = _toy_fns()
    state = init()
    with TrainCheckpointer(str(tmp_path), keep=2, async_save=False) as ckpt:
        saved = {}
        for s in (1, 2, 3):
            state = step_fn(state, jnp.arange(4) + s)
            assert ckpt.save(s, state, data_state={"next_index": s}, config={"seed": np.int64(7)})
            saved[s] = _bits(state)
        assert not ckpt.save(3, state, data_state={}, config={})  # already there: skipped, not overwritten
        assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
        step, restored, data, config = ckpt.restore(2, abstract_state=init())
        assert step == 2 and data == {"next_index": 2} and config == {"seed": 7}
        assert _bits(restored) == saved[2]
        # a subset of the items, e.g. only the params for evaluation
        _, only_params, _, _ = ckpt.restore(abstract_state={"params": init()["params"]})
        assert list(only_params) == ["params"]
        with pytest.raises(FileNotFoundError, match="no checkpoint for step 1"):
            ckpt.restore(1, abstract_state=init())
        with pytest.raises(ValueError, match="not JSON-serialisable"):
            ckpt.save(4, state, data_state={"it": object()}, config={})
        with pytest.raises(ValueError, match="clash"):
            ckpt.save(4, {"config": state["params"]}, data_state={}, config={})
        assert ckpt.all_steps() == [2, 3]


def test_restore_onto_other_meshes(tmp_path):
    cfg = models.QwenConfig(family="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                            tie_word_embeddings=False, qkv_bias=True, qk_norm=False)
    tx = optax.adamw(1e-3)
    save_mesh = models.make_mesh((1, 2, 4))
    rs = np.random.RandomState(0)

    def random_like(a, sharding):
        return jax.device_put(rs.randn(*a.shape).astype(a.dtype), sharding)

    _, abstract = nnx.split(qwen.abstract_model(cfg, save_mesh), nnx.Param)
    params = jax.tree.map(random_like, abstract, qwen.state_shardings(abstract, save_mesh))
    # Adam moments: random too, sharded like their parameters
    opt_state = optax.tree_map_params(tx, lambda p: random_like(p, p.sharding), tx.init(params))
    state = {"params": params, "opt_state": opt_state, "rng": jax.random.key(9)}
    assert params["layers"]["up_proj"][...].sharding.spec == P(None, "fsdp", "tp")
    with TrainCheckpointer(str(tmp_path)) as ckpt:
        ckpt.save(10, state, data_state={}, config={})
        ckpt.wait()
        for shape in ((1, 8, 1), None):
            mesh = None if shape is None else models.make_mesh(shape)
            _, abstract = nnx.split(qwen.abstract_model(cfg, mesh), nnx.Param)
            replicated = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                          else jax.sharding.NamedSharding(mesh, P()))
            shardings = (jax.tree.map(lambda _: replicated, abstract) if mesh is None
                         else qwen.state_shardings(abstract, mesh))
            abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract, shardings)
            # Adam moments take their parameter's sharding; the step count is replicated
            abstract_opt = optax.tree_map_params(
                tx, lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                jax.eval_shape(tx.init, abstract), shardings,
                transform_non_params=lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated))
            _, restored, _, _ = ckpt.restore(abstract_state={"params": abstract, "opt_state": abstract_opt,
                                                             "rng": jax.random.key(0)})
            up = restored["params"]["layers"]["up_proj"][...]
            if mesh is None:
                assert len(up.sharding.device_set) == 1
            else:
                assert up.sharding.spec == P(None, "fsdp", None)
                assert up.addressable_shards[0].data.shape == (2, 32 // 8, 64)
            assert _bits(restored) == _bits(state)



def test_closed_loop_noise_is_dropped_however_threads_interleave_it():
    """A failed restore's stray 'Event loop is closed' tracebacks, interleaved line by line by
    TensorStore's threads (as captured in CI), leave only the lines that are not theirs."""
    from models.orbax_io import drop_closed_loop_noise

    base = '  File "/usr/lib/python3.11/asyncio/base_events.py", line {}, in {}\n'
    noise = ("Traceback (most recent call last):\n" + base.format(806, "call_soon_threadsafe")
             + "Traceback (most recent call last):\n" + "    self._check_closed()\n"
             + base.format(519, "_check_closed") + "  self._check_closed()\n"
             + "    raise RuntimeError('Event loop is closed')\n" + base.format(519, "_check_closed")
             + "RuntimeError: Event loop is closed\n" + "    raise RuntimeError('Event loop is closed')\n"
             + "RuntimeError: Event loop is closed\n")
    genuine = "W1207 orbax: a warning of its own\n"
    assert drop_closed_loop_noise(noise) == ""
    # pieces of two threads on one line, and a line cut mid-message (as CI captured them)
    mid_line = ("self._check_closed()self._check_closed()\n\n"
                "RuntimeError:     raise RuntimeError('Event loop is closed')\nEvent loop is closed\n")
    assert drop_closed_loop_noise(mid_line + genuine + noise) == genuine
    assert drop_closed_loop_noise(noise[:noise.index('Traceback', 10)] + genuine + noise[noise.index('Traceback', 10):]) == genuine
    # without the closed loop, a traceback is someone's real error and stays whole
    real = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: bad\n"
    assert drop_closed_loop_noise(real) == real
