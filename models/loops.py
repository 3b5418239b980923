"""The loops of the compiled programs, and the switch that lets the planner count what they cost.

XLA's cost analysis counts a loop body once, whatever its trip count. `launch.plan` recovers the
per-iteration cost of each kind of loop by compiling the same program once more with that kind
unrolled by two (`unrolled(kind)`): the difference is one iteration, so the program's cost is the
counted cost plus (trips - 1) iterations of each kind. Every scan of the project goes through `scan`
(or, inside a custom VJP, `fori`) with its kind, so the planner's variants are the production
programs, not copies of them.

The switch is a `jax.make_user_context`: it is part of jit's cache key, so a program traced under
it never stands in for the ordinary one.
"""
from __future__ import annotations

import contextlib

import jax

KINDS = ("layers", "chunks", "micro", "attention", "cache")  # decoder layers, logits chunks,
# micro-batches, blockwise attention's (query block, key block) pairs, the filled key blocks of a KV cache

_UNROLLED = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def unrolled(kind: str, factor: int | bool = 2):
    """Traces the loops of `kind` unrolled by `factor` (True: entirely; planning and its tests).
    Nests: an enclosing `unrolled` of another kind still holds."""
    if kind not in KINDS:
        raise ValueError(f"unknown loop kind {kind!r}; expected one of {KINDS}")
    others = tuple(p for p in (_UNROLLED.value or ()) if p[0] != kind)
    with _UNROLLED(others + ((kind, factor),)):
        yield


def _factor(kind: str) -> int | bool:
    return dict(_UNROLLED.value or ()).get(kind, 1)


def scan(kind: str, body, init, xs, length: int | None = None):
    """`jax.lax.scan(body, init, xs)` over loops of `kind` (one of KINDS)."""
    return jax.lax.scan(body, init, xs, length=length, unroll=_factor(kind))


def fori(kind: str, trips, body, init):
    """`body(i, carry) -> carry` for i in 0..trips-1 as a `while_loop`, for loops that are never
    differentiated (they live inside a custom VJP, or count what only the run knows). Unlike a scan,
    a while loop is not split into known and unknown halves when an enclosing scan is differentiated
    under remat, which would stack every iteration's known values (e.g. attention masks) as
    residuals. Unrolled by `factor` like `scan`: `factor` bodies per iteration and the remainder
    peeled after the loop.

    trips: an int, or a traced count (a loop as long as the data: the filled cache blocks). Then
    the last round runs whole, so `body` must leave the carry as it is for i >= trips, and an
    entire unroll is one body."""
    factor = _factor(kind)
    if not isinstance(trips, int):
        factor = 1 if factor is True else factor
        rounds, rest = (trips + factor - 1) // factor, 0
    else:
        factor = trips if factor is True else factor
        rounds, rest = divmod(trips, factor)

    def step(state):
        i, carry = state
        for u in range(factor):
            carry = body(i * factor + u, carry)
        return i + 1, carry

    _, carry = jax.lax.while_loop(lambda state: state[0] < rounds, step, (jax.numpy.int32(0), init))
    for u in range(rest):
        carry = body(rounds * factor + u, carry)
    return carry


def map(kind: str, fn, xs):  # noqa: A001 (the lax name)
    """`jax.lax.map(fn, xs)` over loops of `kind`."""
    return scan(kind, lambda _, x: (None, fn(x)), None, xs)[1]


def trips_counted(trips: int) -> int:
    """Iterations the unrolled-by-two variant adds to the counted cost: one, or two when `trips` is
    odd (JAX then peels the last iteration outside the loop, where it is counted too)."""
    return 2 if trips % 2 and trips > 2 else 1
