"""stallguard's Prometheus counters for a wrapped connector (``StallguardConnector`` and
the NIXL connectors built on it): the inner connector's own stats and metrics, plus
stallguard's, shipped the vLLM way (see ``_metrics.py`` for the path and the names).

The stats' ``data`` holds stallguard's keys (``stallguard_forced``,
``stallguard_reported``, ``stallguard_quarantine``) at the top, the inner connector's
``data`` under ``stallguard_inner`` and the inner connector class (``module:QualName``,
to rebuild its stats in the API server) under ``stallguard_inner_class``.
"""

from __future__ import annotations

import importlib
from collections import Counter as _Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ._metrics import (
    _KEYS,
    _OURS,
    _QUARANTINE,
    _STAYS,
    StallguardSeries,
    add_to_data,
    exported_counts,
    has_ours,
    reduce_ours,
)

__all__ = ["INNER_CLASS", "INNER_DATA", "StallguardPromMetrics", "StallguardStats"]

#: data keys: the inner connector's stats data, and its connector class
INNER_DATA = "stallguard_inner"
INNER_CLASS = "stallguard_inner_class"


def _class(path: str) -> Any:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _inner_stats(data: dict[str, Any]) -> KVConnectorStats | None:
    inner = data.get(INNER_DATA)
    path = data.get(INNER_CLASS)
    if inner is None or not path:
        return None
    if isinstance(inner, KVConnectorStats):
        return inner
    stats: KVConnectorStats | None = _class(str(path)).build_kv_connector_stats(data=inner)
    return stats


class StallguardStats(KVConnectorStats):
    """The inner connector's stats plus stallguard's (one phase name per expiry)."""

    def reset(self) -> None:
        for key in _KEYS.values():
            self.data[key] = []
        self.data.pop(_QUARANTINE, None)
        self.data.pop(_STAYS, None)
        inner = _inner_stats(self.data)
        if inner is not None:
            inner.reset()
            self.data[INNER_DATA] = inner.data

    def is_empty(self) -> bool:
        if has_ours(self.data):
            return False
        inner = _inner_stats(self.data)
        return inner is None or inner.is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        data = other.data
        for key in _OURS:
            if data.get(key):
                self.data.setdefault(key, []).extend(data[key])
        theirs = _inner_stats(data) if isinstance(other, StallguardStats) else other
        if theirs is not None and not theirs.is_empty():
            self._aggregate_inner(theirs, data.get(INNER_CLASS))
        return self

    def _aggregate_inner(self, theirs: KVConnectorStats, inner_class: object) -> None:
        """Add *theirs*, another inner connector's stats (of *inner_class*), to this
        one's inner stats (theirs become them if this one has none yet)."""
        mine = _inner_stats(self.data)
        if mine is None:
            self.data[INNER_DATA] = dict(theirs.data)
            self.data[INNER_CLASS] = inner_class
        else:
            self.data[INNER_DATA] = mine.aggregate(theirs).data

    def reduce(self) -> dict[str, int | float]:
        inner = _inner_stats(self.data)
        return reduce_ours(self.data, dict(inner.reduce()) if inner is not None else {})


def stats_with_counts(
    stats: KVConnectorStats | None,
    counts: _Counter[tuple[str, str, str]] | None,
    quarantine: list[list[Any]] | None = None,
    stays: list[list[Any]] | None = None,
    *,
    inner_cls: type,
) -> KVConnectorStats | None:
    """The inner connector's *stats* (possibly None) as :class:`StallguardStats`, with
    *counts* (``(kind, phase, reason) -> n``; kinds other than forced/reported are not
    exported) as ``[phase, reason]`` entries, the *quarantine* snapshot and the
    time-in-state export *stays*; None when there is nothing to report."""
    exported = exported_counts(counts)
    if not exported and quarantine is None and stays is None and stats is None:
        return None
    out = stats if isinstance(stats, StallguardStats) else _wrapped(stats, inner_cls)
    add_to_data(out.data, exported, quarantine, stays)
    return out


def _wrapped(stats: KVConnectorStats | None, inner_cls: type) -> StallguardStats:
    """New :class:`StallguardStats` carrying the inner connector's *stats* (if any) and
    its class."""
    out = StallguardStats()
    if stats is not None:
        out.data[INNER_DATA] = stats.data
        out.data[INNER_CLASS] = f"{inner_cls.__module__}:{inner_cls.__qualname__}"
    return out


class StallguardPromMetrics(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics (if any) plus stallguard's counters and
    quarantine gauges (the names of ``_metrics.py``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        *,
        inner: KVConnectorPromMetrics | None = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner
        self._sg = StallguardSeries(
            self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        inner = transfer_stats_data.get(INNER_DATA)
        if self.inner is not None and inner:
            self.inner.observe(inner, engine_idx)
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        self._sg.observe(labels, transfer_stats_data, engine_idx)
