"""Time in state per backend and state, on SGLang's own ``/metrics`` (docs/advice.md).

Each lane (one backend's watchdog in one queue guard) observes every state change of
every request with the core watchdog, which records every stay in a state, however short
(``Watchdog.statistics()``). About once a second, from the scheduler's queue loop, the
lane adds what was recorded since the last export to three Prometheus metrics, created
lazily in the scheduler process exactly like the adapter's counters (see ``_metrics.py``
for why):

* ``sglang:stallguard_state_seconds`` (histogram; labels ``queue``, ``backend``,
  ``state``, ``tp_rank``): seconds a request stayed in a state of the queue. Buckets:
  :data:`stallguard.adapters.LADDER` (1 ms to one week; 1, 2, 5 x 10^k below 10 s, then
  15 s, 20 s, 30 s, 45 s, 1 min... the values deadlines are suggested in). Every ladder
  value is a bound of the in-process histogram, so the export is exact at its bounds;
  a quantile read from a scrape has the ladder's resolution (up to 2.5x below 10 s,
  1.5x from 10 s to one hour), estimated from above.
* ``sglang:stallguard_deadline_seconds`` (gauge, ``max`` across processes; labels
  ``queue``, ``backend``, ``state``): the state deadline in force (0: none).
* ``sglang:stallguard_reported_completed_total`` (counter; the histogram's labels):
  report mode, requests reported overdue that then completed (``Success``): the would-be
  false positives.

The requests the deadline fired on are the adapter's existing counters
(``sglang:stallguard_forced_failures_total``, ``..._stalls_reported_total``).

Cost: the recording is the core's (a bucket lookup per state change); the export runs
once a second per lane (a copy and a diff of ~760 counts per state) and costs nothing in
between but a comparison.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from stallguard import Watchdog
from stallguard.adapters import StatisticsExporter, histogram_buckets

__all__ = [
    "DEADLINE",
    "EXPORT_PERIOD",
    "LABELS",
    "REPORTED_COMPLETED",
    "STATE_SECONDS",
    "LaneStats",
]

log = logging.getLogger("stallguard.sglang")

#: Histogram of seconds in a state.
STATE_SECONDS = "sglang:stallguard_state_seconds"
#: Gauge of the state deadline in force, seconds (0: none).
DEADLINE = "sglang:stallguard_deadline_seconds"
#: Counter of reported-then-completed requests (report mode). Exposed as ``..._total``.
REPORTED_COMPLETED = "sglang:stallguard_reported_completed"
#: Label names of the histogram and the counter (the gauge has no ``tp_rank``).
LABELS = ("queue", "backend", "state", "tp_rank")
#: Seconds between two exports of a lane.
EXPORT_PERIOD = 1.0


_lock = threading.Lock()
_metrics: dict[str, Any] | None = None
_failed = False


def _create() -> dict[str, Any] | None:
    global _metrics, _failed
    with _lock:
        if _metrics is not None or _failed:
            return _metrics
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            _failed = True
            return None
        try:
            _metrics = {
                "seconds": Histogram(
                    STATE_SECONDS,
                    "Seconds a prefill KV-sender request stayed in a KVPoll state of a "
                    "stallguard-guarded queue (recorded when it left the state).",
                    labelnames=LABELS,
                    buckets=histogram_buckets(),
                ),
                "deadline": Gauge(
                    DEADLINE,
                    "The stallguard state deadline in force, seconds (0: none).",
                    labelnames=LABELS[:3],
                    multiprocess_mode="max",
                ),
                "completed": Counter(
                    REPORTED_COMPLETED,
                    "Requests stallguard reported overdue (report mode) that then "
                    "completed: what enforcing would have failed needlessly.",
                    labelnames=LABELS,
                ),
            }
        except ValueError:
            log.exception("stallguard-sglang: could not create its time-in-state metrics")
            _failed = True
        return _metrics


class LaneStats:
    """Time-in-state recording and export for one lane (see the module docstring).

    Args:
        wd: the lane's watchdog (its spec, mode and would-be false positives).
        queue, backend, tp_rank: the metric labels.
        clock: the lane's clock.
    """

    __slots__ = ("_due", "_exporter", "backend", "clock", "queue", "rank", "wd")

    def __init__(
        self, wd: Watchdog[Any], queue: str, backend: str, tp_rank: object, clock: Any
    ) -> None:
        self.wd = wd
        self.queue = queue
        self.backend = backend
        self.rank = str(tp_rank)
        self.clock = clock
        self._due = -math.inf
        self._exporter: StatisticsExporter | None = None

    def tick(self, now: float) -> None:
        """Export if :data:`EXPORT_PERIOD` passed since the last export (queue loop)."""
        if now >= self._due:
            self._due = now + EXPORT_PERIOD
            self.export()

    def export(self) -> None:
        """Add what was recorded since the last export to the Prometheus metrics."""
        metrics = _metrics if _metrics is not None else _create()
        if metrics is None:
            return
        try:
            if self._exporter is None:
                self._exporter = StatisticsExporter(
                    metrics["seconds"],
                    labels={"queue": self.queue, "backend": self.backend, "tp_rank": self.rank},
                    deadline=metrics["deadline"],
                    deadline_labels={"queue": self.queue, "backend": self.backend},
                    completed=metrics["completed"],
                )
            self._exporter.export(self.wd.statistics())
        except Exception:  # a metrics problem must never break the scheduler loop
            log.exception("stallguard-sglang: could not export time-in-state metrics")
