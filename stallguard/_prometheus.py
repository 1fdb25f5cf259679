"""Statistics -> Prometheus: a watchdog's time in state added to prometheus_client
metrics, incrementally (part of :mod:`stallguard.adapters`).

The in-process histogram has a fine, fixed layout (:data:`BOUNDS`, ~760 buckets); a
Prometheus histogram gets the coarse :data:`LADDER` (the values deadlines are written
in). Every ladder value is one of the fine bounds, so the export is exact at its
bounds. prometheus_client is imported by the caller (it creates the metrics), never
here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._stats import BOUNDS, LADDER, StateStatistics, Statistics

if TYPE_CHECKING:
    from ._details import Snapshot

__all__ = ["StatisticsExporter", "expiries_since", "histogram_buckets"]

#: an expiry count's key: ``(kind, state label, reason)``, kind ``"forced"`` or
#: ``"reported"``
ExpiryKey = tuple[str, str, str]

# ladder bucket j (values in (LADDER[j-1], LADDER[j]], the last one +Inf) = the fine
# buckets BOUNDS[start:end] (exact: every ladder value is one of BOUNDS)
_ENDS = (*(BOUNDS.index(v) + 1 for v in LADDER), len(BOUNDS))
_SLICES: tuple[tuple[int, int], ...] = tuple(zip((0, *_ENDS[:-1]), _ENDS, strict=True))


def histogram_buckets() -> tuple[float, ...]:
    """The ``buckets=`` of a Prometheus histogram that :class:`StatisticsExporter`
    feeds: :data:`LADDER` and ``+Inf``."""
    return (*LADDER, math.inf)


class StatisticsExporter:
    """Adds what a watchdog recorded since the last call to Prometheus metrics.

    Args:
        histogram: a prometheus_client ``Histogram`` with ``buckets=histogram_buckets()``
            whose label names are those of *labels* and *state_label*.
        labels: the label values of this watchdog's series, besides the state.
        deadline: optional ``Gauge`` of the state deadline in force, set once per state
            when the state first has statistics; a state without a deadline gets **no**
            series (absent, not 0, so ``deadline - quantile`` is absent for it too).
        deadline_labels: its label values besides the state (default: *labels*).
        completed: optional ``Counter`` of requests reported overdue (report mode) that
            then completed (``StateStatistics.fired_completed``), labelled as the
            histogram.
        oldest: optional ``Gauge`` of the age of the oldest request in each state now
            (0: none in it), labelled as the histogram, set from the *snapshot* given
            to :meth:`export` (``Watchdog.snapshot(requests=False)``).
        forced: optional ``Counter`` of the expiries enforced (enforce mode), by state
            and reason (``StateStatistics.forced``): each expiry once, less those an
            enforcement hook withdrew. Labelled as *failure_labels*, the state and
            *reason_label*.
        reported: optional ``Counter`` of the expiries reported (report mode), by
            state and reason (``StateStatistics.reported``), labelled as *forced*.
        failure_labels: the label values of *forced* and *reported* besides the state
            and the reason (default: *labels*).
        state_label: the name of the state label.
        reason_label: the name of the reason label of *forced* and *reported*.

    prometheus_client has no public bulk add to a histogram: :meth:`export` adds to the
    child's per-bucket values (``_buckets``, ``_sum``: the same ``inc`` its
    ``observe()`` calls, in its multiprocess files too); a client without them gets one
    ``observe()`` per stay at its bucket's upper bound (bucket counts exact, sum not).
    Not thread-safe: call it from one thread (the engine's loop).
    """

    __slots__ = (
        "_completed",
        "_failures",
        "_sent",
        "completed",
        "deadline",
        "deadline_labels",
        "failure_labels",
        "forced",
        "histogram",
        "labels",
        "oldest",
        "reason_label",
        "reported",
        "state_label",
    )

    def __init__(
        self,
        histogram: Any,
        *,
        labels: Mapping[str, str],
        deadline: Any = None,
        deadline_labels: Mapping[str, str] | None = None,
        completed: Any = None,
        oldest: Any = None,
        forced: Any = None,
        reported: Any = None,
        failure_labels: Mapping[str, str] | None = None,
        state_label: str = "state",
        reason_label: str = "reason",
    ) -> None:
        self.histogram = histogram
        self.labels = dict(labels)
        self.deadline = deadline
        self.deadline_labels = dict(labels if deadline_labels is None else deadline_labels)
        self.completed = completed
        self.oldest = oldest
        self.forced = forced
        self.reported = reported
        self.failure_labels = dict(labels if failure_labels is None else failure_labels)
        self.state_label = state_label
        self.reason_label = reason_label
        # (kind, state, reason) -> expiries already exported
        self._failures: dict[ExpiryKey, int] = {}
        # per state: ladder-bucket counts and sum already exported
        self._sent: dict[str, tuple[list[int], float]] = {}
        self._completed: dict[str, int] = {}

    def export(self, statistics: Statistics, snapshot: Snapshot[Any] | None = None) -> None:
        """Add every state's stays recorded since the last call (and the new
        reported-then-completed requests, forced and reported expiries); with a
        *snapshot* and an *oldest* gauge, set each state's oldest age."""
        if self.oldest is not None and snapshot is not None:
            self._export_oldest(snapshot)
        if self.forced is not None or self.reported is not None:
            self._export_failures(statistics)
        for label, s in statistics.states.items():
            self._export_state(label, s)
            if self.completed is not None:
                self._export_completed(label, s)

    def _export_oldest(self, snapshot: Snapshot[Any]) -> None:
        for label, summary in snapshot.states.items():
            labels = {**self.labels, self.state_label: label}
            self.oldest.labels(**labels).set(summary.oldest_age or 0.0)

    def _export_completed(self, label: str, s: StateStatistics) -> None:
        done = s.fired_completed
        before = self._completed.get(label, 0)
        if done > before:
            self.completed.labels(**self.labels, **{self.state_label: label}).inc(done - before)
            self._completed[label] = done

    def _export_failures(self, statistics: Statistics) -> None:
        """Add the expiries since the last call to the *forced* and *reported*
        counters."""
        for (kind, label, reason), n in expiries_since(statistics, self._failures).items():
            counter = self.forced if kind == "forced" else self.reported
            if counter is not None:
                labels = {self.state_label: label, self.reason_label: reason}
                counter.labels(**self.failure_labels, **labels).inc(n)

    def _export_state(self, label: str, s: StateStatistics) -> None:
        dist = s.distribution
        sent = self._sent.get(label)
        if sent is None:
            sent = self._first_export(label, s)
        elif sum(sent[0]) == dist.count:
            return  # nothing new in this state
        fine = dist.counts
        counts = ladder_counts(fine)
        child = self.histogram.labels(**self.labels, **{self.state_label: label})
        add_to_histogram(child, counts, dist.total - sent[1], sent[0])
        self._sent[label] = (counts, dist.total)

    def _first_export(self, label: str, s: StateStatistics) -> tuple[list[int], float]:
        """A state's first export: nothing sent yet; its deadline set on the gauge (only
        then, at the state's first export)."""
        sent = self._sent[label] = ([0] * (len(LADDER) + 1), 0.0)
        if self.deadline is not None and s.deadline is not None:
            labels = {**self.deadline_labels, self.state_label: label}
            self.deadline.labels(**labels).set(s.deadline)
        return sent


