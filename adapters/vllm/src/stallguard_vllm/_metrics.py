"""stallguard's Prometheus counters on vLLM's own ``/metrics``, the vLLM way.

vLLM serves ``/metrics`` from the API-server process; the engine core's numbers reach it
as KV-connector stats: the scheduler calls ``connector.get_kv_connector_stats()`` every
step (``Scheduler.update_from_output``), ships the stats' ``data`` dict to the frontend
with the scheduler stats, and the frontend rebuilds them with the connector class's
``build_kv_connector_stats`` and records them through its ``build_prom_metrics``. The
stallguard connectors plug into those three hooks, so the metrics appear next to
vLLM's ``vllm:nixl_*`` metrics, with vLLM's engine labels (``model_name``, ``engine``)
first, then stallguard's (the vocabulary stallguard-sglang uses too: ``state``,
``reason``):

* ``vllm:stallguard_forced_failures_total{state=...,reason=...}`` - requests failed
  (enforce); ``reason`` is ``state`` (a phase deadline) or ``stall``. The 0.1 label
  ``phase`` (the same value as ``state``) is kept for the 0.1.x releases and goes in 0.2;
* ``vllm:stallguard_stalls_reported_total{state=...,reason=...}`` - overdue in report
  mode (and every ``Queued`` overstay, which is always report-only); ``phase`` as above;
* ``vllm:stallguard_state_seconds`` (histogram, ``state``): seconds a request stayed in
  a phase, buckets ``stallguard.adapters.LADDER`` (as stallguard-sglang's), for advise;
* ``vllm:stallguard_deadline_seconds{state=...}`` (gauge) - the phase deadline in force
  (no series for a phase without one), and ``vllm:stallguard_oldest_age_seconds`` - the
  oldest request in the phase now (0: none);
* ``vllm:stallguard_quarantined_blocks{peer=...}``, ``vllm:stallguard_quarantined_bytes``
  and ``vllm:stallguard_quarantine_overdue`` (gauges) - the blocks of failed requests
  held until NIXL reports their transfers over, per prefill engine id, and how many of
  those holds are past the ``Quarantined`` deadline (docs/vllm.md).
"""

from __future__ import annotations

import math
from collections import Counter as _Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from stallguard.adapters import LADDER, add_to_histogram

from ._names import (
    DEADLINE,
    FORCED_FAILURES,
    OLDEST_AGE,
    QUARANTINE_OVERDUE,
    QUARANTINED_BLOCKS,
    QUARANTINED_BYTES,
    STALLS_REPORTED,
    STATE_SECONDS,
)

__all__ = [
    "DEADLINE",
    "FORCED_FAILURES",
    "OLDEST_AGE",
    "QUARANTINED_BLOCKS",
    "QUARANTINED_BYTES",
    "QUARANTINE_OVERDUE",
    "STALLS_REPORTED",
    "STATE_SECONDS",
    "StallguardNixlPromMetrics",
    "StallguardNixlStats",
    "StallguardSeries",
    "add_to_data",
    "add_to_histogram",
    "exported_counts",
    "has_ours",
    "reduce_ours",
    "stats_with_counts",
]

_KEYS = {"forced": "stallguard_forced", "reported": "stallguard_reported"}
#: data key: a list of time-in-state exports (PhaseTracker.take_stays), oldest first
_STAYS = "stallguard_stays"
#: data key: a list of quarantine snapshots (each ``[[peer, holds, blocks, bytes,
#: overdue], ...]``), the last one current
_QUARANTINE = "stallguard_quarantine"
#: every data key stallguard adds to a connector's stats (each a list)
_OURS = (*_KEYS.values(), _QUARANTINE, _STAYS)


def has_ours(data: dict[str, Any]) -> bool:
    """Whether a stats' *data* carries anything of stallguard's (an expiry, a
    quarantine snapshot, a time-in-state export)."""
    return any(data.get(k) for k in _OURS)


