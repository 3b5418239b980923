"""A test's config as the command-line flags a user would pass on top of a shipped config."""


def override_flags(config, shipped) -> list[str]:
    """`--config.<dotted field>=<value>` for every leaf of `config` that differs from `shipped`
    (nested sections such as train.lora included; a tuple as the flag parser reads one)."""
    base = dict(leaves(shipped))
    return [f"--config.{key}={_flag_value(v)}" for key, v in leaves(config) if base.get(key) != v]


def leaves(d, prefix=""):
    """(dotted field name, value) of every leaf of a config, nested sections walked."""
    for k, v in d.items():
        if hasattr(v, "items"):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _flag_value(v):
    return f"({','.join(map(repr, v))},)" if isinstance(v, tuple) else v
