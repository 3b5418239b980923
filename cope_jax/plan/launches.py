"""What a compiled GPU program launches, read from its optimized HLO: kernels, and the loops whose
trip count the host must read.

On a GPU every operation of a computation that is not pure bookkeeping (parameters, tuples,
bitcasts) is a kernel launch (a fusion, a library call, a copy, a collective), and control flow runs
on the host: a `while` whose trip count the compiler knows (`known_trip_count`: a scan, a loop of a
fixed count) runs its body that many times without asking the device, but any other `while` copies
its predicate to the host once per iteration, a device-to-host sync that stalls the stream, and a
`conditional` does so once. A decode step pays those per token, so the planner reports, for the GPU
programs, the kernels per call (per decode step for the step loop's programs) and per layer, and
the host-synced loops among them.
"""
from __future__ import annotations

import dataclasses
import re

# operations that launch nothing: bookkeeping of buffers, and the halves of async pairs that only wait
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                   "add-dependency", "opt-barrier", "partition-id", "replica-id", "all-reduce-done",
                   "all-gather-done", "collective-permute-done", "async-done", "copy-done", "send-done",
                   "recv-done"})
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9-]*)\(")
_CALLED = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Launches:
    """Per call of a computation: kernels launched, and host syncs of control flow (a loop whose
    trip count the host reads, or a conditional), each counted once per time it runs (a loop inside
    a known-count loop of 28 trips counts 28)."""

    kernels: int = 0
    host_synced: int = 0
    synced_by: tuple[str, ...] = ()  # the JAX op names of the syncing loops and conditionals, once each

    def __add__(self, other: "Launches") -> "Launches":
        names = self.synced_by + tuple(n for n in other.synced_by if n not in self.synced_by)
        return Launches(self.kernels + other.kernels, self.host_synced + other.host_synced, names)

    def __mul__(self, n: int) -> "Launches":
        return Launches(self.kernels * n, self.host_synced * n, self.synced_by)


@dataclasses.dataclass(frozen=True)
class _Op:
    opcode: str
    called: dict[str, str]
    branches: tuple[str, ...]
    trips: int | None  # a while's known trip count
    name: str  # the JAX op it came from


def parse(hlo_text: str) -> tuple[str, dict[str, list[_Op]]]:
    """(the entry computation's name, computation name -> its operations) of an HLO module's text."""
    computations: dict[str, list[_Op]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        instruction = _INSTRUCTION.match(line) if current is not None else None
        if instruction is None:
            continue
        rhs = instruction.group(1)
        opcode = _OPCODE.search(rhs)
        if opcode is None:
            continue
        branches = _BRANCHES.search(rhs)
        trips = _TRIPS.search(rhs)
        name = _NAME.search(rhs)
        current.append(_Op(opcode.group(1), dict(_CALLED.findall(rhs)),
                           tuple(b.strip().lstrip("%") for b in branches.group(1).split(",")) if branches else (),
                           int(trips.group(1)) if trips else None, name.group(1) if name else opcode.group(1)))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, computations


def count(hlo_text: str, *, per_step: bool = False) -> Launches:
    """The launches of one call of the module's entry; `per_step`: of one iteration of the entry's
    step loop instead (its outermost loop of unknown trip count: the decode loop's step), which is
    then not itself counted as host-synced."""
    entry, computations = parse(hlo_text)
    if not per_step:
        return _launches(entry, computations)
    loops = [op for op in computations[entry] if op.opcode == "while" and op.trips is None]
    if len(loops) != 1:
        raise ValueError(f"expected one step loop in the entry computation, found {len(loops)}")
    step = loops[0]
    return _launches(step.called["body"], computations) + _launches(step.called["condition"], computations)


def _launches(name: str, computations: dict[str, list[_Op]]) -> Launches:
    total = Launches()
    for op in computations[name]:
        if op.opcode == "while":
            body = _launches(op.called["body"], computations)
            if op.trips is not None:
                total += body * op.trips
            else:  # one iteration counted: the data decides how many run
                total += body + _launches(op.called["condition"], computations) + Launches(0, 1, (op.name,))
        elif op.opcode == "conditional":
            names = op.branches or tuple(op.called[k] for k in ("true_computation", "false_computation"))
            total += max((_launches(b, computations) for b in names), key=lambda x: x.kernels) + Launches(0, 1, (op.name,))
        elif op.opcode == "call":
            total += _launches(op.called["to_apply"], computations)
        elif op.opcode not in _FREE:
            total += Launches(1, 0)
    return total
