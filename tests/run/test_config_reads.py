"""Every field of the shipped configs is read by the code: a tiny run of the demo config (warm
start, RL, checkpoints, evaluation) under an access recorder reads each leaf, and every shipped
config has exactly those leaves. A field nothing reads would be a knob that turns nothing."""
import importlib

import pytest

from configs import base
from cope_jax.stages.entry import eval_run, train_run
from models import ConfigError
from tests.config_flags import leaves
from tests.run.config_reads import recording
from tests.stages.test_partial_resume import partial_config
from tests.stages.test_train_e2e import tiny_config

def names(config) -> set[str]:
    return {name for name, _ in leaves(config)}


SHIPPED = ("demo", "sciworld", "alfworld", "webshop", "tau2", "appworld")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_has_the_base_fields(name):
    module = importlib.import_module(f"configs.{name}")
    for method in base.METHODS:
        assert names(module.get_config(method)) == names(base.base_config(method)), (name, method)


def test_a_tiny_run_reads_every_field(tmp_path):
    c = tiny_config("cope", steps=1)
    c.warmstart.update(steps=1, tasks=8, batch_episodes=4, af_examples=2)
    c.eval.update(every=1)
    with recording(c) as read:
        train_run(c, str(tmp_path / "run"), progress=False)
        eval_run(c, str(tmp_path / "run"), reevaluate=True)
    # a pretrained model's path is read only when the model is not random: the start refuses an
    # empty one, reading it
    pretrained = tiny_config("cope", steps=1)
    pretrained.model.update(init="pretrained", path="")
    with recording(pretrained) as read_too, pytest.raises(ConfigError, match="config.model.path is empty"):
        train_run(pretrained, str(tmp_path / "pretrained"), progress=False)
    # tau2's customer (env.user) is read where its spec is built: a start without its endpoint
    customer = tiny_config("cope", steps=1)
    customer.env.family, customer.env.user.kind = "tau2", "llm"
    with recording(customer) as read_three, pytest.raises(ConfigError, match="env.user: tau2's customer is an LLM"):
        train_run(customer, str(tmp_path / "customer"), progress=False)
    # partial rollouts' settings are read where their rollouts are driven
    partial = partial_config(steps=1)
    with recording(partial) as read_four:
        train_run(partial, str(tmp_path / "partial"), progress=False)
    assert names(c) - read - read_too - read_three - read_four == set()
    assert len(read) > 60  # the recorder sees the run's reads (not an empty set compared with itself)
