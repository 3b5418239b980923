"""`plan/launches.py`: kernels and host-synced loops read from programs compiled for an H100 on this
host, on toy programs whose loops are known by construction."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from cope_jax.plan import launches, targets


def _compiled_for_h100(fn, *shapes):
    device = targets.devices(targets.get_target("1xH100"))[0]
    args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def _stepped(inner_trips):
    """A decode-like program: a step loop of data-dependent length over 5 scanned layers, each
    with an inner loop of `inner_trips` (an int: fixed; 'data': the count is an argument)."""
    def fn(x, n):
        def layer(c, _):
            trips = n if inner_trips == "data" else inner_trips
            c = jax.lax.fori_loop(0, trips, lambda i, h: jnp.sin(h) * 2, c)
            return jnp.tanh(c @ c), None

        def step(s):
            return s[0] + 1, jax.lax.scan(layer, s[1], None, length=5)[0]

        return jax.lax.while_loop(lambda s: s[0] < n, step, (0, x))

    return _compiled_for_h100(fn, ((64, 64), jnp.float32), ((), jnp.int32))


def test_a_loop_of_data_dependent_length_inside_the_layers_is_one_host_sync_per_layer():
    counted = launches.count(_stepped("data"), per_step=True)
    assert counted.host_synced == 5 and len(counted.synced_by) == 1 and "while" in counted.synced_by[0]
    assert counted.kernels >= 5 * 3  # per layer: the loop's body and condition, the matmul at least
    # the whole call adds the step loop itself
    assert launches.count(_stepped("data")).host_synced == 6


def test_a_fixed_count_loop_syncs_nothing_and_its_body_is_counted_per_trip():
    four, eight = (launches.count(_stepped(n), per_step=True) for n in (4, 8))
    assert four.host_synced == eight.host_synced == 0 and four.synced_by == ()
    assert eight.kernels > four.kernels  # each layer runs the fixed loop's body more often (or unrolled)


def test_a_branch_on_the_device_is_a_host_sync():
    branches = (lambda x: jnp.sort(x @ x, axis=0), lambda x: jnp.cumsum(jnp.tanh(x) @ x, axis=1))
    text = _compiled_for_h100(lambda x: jax.lax.cond(jnp.sum(x) > 0, *branches, x), ((256, 256), jnp.float32))
    counted = launches.count(text)
    assert counted.host_synced == 1 and "cond" in counted.synced_by[0]


def test_a_program_without_a_step_loop_is_refused_per_step():
    with pytest.raises(ValueError, match="one step loop"):
        launches.count(_compiled_for_h100(jnp.sin, ((8,), jnp.float32)), per_step=True)


def _weight_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """The launched slice fusions whose output is one layer's slice of a stacked weight."""
    copies = []
    for line in hlo_text.splitlines():
        m = re.match(r"\s+%(\S*slice\S*) = \w+\[([\d,]+)\]\S* fusion\(", line)
        if m and tuple(int(d) for d in m.group(2).split(",")) in shapes:
            copies.append(m.group(1))
    return copies


def test_the_gpu_decode_step_steers_nothing_from_the_host_and_its_layer_copy_ends_the_weight_copies():
    """The sampler's decode program for an H100, a scanned 4-layer model. By default (the stacked
    weights) no loop or branch of the step waits on the host and the cache is read by the decode
    kernel, but XLA:GPU copies every projection of every layer out of the stacked arrays at each
    step; on the sampler's per-layer copy (`unroll_layers=True`, made once per update) nothing is
    copied and fewer kernels launch."""
    import models
    from cope_jax.rollout.sampler import Sampler
    from models import qwen
    from models.config import QwenConfig

    cfg = QwenConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=640, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                     tie_word_embeddings=True, qkv_bias=True, qk_norm=False, dtype="bfloat16",
                     param_dtype="bfloat16", scan_layers=True)
    mesh = models.make_mesh((1, 1, 1), devices=targets.devices(targets.get_target("1xH100"))[:1])
    weights = {(1, *s[1:]) for n, s in qwen.param_shapes(cfg).items() if n.startswith("layers/") and len(s) > 2}

    def decode_text(**kw):
        sampler = Sampler(qwen.abstract_placed_model(cfg, mesh), batch_size=4, max_len=256, eos_ids=[], **kw)
        return sampler, sampler.lower(16)["decode"]().compile().as_text()

    sampler, stacked = decode_text()
    assert not sampler.unroll
    counted = launches.count(stacked, per_step=True)
    assert counted.host_synced == 0, counted.synced_by
    assert "__gpu$xla.gpu.triton" in stacked  # the decode kernel
    assert len(_weight_copies(stacked, weights)) >= 5
    sampler, copied = decode_text(unroll_layers=True)
    assert _weight_copies(copied, weights) == []
    assert launches.count(copied, per_step=True).kernels < counted.kernels
