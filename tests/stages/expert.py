"""Expert successes injected into RL steps (tests only)."""
import dataclasses


def with_a_success_per_group(monkeypatch):
    """Each RL step's first episode of every group is replaced by the expert's successful play of
    the same task (a tiny random policy rarely succeeds, and a method whose rows need a success --
    rft, sft_success, cope's forecasting -- would train nothing without one)."""
    from cope_jax.run.demos import expert_trajectories
    from cope_jax.stages import loop, rl

    real, cache = rl.rollout, {}

    def rollout(parts, runner, schedule, key, next_schedule=(), on_progress=None):
        trajs, stats = real(parts, runner, schedule, key, next_schedule, on_progress)
        first = {}
        for i, t in enumerate(trajs):
            first.setdefault(t.group_id, i)
        for g, i in first.items():
            task = trajs[i].task_id
            if task not in cache:
                (cache[task],) = expert_trajectories(loop.rollout_runner(parts, "train"), [task], max_rounds=30)
            trajs[i] = dataclasses.replace(cache[task], group_id=g)
        return trajs, stats

    monkeypatch.setattr(rl, "rollout", rollout)
