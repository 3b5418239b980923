"""The packed-row attention rule, written once for the XLA paths and both kernels
(`models/attention.py` documents it on `MaskIds`)."""
from __future__ import annotations


def allowed(queries, keys):
    """(segment, index, branch, first) of the queries and (segment, index, branch, position) of the
    keys, arrays that broadcast against each other -> bool: may the query attend to the key.
    Same segment, not in the future, and either the same branch or the shared history before the
    query's branch begins."""
    qs, qi, qb, qf = queries
    ks, ki, kb, kp = keys
    return (qs == ks) & (qi >= ki) & ((qb == kb) | ((kb == 0) & (kp < qf)))
