"""The learning benchmark's comparison: mean curves over seeds and steps to reach the reference."""
from launch.bench_learning import compare


def test_steps_to_reference_uses_seed_means():
    curves = {
        "cope": {0: {0: 0.1, 5: 0.3, 10: 0.5}, 1: {0: 0.1, 5: 0.5, 10: 0.7}},
        "grpo": {0: {0: 0.1, 5: 0.2, 10: 0.3}, 1: {0: 0.1, 5: 0.2, 10: 0.5}},
    }
    by_method = {r["method"]: r for r in compare(curves, "grpo")}
    assert by_method["grpo"]["reference_final_mean_succ"] == 0.4
    assert by_method["cope"]["mean_curve"] == {"0": 0.1, "5": 0.4, "10": 0.6}
    assert by_method["cope"]["steps_to_reference"] == 5      # mean 0.4 at step 5 reaches GRPO's final 0.4
    assert by_method["grpo"]["steps_to_reference"] == 10
    assert by_method["cope"]["final_mean_succ"] == 0.6


def test_never_reaching_the_reference_is_none():
    curves = {"cope": {0: {0: 0.2, 5: 0.1}}, "grpo": {0: {0: 0.2, 5: 0.3}}}
    by_method = {r["method"]: r for r in compare(curves, "grpo")}
    assert by_method["cope"]["steps_to_reference"] is None
    # only steps seen by every seed count
    curves = {"cope": {0: {0: 0.1, 5: 0.9}, 1: {0: 0.1}}, "grpo": {0: {0: 0.1, 5: 0.2}}}
    assert {r["method"]: r for r in compare(curves, "grpo")}["cope"]["mean_curve"] == {"0": 0.1}
