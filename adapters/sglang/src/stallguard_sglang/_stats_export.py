"""Time in state per backend and state, on SGLang's own ``/metrics`` (docs/advice.md).

Each lane (one backend's watchdog in one queue guard) observes every state change of
every request with the core watchdog, which records every stay in a state, however short
(``Watchdog.statistics()``). About once a second, from the scheduler's queue loop, the
lane adds what was recorded since the last export to three Prometheus metrics, created
lazily in the scheduler process exactly like the adapter's counters (see ``_metrics.py``
for why):

* ``sglang:stallguard_state_seconds`` (histogram; labels ``queue``, ``backend``,
  ``state``, then SGLang's scheduler labels exactly as on the adapter's counters:
  ``model_name``, ``engine_type``, ``tp_rank``, ... see ``_metrics.py``): seconds a request
  stayed in a state of the queue. Buckets: :data:`stallguard.adapters.LADDER` (1 ms to one
  week; 1, 2, 5 x 10^k below 10 s, then 15 s, 20 s, 30 s, 45 s, 1 min... the values
  deadlines are suggested in). Every ladder value is a bound of the in-process histogram,
  so the export is exact at its bounds; a quantile read from a scrape has the ladder's
  resolution (up to 2.5x below 10 s, 1.5x from 10 s to one hour), estimated from above.
* ``sglang:stallguard_deadline_seconds`` (gauge, ``max`` across processes; the
  histogram's labels): the state deadline in force. A state without a deadline has **no**
  series (absent, not 0), so ``deadline - quantile`` is absent for it too.
* ``sglang:stallguard_oldest_age_seconds`` (gauge, ``livemax`` across processes; the
  histogram's labels): the age of the oldest request in the state now (0: none), read
  at each export from ``Watchdog.snapshot(requests=False)`` (O(tracked requests), once
  a second). Rising towards the deadline is the early warning before a failure.
* ``sglang:stallguard_reported_completed_total`` (counter; the histogram's labels):
  report mode, requests reported overdue that then completed (``Success``): the would-be
  false positives.

The expiries are the adapter's counters (``sglang:stallguard_forced_failures_total``,
``..._stalls_reported_total``, named in ``_metrics.py``), added by the same exporter from
the core's counts (``StateStatistics.forced`` / ``.reported``, by state and reason): at
the export period, and at once after a check that expired something
(:meth:`LaneStats.tick`).

Cost: the recording is the core's (a bucket lookup per state change); the export
(``stallguard.adapters.StatisticsExporter``) runs once a second per lane (a copy and a
diff of ~760 counts per state) and costs nothing in between but a comparison.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from stallguard import Watchdog
from stallguard.adapters import StatisticsExporter, histogram_buckets

from . import _metrics

__all__ = [
    "DEADLINE",
    "EXPORT_PERIOD",
    "LABELS",
    "OLDEST_AGE",
    "REPORTED_COMPLETED",
    "STATE_SECONDS",
    "LaneStats",
]

log = logging.getLogger("stallguard.sglang")

#: Histogram of seconds in a state.
STATE_SECONDS = "sglang:stallguard_state_seconds"
#: Gauge of the state deadline in force, seconds (absent: none).
DEADLINE = "sglang:stallguard_deadline_seconds"
#: Gauge of the age of the oldest request in a state now, seconds.
OLDEST_AGE = "sglang:stallguard_oldest_age_seconds"
#: Counter of reported-then-completed requests (report mode). Exposed as ``..._total``.
REPORTED_COMPLETED = "sglang:stallguard_reported_completed"
#: The adapter's own label names of the three metrics; SGLang's scheduler labels follow
#: (those of the adapter's counters, ``_metrics.prepare``; ``tp_rank`` when none are known).
LABELS = ("queue", "backend", "state")
#: Seconds between two exports of a lane.
EXPORT_PERIOD = 1.0


_lock = threading.Lock()
_created: dict[str, Any] | None = None
_failed = False
#: the SGLang label names after LABELS, fixed at creation
_extra: tuple[str, ...] = ()


def label_names() -> tuple[str, ...]:
    """The SGLang label names the metrics carry after :data:`LABELS` (those of the
    adapter's counters, fixed for the process at its first ``_metrics.prepare``; else
    ``("tp_rank",)``)."""
    return _metrics.sglang_label_names() or ("tp_rank",)


def _create() -> dict[str, Any] | None:
    global _created, _failed, _extra
    _metrics.prepare({})  # fixes SGLang's label names for the process, once (if not yet)
    with _lock:
        if _created is not None or _failed:
            return _created
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            _failed = True
            return None
        extra = label_names()
        names = LABELS + extra
        try:
            _created = {
                "seconds": Histogram(
                    STATE_SECONDS,
                    "Seconds a prefill KV-sender request stayed in a KVPoll state of a "
                    "stallguard-guarded queue (recorded when it left the state).",
                    labelnames=names,
                    buckets=histogram_buckets(),
                ),
                "deadline": Gauge(
                    DEADLINE,
                    "The stallguard state deadline in force, seconds (no series: the "
                    "state has no deadline).",
                    labelnames=names,
                    multiprocess_mode="max",
                ),
                "oldest": Gauge(
                    OLDEST_AGE,
                    "Age of the oldest request in a stallguard-guarded state now, seconds "
                    "(0: none in it).",
                    labelnames=names,
                    multiprocess_mode="livemax",
                ),
                "completed": Counter(
                    REPORTED_COMPLETED,
                    "Requests stallguard reported overdue (report mode) that then "
                    "completed: what enforcing would have failed needlessly.",
                    labelnames=names,
                ),
            }
        except ValueError:
            log.exception("stallguard-sglang: could not create its time-in-state metrics")
            _failed = True
        else:
            _extra = extra
        return _created


class LaneStats:
    """Time-in-state export for one lane (see the module docstring): the metrics are
    the adapter's (names, help, labels, multiprocess modes); what is exported, and when
    a state's series first appear, is :class:`stallguard.adapters.StatisticsExporter`'s,
    reading the lane watchdog's own record (``Watchdog.statistics()``, one record per
    stay, and ``Watchdog.snapshot(requests=False)`` for the oldest ages).

    Args:
        wd: the lane's watchdog (its spec, mode and would-be false positives).
        queue, backend: the metric labels.
        sglang_labels: SGLang's scheduler labels of the process (``model_name``,
            ``tp_rank``, ...), as the adapter's counters carry them.
        tp_rank: the ``tp_rank`` label when *sglang_labels* has none.
        clock: the lane's clock.
    """

    __slots__ = ("_exporter", "backend", "clock", "due", "labels", "queue", "wd")

    def __init__(
        self,
        wd: Watchdog[Any],
        queue: str,
        backend: str,
        tp_rank: object,
        clock: Any,
        sglang_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.wd = wd
        self.queue = queue
        self.backend = backend
        self.clock = clock
        known = dict(sglang_labels or {})
        known.setdefault("tp_rank", "" if tp_rank is None else str(tp_rank))
        #: every label after ``state``, by name (read when the metrics exist)
        self.labels = known
        #: when the next export is due (the queue guard skips the call before it)
        self.due = -math.inf
        self._exporter: StatisticsExporter | None = None

    def tick(self, now: float, expired: object = ()) -> None:
        """Export if :data:`EXPORT_PERIOD` passed since the last export, or at once
        after a check that *expired* something (its result), so that the counters of
        expiries are current after every check (queue loop)."""
        if expired or now >= self.due:
            self.due = now + EXPORT_PERIOD
            self.export()

    def export(self) -> None:
        """Add what was recorded since the last export to the Prometheus metrics."""
        exporter = self._exporter
        if exporter is None:
            exporter = self._exporter = self._create_exporter()
            if exporter is None:
                return
        wd = self.wd
        try:
            exporter.export(wd.statistics(), wd.snapshot(requests=False))
        except Exception:  # a metrics problem must never break the scheduler loop
            log.exception("stallguard-sglang: could not export time-in-state metrics")

    def _create_exporter(self) -> StatisticsExporter | None:
        metrics = _created if _created is not None else _create()
        counters = _metrics.failure_counters() or {}
        if metrics is None:
            return None
        return StatisticsExporter(
            metrics["seconds"],
            labels=self._labels(_extra),
            deadline=metrics["deadline"],
            completed=metrics["completed"],
            oldest=metrics["oldest"],
            forced=counters.get("forced"),
            reported=counters.get("reported"),
            failure_labels=self._labels(_metrics.sglang_label_names()),
        )

    def _labels(self, sglang_names: tuple[str, ...]) -> dict[str, str]:
        """The lane's labels, ``queue`` and ``backend``, then the SGLang labels
        *sglang_names* (those a metric was created with)."""
        labels = {"queue": self.queue, "backend": self.backend}
        labels.update((name, str(self.labels.get(name, ""))) for name in sglang_names)
        return labels
