"""Acceptance on this machine's accelerator: `python -m launch.accept` (`__main__.py`), one module per section."""
