"""stallguard's Prometheus counters on vLLM's own ``/metrics``, the vLLM way.

vLLM serves ``/metrics`` from the API-server process; the engine core's numbers reach it
as KV-connector stats: the scheduler calls ``connector.get_kv_connector_stats()`` every
step (``Scheduler.update_from_output``), ships the stats' ``data`` dict to the frontend
with the scheduler stats, and the frontend rebuilds them with the connector class's
``build_kv_connector_stats`` and records them through its ``build_prom_metrics``. The
stallguard connectors plug into those three hooks, so the counters appear next to
vLLM's ``vllm:nixl_*`` metrics, with vLLM's engine labels plus ``phase``:

* ``vllm:stallguard_forced_failures_total{phase=...}`` - requests failed (enforce);
* ``vllm:stallguard_stalls_reported_total{phase=...}`` - overdue in report mode (and
  every ``Queued`` overstay, which is always report-only);
* ``vllm:stallguard_quarantined_blocks{peer=...}``, ``vllm:stallguard_quarantined_bytes``
  and ``vllm:stallguard_quarantine_overdue`` (gauges) - the blocks of failed requests
  held until NIXL reports their transfers over, per prefill engine id, and how many of
  those holds are past the ``Quarantined`` deadline (docs/vllm.md).
"""

from __future__ import annotations

from collections import Counter as _Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

__all__ = [
    "FORCED_FAILURES",
    "QUARANTINED_BLOCKS",
    "QUARANTINED_BYTES",
    "QUARANTINE_OVERDUE",
    "STALLS_REPORTED",
    "StallguardNixlPromMetrics",
    "StallguardNixlStats",
    "stats_with_counts",
]

#: Counter name (``_total`` is appended by prometheus_client).
FORCED_FAILURES = "vllm:stallguard_forced_failures"
#: Counter name (``_total`` is appended by prometheus_client).
STALLS_REPORTED = "vllm:stallguard_stalls_reported"
#: Gauge names: quarantined blocks and bytes, and overdue holds, per peer.
QUARANTINED_BLOCKS = "vllm:stallguard_quarantined_blocks"
QUARANTINED_BYTES = "vllm:stallguard_quarantined_bytes"
QUARANTINE_OVERDUE = "vllm:stallguard_quarantine_overdue"
_KEYS = {"forced": "stallguard_forced", "reported": "stallguard_reported"}
#: data key: a list of quarantine snapshots (each ``[[peer, holds, blocks, bytes,
#: overdue], ...]``), the last one current
_QUARANTINE = "stallguard_quarantine"


class StallguardNixlStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus two lists of phase names (one entry per expiry)."""

    def reset(self) -> None:
        super().reset()
        self.data["stallguard_forced"] = []
        self.data["stallguard_reported"] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in _KEYS.values():  # data built by vLLM's worker stats lacks them
            self.data.setdefault(key, [])

    def is_empty(self) -> bool:
        return (
            super().is_empty()
            and not any(self.data.get(k) for k in _KEYS.values())
            and not self.data.get(_QUARANTINE)
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(super().reduce())
        out["stallguard forced failures"] = len(self.data.get("stallguard_forced", ()))
        out["stallguard stalls reported"] = len(self.data.get("stallguard_reported", ()))
        snapshots = self.data.get(_QUARANTINE) or ()
        if snapshots:
            out["stallguard quarantined blocks"] = sum(int(r[2]) for r in snapshots[-1])
        return out


def stats_with_counts(
    stats: KVConnectorStats | None,
    counts: _Counter[tuple[str, str]] | None,
    quarantine: list[list[Any]] | None = None,
) -> KVConnectorStats | None:
    """*stats* (vLLM's, possibly None) as :class:`StallguardNixlStats`, with *counts*
    (``(kind, phase) -> n``; kinds other than forced/reported are not exported as
    counters) appended and the *quarantine* snapshot (see
    :meth:`PhaseTracker.take_quarantine`); None when there is nothing to report."""
    exported = {k: n for k, n in (counts or {}).items() if k[0] in _KEYS}
    if (
        not exported
        and quarantine is None
        and (stats is None or isinstance(stats, StallguardNixlStats))
    ):
        return stats
    out = StallguardNixlStats(data=dict(stats.data)) if stats is not None else StallguardNixlStats()
    for (kind, phase), n in exported.items():
        out.data[_KEYS[kind]].extend([phase] * n)
    if quarantine is not None:
        out.data.setdefault(_QUARANTINE, []).append(quarantine)
    return out


class StallguardNixlPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus stallguard's two counters."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "phase"]
        self._sg_counters = {
            "stallguard_forced": self._counter_cls(
                name=FORCED_FAILURES,
                documentation="Disaggregated requests stallguard failed for overstaying "
                "a per-phase deadline (through vLLM's failed-receive path).",
                labelnames=names,
            ),
            "stallguard_reported": self._counter_cls(
                name=STALLS_REPORTED,
                documentation="Disaggregated requests stallguard found overdue and only "
                "reported (report mode, or the Queued phase).",
                labelnames=names,
            ),
        }

        peer_names = [*labelnames, "peer"]
        self._sg_gauges = [
            self._gauge_cls(
                name=name,
                documentation=doc,
                labelnames=peer_names,
                multiprocess_mode="mostrecent",
            )
            for name, doc in (
                (
                    QUARANTINED_BLOCKS,
                    "KV blocks of failed requests stallguard holds until NIXL reports "
                    "every transfer into them over, by prefill engine id.",
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
        self._sg_peers: dict[int, set[str]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, counter in self._sg_counters.items():
            for phase in transfer_stats_data.get(key, ()):
                counter.labels(*labels, str(phase)).inc()
        snapshots = transfer_stats_data.get(_QUARANTINE)
        if snapshots:
            now: dict[str, tuple[int, int, int]] = {
                str(r[0]): (int(r[2]), int(r[3]), int(r[4])) for r in snapshots[-1]
            }
            before = self._sg_peers.get(engine_idx, set())
            for peer in before - set(now):
                now[peer] = (0, 0, 0)
            for peer, values in now.items():
                for gauge, value in zip(self._sg_gauges, values, strict=True):
                    gauge.labels(*labels, peer).set(value)
            self._sg_peers[engine_idx] = {p for p, v in now.items() if any(v)}
