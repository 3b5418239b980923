"""Which fields of a config the code reads: an access recorder on ml_collections.ConfigDict."""
import contextlib

import ml_collections

_BULK = ("to_dict", "to_json", "items", "values", "__eq__", "__repr__", "__str__", "copy_and_resolve_references")


@contextlib.contextmanager
def recording(config):
    """Yields the set of dotted field names read from `config` (or its sections) by name while the
    block runs. Bulk reads (to_json for config.json, equality, printing) are not reads of a field."""
    names = {}

    def walk(d, prefix):
        names[id(d)] = prefix
        for key in d.keys():
            if isinstance(d[key], ml_collections.ConfigDict):
                walk(d[key], f"{prefix}{key}.")

    walk(config, "")
    read, bulk = set(), [0]
    cls = ml_collections.ConfigDict
    getitem = cls.__getitem__

    def recorded(self, key):
        value = getitem(self, key)
        if not bulk[0] and id(self) in names and isinstance(key, str) and "." not in key:
            read.add(names[id(self)] + key)
        return value

    def suspended(method):
        def call(self, *args, **kwargs):
            bulk[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                bulk[0] -= 1
        return call

    originals = {m: getattr(cls, m) for m in _BULK if hasattr(cls, m)}
    try:
        cls.__getitem__ = recorded
        for m, f in originals.items():
            setattr(cls, m, suspended(f))
        yield read
    finally:
        cls.__getitem__ = getitem
        for m, f in originals.items():
            setattr(cls, m, f)
