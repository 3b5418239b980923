"""The RL step's record: Succ / Score combined as the family says (tau2: the mean of its domains),
and a max over the step's optimizer steps is a max, a mean a mean."""
import numpy as np
import pytest

from cope_jax.rollout.runner import RolloutStats
from cope_jax.rollout.trajectory import Trajectory
from cope_jax.run import metrics
from cope_jax.stages.rl import _combine, _step_record
from envs.builtin import BuiltinEnv
from envs.tau2 import Tau2Env


def _episodes(domain: str, n: int, success: bool) -> list[Trajectory]:
    return [Trajectory(tokens=np.ones(3, np.int32), action_mask=np.zeros(3, bool), obs_mask=np.zeros(3, bool),
                       score=float(success), success=success, family=domain) for _ in range(n)]


def test_tau2_overall_is_the_unweighted_mean_of_its_domains():
    trajs = _episodes("retail", 40, True) + _episodes("airline", 20, False) + _episodes("telecom", 30, True)
    tau2 = metrics.summarize(trajs, overall=Tau2Env.overall)
    assert tau2["succ"] == pytest.approx(2 / 3) and tau2["score"] == pytest.approx(2 / 3)
    assert {f: v["episodes"] for f, v in tau2["families"].items()} == {"retail": 40, "airline": 20, "telecom": 30}
    counted = metrics.summarize(trajs, overall=BuiltinEnv.overall)  # every other family: per episode
    assert counted["succ"] == pytest.approx(70 / 90)


def test_the_step_record_reports_tau2_as_its_domain_mean():
    trajs = _episodes("retail", 40, True) + _episodes("airline", 20, False)
    stats = RolloutStats(wall_s=1.0, generated_tokens=10, env_steps=5, decode_calls=4, rows_decoded=6,
                         row_capacity=16, low_occupancy_s=0.25, host_wall_s=1.0, prefill_tokens=300)
    rec = _step_record(trajs, [], {}, [], stats, [], 1.0, 1.0, Tau2Env.overall)
    assert rec["succ"] == pytest.approx(0.5)  # count-weighted would say 0.667
    assert rec["rollout_occupancy"] == 6 / 16 and rec["rollout_low_occupancy_share"] == 0.25
    assert rec["rollout_prefill_tokens"] == 300


def test_a_max_is_a_max_and_a_mean_a_mean():
    steps = [{"loss": 1.0, "grad_norm": 2.0, "grad_norm_af": 1.0, "sampler_drift_max": 0.1},
             {"loss": 3.0, "grad_norm": 6.0, "grad_norm_af": 5.0, "sampler_drift_max": 0.5}]
    assert _combine(steps) == {"loss": 2.0, "grad_norm": 4.0, "grad_norm_max": 6.0, "grad_norm_af": 3.0,
                               "grad_norm_af_max": 5.0, "sampler_drift_max": 0.5}
    assert _combine([]) == {}
