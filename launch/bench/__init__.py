"""Benchmark suites: `python -m launch.bench --suite=NAME` (`__main__.py`), one module per suite."""
