"""Experiments of the method rather than measurements of the code: the ablation sweep
(`python -m launch.bench --suite=ablation`) and the planner's fit table (`python -m launch.experiments.fit_table`)."""