def reduce_ours(data: dict[str, Any], out: dict[str, int | float]) -> dict[str, int | float]:
    """*out* (a stats' ``reduce()``) with stallguard's figures from its *data* added:
    the expiries, and the blocks quarantined now (if a snapshot came)."""
    out["stallguard forced failures"] = len(data.get("stallguard_forced", ()))
    out["stallguard stalls reported"] = len(data.get("stallguard_reported", ()))
    snapshots = data.get(_QUARANTINE) or ()
    if snapshots:
        out["stallguard quarantined blocks"] = sum(int(r[2]) for r in snapshots[-1])
    return out


class StallguardNixlStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus two lists of phase names (one entry per expiry)."""

    def reset(self) -> None:
        super().reset()
        self.data["stallguard_forced"] = []
        self.data["stallguard_reported"] = []
        self.data[_STAYS] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in _KEYS.values():  # data built by vLLM's worker stats lacks them
            self.data.setdefault(key, [])

    def is_empty(self) -> bool:
        return super().is_empty() and not has_ours(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_ours(self.data, dict(super().reduce()))


def stats_with_counts(
    stats: KVConnectorStats | None,
    counts: _Counter[tuple[str, str, str]] | None,
    quarantine: list[list[Any]] | None = None,
    stays: list[list[Any]] | None = None,
) -> KVConnectorStats | None:
    """*stats* (vLLM's, possibly None) as :class:`StallguardNixlStats`, with *counts*
    (``(kind, phase, reason) -> n``; kinds other than forced/reported are not exported
    as counters) appended as ``[phase, reason]`` entries, the *quarantine* snapshot (see
    :meth:`PhaseTracker.take_quarantine`) and the time-in-state export *stays*
    (:meth:`PhaseTracker.take_stays`); None when there is nothing to report."""
    exported = exported_counts(counts)
    news = bool(exported) or quarantine is not None or stays is not None
    if not news and (stats is None or isinstance(stats, StallguardNixlStats)):
        return stats
    out = StallguardNixlStats(data=dict(stats.data)) if stats is not None else StallguardNixlStats()
    add_to_data(out.data, exported, quarantine, stays)
    return out


def exported_counts(
    counts: _Counter[tuple[str, str, str]] | None,
) -> dict[tuple[str, str, str], int]:
    """The counts of *counts* exported as counters: forced and reported expiries."""
    return {k: n for k, n in (counts or {}).items() if k[0] in _KEYS}


def add_to_data(
    data: dict[str, Any],
    exported: dict[tuple[str, str, str], int],
    quarantine: list[list[Any]] | None,
    stays: list[list[Any]] | None,
) -> None:
    """Add to a stats' *data* the *exported* counts (``[phase, reason]`` entries, one
    per expiry), the *quarantine* snapshot and the time-in-state export *stays*."""
    for (kind, phase, *rest), n in exported.items():
        reason = rest[0] if rest else "state"
        data.setdefault(_KEYS[kind], []).extend([[phase, reason]] * n)
    if quarantine is not None:
        data.setdefault(_QUARANTINE, []).append(quarantine)
    if stays is not None:
        data.setdefault(_STAYS, []).append(stays)


def _entry(value: Any) -> tuple[str, str]:
    """A shipped expiry entry as ``(phase, reason)`` (0.1 shipped the phase alone)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return str(value[0]), str(value[1])
    return str(value), "state"


