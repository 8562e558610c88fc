"""Reducible metrics: every number ``asyncrl.algo`` reports, with how to combine it.

Owns: the ``Stat`` record (a reduction op plus its sufficient statistics), ``MetricDict`` (a plain
``dict[str, float]`` of display values that also carries the ``Stat`` behind each value), the
``merge_metrics`` reduction, and ``StatsBuilder`` which turns tensors into stats with one host sync.

Never: imports torch.distributed, logs, or keeps state between calls.

Invariants:
* A ``Stat`` holds sums, never means, so merging parts (micro-batches, minibatches, ranks) in any
  order and grouping gives the same value as computing it over the union (up to float rounding).
* ``op`` decides the merge: ``mean`` (a = sum of values, b = count), ``sum`` (a), ``max`` (a),
  ``min`` (a), ``ess`` (a = sum w, b = sum w^2, c = count). Percentiles are reported as ``max``
  of the parts' percentiles, an upper bound of the union's percentile (documented per metric).
* A metric whose set is empty (mean with count 0, max of nothing, ESS of nothing) has a ``Stat``
  but no display value: it is left out of the dict rather than reported as 0 or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

__all__ = ["Stat", "MetricDict", "merge_metrics", "StatsBuilder", "STAT_OPS"]

STAT_OPS = ("mean", "sum", "max", "min", "ess")


class Stat(NamedTuple):
    """Sufficient statistics of one metric. See the module docstring for the meaning of a, b, c."""

    op: str
    a: float
    b: float = 0.0
    c: float = 0.0

    def value(self) -> float | None:
        """The displayed value, or None when the metric is undefined (empty set)."""
        if self.op == "mean":
            return self.a / self.b if self.b > 0 else None
        if self.op == "sum":
            return self.a
        if self.op == "max":
            return self.a if self.a != -math.inf else None
        if self.op == "min":
            return self.a if self.a != math.inf else None
        if self.op == "ess":
            return (self.a * self.a) / (self.c * self.b) if self.b > 0 and self.c > 0 else None
        raise ValueError(f"unknown stat op {self.op!r}; valid ops: {', '.join(STAT_OPS)}")

    def merge(self, other: Stat) -> Stat:
        if other.op != self.op:
            raise ValueError(f"cannot merge a {self.op!r} stat with a {other.op!r} stat of the same name")
        if self.op in ("mean", "sum", "ess"):
            return Stat(self.op, self.a + other.a, self.b + other.b, self.c + other.c)
        if self.op == "max":
            return Stat("max", max(self.a, other.a))
        return Stat("min", min(self.a, other.a))


class MetricDict(dict[str, float]):
    """``dict[str, float]`` of display values; ``.stats`` holds the reducible ``Stat`` per name.

    Log the dict as is. To combine several calls (micro-batches, minibatches, ranks gathered with
    ``torch.distributed.all_gather_object``), pass them to ``merge_metrics``; never average the
    display values. ``.stats`` is the source of truth: editing the dict does not change it.
    """

    stats: dict[str, Stat]

    def __init__(self, stats: Mapping[str, Stat] | None = None) -> None:
        stats = dict(stats or {})
        super().__init__()
        for name in sorted(stats):
            v = stats[name].value()
            if v is not None:
                self[name] = float(v)
        self.stats = stats


def merge_metrics(parts: Iterable[MetricDict | Mapping[str, Stat]]) -> MetricDict:
    """Combine metrics of disjoint parts of a batch into the metrics of the whole.

    Each part is a ``MetricDict`` or a plain ``{name: Stat}`` mapping. Names absent from a part
    simply did not occur there (e.g. a staleness bucket with no token on that rank).
    """
    out: dict[str, Stat] = {}
    for part in parts:
        stats = part.stats if isinstance(part, MetricDict) else part
        for name, st in stats.items():
            out[name] = out[name].merge(st) if name in out else Stat(*st)
    return MetricDict(out)


class StatsBuilder:
    """Collects tensor-valued statistics and converts them with a single device-to-host copy.

    All inputs are detached; call it under ``torch.no_grad()``. Sums are taken in float64.
    """

    def __init__(self) -> None:
        self._names: list[str] = []
        self._ops: list[str] = []
        self._parts: list[list[torch.Tensor]] = []
        self._host: dict[str, Stat] = {}

    def _add(self, name: str, op: str, *parts: torch.Tensor) -> None:
        self._names.append(name)
        self._ops.append(op)
        self._parts.append([p.detach().to(torch.float64).reshape(()) for p in parts])

    def mean(self, name: str, values: torch.Tensor, where: torch.Tensor) -> None:
        """Mean of ``values`` over the True entries of ``where`` (same shape)."""
        w = where.bool()
        self._add(
            name, "mean", torch.where(w, values, 0).sum(dtype=torch.float64), w.sum(dtype=torch.float64)
        )

    def frac(self, name: str, indicator: torch.Tensor, where: torch.Tensor) -> None:
        """Fraction of the True entries of ``where`` where ``indicator`` is True."""
        self.mean(name, indicator.to(torch.float64), where)

    def total(self, name: str, values: torch.Tensor) -> None:
        """A counter or additive quantity (summed over parts)."""
        self._add(name, "sum", values.sum(dtype=torch.float64) if values.dim() else values)

    def maximum(self, name: str, values: torch.Tensor, where: torch.Tensor) -> None:
        w = where.bool()
        v = torch.where(w, values.to(torch.float64), -math.inf)
        self._add(
            name,
            "max",
            v.max() if v.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=v.device),
        )

    def minimum(self, name: str, values: torch.Tensor, where: torch.Tensor) -> None:
        w = where.bool()
        v = torch.where(w, values.to(torch.float64), math.inf)
        self._add(
            name,
            "min",
            v.min() if v.numel() else torch.tensor(math.inf, dtype=torch.float64, device=v.device),
        )

    def ess(self, name: str, weights: torch.Tensor, where: torch.Tensor) -> None:
        """Normalised effective sample size (sum w)^2 / (N sum w^2) of the weights where True."""
        w = where.bool()
        x = torch.where(w, weights.to(torch.float64), 0)
        self._add(name, "ess", x.sum(), (x * x).sum(), w.sum(dtype=torch.float64))

    def raw(self, name: str, op: str, *parts: torch.Tensor) -> None:
        """A statistic whose parts (0-d tensors, see ``Stat``) are already computed."""
        if op not in STAT_OPS:
            raise ValueError(f"unknown stat op {op!r}; valid ops: {', '.join(STAT_OPS)}")
        self._add(name, op, *parts)

    def put(self, name: str, stat: Stat) -> None:
        """A statistic already on the host (e.g. a percentile computed separately)."""
        self._host[name] = stat

    def build(self) -> MetricDict:
        stats: dict[str, Stat] = {}
        flat = [p for parts in self._parts for p in parts]
        if flat:  # one device, one stack, one device-to-host copy (parts may come from several devices)
            dev = next((p.device for p in flat if p.device.type != "cpu"), flat[0].device)
            values = torch.stack([p.to(dev) for p in flat]).cpu().tolist()
        else:
            values = []
        i = 0
        for name, op, parts in zip(self._names, self._ops, self._parts, strict=True):
            n = len(parts)
            st = Stat(op, *values[i : i + n])
            i += n
            stats[name] = stats[name].merge(st) if name in stats else st
        for name, st in self._host.items():
            stats[name] = stats[name].merge(st) if name in stats else st
        return MetricDict(stats)
