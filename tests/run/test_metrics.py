"""The evaluation report's success table: per family and overall, each with its binomial standard
error, results in step order."""
from cope_jax.run import metrics


def _result(succ, episodes, families):
    return {"succ": succ, "score": succ, "episodes": episodes,
            "families": {f: {"succ": s, "episodes": n} for f, (s, n) in families.items()}}


def test_the_success_screen_orders_steps_and_gives_standard_errors():
    report = {"split": "test", "samples": 4, "results": {
        "checkpoint_10": _result(0.7, 400, {"fetch": (0.75, 200), "unlock": (0.65, 200)}),
        "step_10": _result(0.7, 400, {"fetch": (0.75, 200), "unlock": (0.65, 200)}),
        "step_0": _result(0.6, 400, {"fetch": (0.6, 200), "unlock": (0.6, 200)}),
        "step_5": {"succ": 0.5, "score": 0.5, "episodes": 100, "families": {"fetch": {"succ": 0.5}}},
    }}
    lines = metrics.success_screen(report).splitlines()
    assert lines[0] == "Test success, test split, 4 sample(s) per task (± binomial standard error):"
    assert lines[1] == "| family | start (step 0) | step 5 | step 10 | checkpoint 10 (this evaluation) |"
    # sqrt(0.6 * 0.4 / 200) = 0.0346; sqrt(0.6 * 0.4 / 400) = 0.0245; a record without counts: no error
    assert lines[3] == "| fetch | 0.600 ± 0.035 | 0.500 | 0.750 ± 0.031 | 0.750 ± 0.031 |"
    assert lines[4] == "| unlock | 0.600 ± 0.035 | - | 0.650 ± 0.034 | 0.650 ± 0.034 |"
    assert lines[5] == "| overall | 0.600 ± 0.024 | 0.500 ± 0.050 | 0.700 ± 0.023 | 0.700 ± 0.023 |"