class StallguardSeries:
    """stallguard's Prometheus series on vLLM's metric classes (what ``observe`` of the
    connectors' ``KVConnectorPromMetrics`` adds): the two counters (``state``,
    ``reason``, and the 0.1 label ``phase``), the quarantine gauges per peer, time in
    state, the deadline and the oldest age per state."""

    def __init__(
        self, counter_cls: Any, gauge_cls: Any, histogram_cls: Any, labelnames: list[str]
    ) -> None:
        # "phase": the 0.1 label (the value of "state"), kept for the 0.1.x releases
        names = [*labelnames, "state", "reason", "phase"]
        self.counters = {
            "stallguard_forced": counter_cls(
                name=FORCED_FAILURES,
                documentation="Disaggregated requests stallguard failed for overstaying "
                "a per-phase deadline (through vLLM's failed-receive path).",
                labelnames=names,
            ),
            "stallguard_reported": counter_cls(
                name=STALLS_REPORTED,
                documentation="Disaggregated requests stallguard found overdue and only "
                "reported (report mode, or the Queued phase).",
                labelnames=names,
            ),
        }
        peer_names = [*labelnames, "peer"]
        self.gauges = [
            gauge_cls(
                name=name,
                documentation=doc,
                labelnames=peer_names,
                multiprocess_mode="mostrecent",
            )
            for name, doc in (
                (
                    QUARANTINED_BLOCKS,
                    "KV blocks of failed requests stallguard holds until the connector "
                    "reports every transfer into them over, by prefill engine id.",
                ),
                (QUARANTINED_BYTES, "Bytes of those blocks, by prefill engine id."),
                (
                    QUARANTINE_OVERDUE,
                    "Quarantined requests past the Quarantined deadline (their peer has "
                    "not ended its transfers: see docs/vllm.md for what to do).",
                ),
            )
        ]
        #: engine_idx -> peers with a non-zero gauge (set to 0 when they leave)
        self.peers: dict[int, set[str]] = {}
        state_names = [*labelnames, "state"]
        self.seconds = histogram_cls(
            name=STATE_SECONDS,
            documentation="Seconds a disaggregated request stayed in a stallguard phase "
            "(recorded when it left the phase).",
            labelnames=state_names,
            buckets=[*LADDER, math.inf],
        )
        self.deadline = gauge_cls(
            name=DEADLINE,
            documentation="The stallguard phase deadline in force, seconds (no series: "
            "the phase has no deadline).",
            labelnames=state_names,
            multiprocess_mode="mostrecent",
        )
        self.oldest = gauge_cls(
            name=OLDEST_AGE,
            documentation="Age of the oldest request in a stallguard phase now, seconds "
            "(0: none in it).",
            labelnames=state_names,
            multiprocess_mode="mostrecent",
        )

    def observe(self, labels: list[str], data: dict[str, Any], engine_idx: int) -> None:
        """Add what one stats ``data`` dict carries (see :func:`stats_with_counts`)."""
        for key, counter in self.counters.items():
            for value in data.get(key, ()):
                phase, reason = _entry(value)
                counter.labels(*labels, phase, reason, phase).inc()
        for export in data.get(_STAYS) or ():
            self._observe_stays(labels, export)
        snapshots = data.get(_QUARANTINE)
        if snapshots:
            self._observe_quarantine(labels, snapshots[-1], engine_idx)

    def _observe_quarantine(self, labels: list[str], rows: list[Any], engine_idx: int) -> None:
        """Set the quarantine gauges of engine *engine_idx* from its current snapshot
        (``[peer, holds, blocks, bytes, overdue]`` rows); a peer gone from it is set to
        zero."""
        now: dict[str, tuple[int, int, int]] = {
            str(r[0]): (int(r[2]), int(r[3]), int(r[4])) for r in rows
        }
        before = self.peers.get(engine_idx, set())
        for peer in before - set(now):
            now[peer] = (0, 0, 0)
        for peer, values in now.items():
            for gauge, value in zip(self.gauges, values, strict=True):
                gauge.labels(*labels, peer).set(value)
        self.peers[engine_idx] = {p for p, v in now.items() if any(v)}

    def _observe_stays(self, labels: list[str], rows: list[list[Any]]) -> None:
        """Add one time-in-state export (``[phase, counts, seconds, deadline, oldest]``
        rows) to the histogram and set the gauges."""
        for phase, counts, seconds, deadline, oldest in rows:
            child = self.seconds.labels(*labels, str(phase))
            add_to_histogram(child, [int(c) for c in counts], float(seconds))
            if deadline is not None:
                self.deadline.labels(*labels, str(phase)).set(float(deadline))
            self.oldest.labels(*labels, str(phase)).set(float(oldest))


class StallguardNixlPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus stallguard's series (:class:`StallguardSeries`)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._sg = StallguardSeries(
            self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        self._sg.observe(labels, transfer_stats_data, engine_idx)