def expiries_since(statistics: Statistics, sent: dict[ExpiryKey, int]) -> dict[ExpiryKey, int]:
    """The expiries *statistics* counts beyond *sent*, as ``(kind, state label, reason)
    -> n`` (kind ``"forced"``: ``StateStatistics.forced``, ``"reported"``:
    ``.reported``), for an adapter that ships counts rather than feeding a
    prometheus_client counter. *sent* is updated in place: pass the same dict each time
    (empty at first) and each expiry is returned once. A count that fell below *sent*
    (an enforced expiry withdrawn after it was returned) yields nothing until it rises
    past it again: counters only rise."""
    new: dict[ExpiryKey, int] = {}
    for label, s in statistics.states.items():
        for kind, counts in (("forced", s.forced), ("reported", s.reported)):
            for reason, n in counts.items():
                key = (kind, label, reason)
                before = sent.get(key, 0)
                if n > before:
                    new[key] = n - before
                    sent[key] = n
    return new


def ladder_counts(fine: Sequence[int]) -> list[int]:
    """Fine-bucket counts (:data:`BOUNDS` then +Inf) summed into the coarse ladder buckets
    (:data:`LADDER` then +Inf) a Prometheus histogram of :func:`histogram_buckets` has."""
    return [sum(fine[a:b]) for a, b in _SLICES]


def add_to_histogram(
    child: Any, counts: list[int], total: float, sent: list[int] | None = None
) -> None:
    """Add ``counts - sent`` per bucket (ladder then +Inf; *sent* default none), and
    *total* to the sum, to a prometheus_client histogram child. prometheus_client has no
    public bulk add: this uses the child's per-bucket values (``_buckets``, ``_sum``: the
    same ``inc`` its ``observe()`` calls, in its multiprocess files too); without them it
    observes each value at its bucket's upper bound."""
    buckets = getattr(child, "_buckets", None)
    total_value = getattr(child, "_sum", None)
    exact = buckets is not None and total_value is not None and len(buckets) == len(counts)
    added = _added(counts, sent)
    if not exact:  # pragma: no cover - a prometheus_client without the internals
        _observe_at_bounds(child, added)
        return
    for i, delta in added:
        buckets[i].inc(delta)  # type: ignore[index]
    if total > 0:
        total_value.inc(total)  # type: ignore[union-attr]


def _added(counts: list[int], sent: list[int] | None) -> list[tuple[int, int]]:
    """``(bucket index, count - sent)`` for each bucket whose count grew."""
    before = sent if sent is not None else [0] * len(counts)
    deltas = enumerate(now - then for now, then in zip(counts, before, strict=True))
    return [(i, delta) for i, delta in deltas if delta > 0]


def _observe_at_bounds(child: Any, added: list[tuple[int, int]]) -> None:  # pragma: no cover
    """Add to a histogram child through ``observe()``: each value at its bucket's upper
    bound (a prometheus_client without the per-bucket internals)."""
    for i, delta in added:
        bound = LADDER[i] if i < len(LADDER) else LADDER[-1] * 2
        for _ in range(delta):
            child.observe(bound)
