"""Every config value is checked once, against its declared range or set, before a run starts."""
import importlib

import pytest

from configs.base import METHODS, base_config
from cope_jax.run import config_check
from models import ConfigError

SHIPPED = ("demo", "sciworld", "alfworld", "webshop", "tau2", "appworld")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_and_method_passes(name):
    module = importlib.import_module(f"configs.{name}")
    for method in METHODS:
        config_check.check(module.get_config(method))


def test_every_rule_names_a_field_of_the_base_config():
    assert set(config_check.RULES) <= set(config_check.flat(base_config()))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.train.__setitem__("stpes", 3), r"config.train.stpes: no such field \(did you mean config.train.steps\?\)"),
    (lambda c: c.__setitem__("evl", {"every": 2}), r"config.evl.every: no such field \(did you mean config.eval.every\?\)"),
    (lambda c: c.rollout.__setitem__("group_size", 0), r"config.rollout.group_size=0: expected a whole number >= 1"),
    (lambda c: c.rollout.__setitem__("max_fault_fraction", 1.5), r"max_fault_fraction=1.5: expected a fraction in \[0, 1\]"),
    (lambda c: c.warmstart.__setitem__("lr_schedule", "linear"), r"lr_schedule='linear': expected one of 'constant', 'cosine'"),
    (lambda c: c.env.__setitem__("family", "scienceworld"), r"config.env.family='scienceworld': expected one of"),
    (lambda c: c.train.__setitem__("agg_mode", "token-sum"), r"token-sum"),
])
def test_a_bad_value_is_refused_by_name(edit, message):
    c = importlib.import_module("configs.demo").get_config("cope")
    with c.ignore_type():
        edit(c)
    with pytest.raises(ConfigError, match=message):
        config_check.check(c)


def test_a_value_of_another_type_is_refused():
    c = importlib.import_module("configs.demo").get_config("cope")
    with c.ignore_type():
        c.train.steps = "ten"
    with pytest.raises(ConfigError, match=r"config.train.steps='ten': expected type int \(like 100\)"):
        config_check.check(c)
