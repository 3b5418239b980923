"""ml_collections configs: `--config=configs/<env>.py:<method>` (one config per (environment, method))."""
