"""The paper configs carry Tables 9-11 (rounds, lengths, mini-batch, steps) and appendix B.4's Avg@k,
and pass the run's own length checks."""
import importlib

import pytest

from cope_jax.run import run_config

# env -> (train / eval rounds, max prompt, max response, row, PPO mini-batch tasks, steps, Avg@k)
TABLES = {
    "alfworld": ((20, 30), 1024, 8192, 16384, 2, 100, 1),
    "webshop": ((15, 15), 2048, 8192, 16384, 8, 200, 1),
    "sciworld": ((20, 30), 2048, 8192, 16384, 8, 300, 1),
    "appworld": ((30, 30), 4096, 20480, 34816, 16, 100, 1),
    "tau2": ((50, 50), 8192, 16384, 24576, 8, 50, 4),
}


@pytest.mark.parametrize("env", sorted(TABLES))
def test_paper_configs_follow_the_tables(env):
    rounds, prompt, response, row, minibatch, steps, k = TABLES[env]
    c = importlib.import_module(f"configs.{env}").get_config("cope")
    assert (c.env.max_rounds_train, c.env.max_rounds_eval) == rounds
    assert (c.rollout.max_prompt_len, c.rollout.max_response_len, c.rollout.max_len) == (prompt, response, row)
    assert (c.train.minibatch_tasks, c.train.steps, c.eval.samples) == (minibatch, steps, k)
    run_config.check_lengths(c)
    cfg = run_config.rollout_config(c, "train")
    assert (cfg.max_prompt_len, cfg.max_response_len, cfg.max_rounds) == (prompt, response, rounds[0])
