"""Ledger: an append-only, run-length-compressed record of every ``StepSpend`` of a run.

``Ledger.add(step, count)`` merges with the last run when the record is equal, so 200K identical steps are one
``(StepSpend, 200000)`` pair. ``to_json()`` gives a plain dict (for summary.json and checkpoints)::

    {"format": "widedp.ledger/1",
     "runs": [{"count": 200000,
               "step": {"sampling_rate": 0.0001,
                        "parts": [{"kind": "gaussian", "noise_multiplier": 0.5, "sensitivity": 1.0},
                                  {"kind": "exponential", "epsilon": 0.27, "picks": 100, "bounded_range": true}]}}]}
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

from widedp.dp.spend import (
    DiscreteGaussianSpend,
    ExponentialSpend,
    FreeSpend,
    GaussianSelectionSpend,
    GaussianSpend,
    SparseVectorSpend,
    Spend,
    StepSpend,
)
from widedp.errors import ConfigError

FORMAT = "widedp.ledger/1"

#: JSON ``kind`` of each spend record type (explicit both ways; no registry).
_KIND_OF: dict[type, str] = {
    GaussianSpend: "gaussian",
    DiscreteGaussianSpend: "discrete_gaussian",
    GaussianSelectionSpend: "gaussian_selection",
    ExponentialSpend: "exponential",
    SparseVectorSpend: "sparse_vector",
    FreeSpend: "free",
}
_TYPE_OF: dict[str, type] = {v: k for k, v in _KIND_OF.items()}


def _plain(v: Any) -> Any:
    """numpy scalars -> Python bool/int/float (JSON-able, and equal records stay equal after a round trip)."""
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return v


def spend_to_json(part: Spend) -> dict[str, Any]:
    kind = _KIND_OF.get(type(part))
    if kind is None:
        raise ConfigError(f"ledger: unknown spend record {part!r}")
    return {"kind": kind, **{k: _plain(v) for k, v in dataclasses.asdict(part).items()}}


def spend_from_json(d: dict[str, Any]) -> Spend:
    if not isinstance(d, dict) or d.get("kind") not in _TYPE_OF:
        raise ConfigError(f"ledger: bad spend record {d!r} (expected kind one of {', '.join(_TYPE_OF)})")
    cls = _TYPE_OF[d["kind"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    extra = set(d) - fields - {"kind"}
    if extra:
        raise ConfigError(f"ledger: unknown keys {sorted(extra)} in {d['kind']} record")
    try:
        return cls(**{k: v for k, v in d.items() if k != "kind"})
    except TypeError as e:
        raise ConfigError(f"ledger: bad {d['kind']} record {d!r}: {e}") from None


def step_to_json(step: StepSpend) -> dict[str, Any]:
    return {"sampling_rate": _plain(step.sampling_rate), "parts": [spend_to_json(p) for p in step.parts]}


def step_from_json(d: dict[str, Any]) -> StepSpend:
    if not isinstance(d, dict) or "sampling_rate" not in d or not isinstance(d.get("parts"), list):
        raise ConfigError(f"ledger: bad step record {d!r}")
    return StepSpend(sampling_rate=d["sampling_rate"], parts=tuple(spend_from_json(p) for p in d["parts"]))


class Ledger:
    """Append-only list of ``(StepSpend, count)`` runs; consecutive equal records are merged."""

    __slots__ = ("_runs",)

    def __init__(self, runs: Iterable[tuple[StepSpend, int]] = ()) -> None:
        self._runs: list[tuple[StepSpend, int]] = []
        for step, count in runs:
            self.add(step, count)

    def add(self, step: StepSpend, count: int = 1) -> None:
        """Record ``count`` more steps that each spent ``step``."""
        if not isinstance(step, StepSpend):
            raise ConfigError(f"ledger: expected a StepSpend, got {type(step).__name__}")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ConfigError(f"ledger: count must be an integer >= 0, got {count!r}")
        count = int(count)
        if count == 0:
            return
        if self._runs and self._runs[-1][0] == step:
            self._runs[-1] = (step, self._runs[-1][1] + count)
        else:
            self._runs.append((step, count))

    @property
    def runs(self) -> tuple[tuple[StepSpend, int], ...]:
        return tuple(self._runs)

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(c for _, c in self._runs)

    def __iter__(self) -> Iterator[tuple[StepSpend, int]]:
        return iter(tuple(self._runs))

    def __len__(self) -> int:
        return len(self._runs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ledger) and self._runs == other._runs

    def __repr__(self) -> str:
        return f"Ledger({self._runs!r})"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "runs": [{"count": c, "step": step_to_json(s)} for s, c in self._runs]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Ledger:
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("runs"), list):
            raise ConfigError(f"ledger: expected a dict with format {FORMAT!r} and a list of runs")
        led = cls()
        for r in d["runs"]:
            if not isinstance(r, dict) or set(r) != {"count", "step"}:
                raise ConfigError(f"ledger: bad run {r!r} (expected keys count, step)")
            led.add(step_from_json(r["step"]), r["count"])
        return led
