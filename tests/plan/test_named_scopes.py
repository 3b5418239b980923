"""A profile reads as the model reads: the compiled programs carry the named scopes of the decoder
layer's attention and MLP, the log-prob chunks, each loss term and the sampler's prefill and decode
step in their ops' metadata (what TensorBoard's profile plugin and Perfetto show)."""
import re

import jax

from cope_jax.plan import programs
from cope_jax.run import run_config
from tests.plan.test_plan import _tiny_config


def _scopes(text: str) -> set[str]:
    """Every name on the ops' scope paths, unwrapped from the transforms' `jvp(...)`, `transpose(...)`."""
    out = set()
    for name in re.findall(r'op_name="([^"]+)"', text):
        for part in name.split("/"):
            while (inner := re.fullmatch(r"\w+\((.*)\)", part)) is not None:
                part = inner.group(1)
            out.add(part)
    return out


def test_the_train_step_and_the_sampler_name_their_parts_in_the_compiled_hlo():
    c = _tiny_config()
    cfg = run_config.random_model_config(c, 512).replace(num_layers=2)
    _, progs = programs.run_programs(c, cfg, jax.devices()[:1], (1, 1, 1))
    compiled = {p.name: p.lower().compile().as_text() for p in progs if p.name in ("train_step", "prefill", "decode")}
    step = _scopes(compiled["train_step"])
    assert {"attention", "mlp", "logits_chunk", "logits_chunk_grad", "loss_pg", "loss_af", "loss_kl"} <= step, step
    assert {"prefill", "attention", "mlp"} <= _scopes(compiled["prefill"])
    assert {"decode_step", "attention", "mlp"} <= _scopes(compiled["decode"])
