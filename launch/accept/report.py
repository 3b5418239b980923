"""`launch.accept`'s report: one check per measured number, beside its prediction, as JSON and a table."""
from __future__ import annotations

import dataclasses

SECTIONS = ("train", "attention", "sampler", "rl")  # the order a run and its report take


@dataclasses.dataclass
class Check:
    """One measured number beside its prediction (None: not measured / no prediction, `note` says why).
    `within`: the largest measured / predicted ratio that counts as met."""

    section: str
    name: str
    unit: str
    measured: float | None
    predicted: float | None = None
    within: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted

    @property
    def met(self) -> bool | None:
        if self.within is None or self.ratio is None:
            return None
        return self.ratio <= self.within

    def record(self) -> dict:
        return dict(dataclasses.asdict(self), ratio=self.ratio, met=self.met)


def table(checks: list[Check], header: str) -> str:
    rows = [("section", "check", "measured", "predicted", "ratio", "met", "note")]
    for c in checks:
        rows.append((c.section, c.name, _num(c.measured, c.unit), _num(c.predicted, c.unit),
                     "-" if c.ratio is None else f"{c.ratio:.3g}", {None: "-", True: "yes", False: "**no**"}[c.met],
                     c.note))
    lines = [header, "", "| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines) + "\n"


def _num(x, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "B":
        return f"{x / (1 << 20):.4g} MiB"
    return f"{x:.4g} {unit}".strip()
