"""Read-only views of a watchdog: :meth:`Watchdog.snapshot`, :meth:`Watchdog.statistics`
and :meth:`Watchdog.advice` (the class binds these functions as its methods), and the
internal consistency views its tests use. Each takes the watchdog's lock for a consistent view."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from ._details import Snapshot, StateSummary, TrackedRequest
from ._errors import StallguardError
from ._fifo import Slot
from ._validate import check_time

if TYPE_CHECKING:
    from ._advice import Advice
    from ._stats import Statistics
    from ._watchdog import Watchdog

__all__ = [
    "advice",
    "footprint",
    "in_time_order",
    "overdue",
    "remembered",
    "snapshot",
    "statistics",
]

K = TypeVar("K", bound=Hashable)

_INF = float("inf")


def _summaries(wd: Watchdog[Any], now: float) -> dict[str, StateSummary]:
    """Per live state: its count and the age of its oldest request (lock held)."""
    counts: dict[Slot, int] = dict.fromkeys(wd._live, 0)
    first: dict[Slot, float] = dict.fromkeys(wd._live, _INF)
    # from the records (young ones have no FIFO entry; a reported one is parked)
    for rec in wd._where.values():
        slot = rec.slot
        counts[slot] += 1
        if rec.since < first[slot]:
            first[slot] = rec.since
    states: dict[str, StateSummary] = {}
    for slot in wd._live:
        oldest = None if first[slot] == _INF else first[slot]
        states[slot.label] = StateSummary(
            state=slot.state,
            deadline=slot.deadline,
            count=counts[slot],
            oldest_age=None if oldest is None else now - oldest,
        )
    return states


def _requests(wd: Watchdog[Any], now: float) -> tuple[TrackedRequest[Any], ...]:
    """Every tracked request, oldest state entry first (lock held)."""
    tracked: list[TrackedRequest[Any]] = []
    for key, rec in wd._where.items():
        seconds = rec.slot.seconds
        tracked.append(
            TrackedRequest(
                key=key,
                state=rec.slot.state,
                entered_at=rec.since,
                age=now - rec.since,
                remaining=None if seconds is None else rec.since + seconds - now,
            )
        )
    tracked.sort(key=lambda r: r.entered_at)
    return tuple(tracked)


def snapshot(self: Watchdog[K], *, requests: bool = True, now: float | None = None) -> Snapshot[K]:
    """A consistent view: per-state counts and oldest age, and (with *requests*)
    every tracked request with its state and time in state. O(tracked).

    Raises:
        ClockError: if *now* is None and the clock returns something that is not a
            finite time.
    """
    if now is not None:
        now = check_time("now", now)
    with self._lock:
        if now is None:
            now = self._read(self._clock())
        return Snapshot(
            spec=self._spec.name,
            mode=self._mode,
            at=now,
            states=_summaries(self, now),
            requests=_requests(self, now) if requests else (),
            tracked=len(self._where),
            expired=self._expired,
            hook_errors=self._hook_errors,
            late_events=self._late,
            runner_errors=self._runner_errors,
            withdrawn=self._withdrawn,
        )


def statistics(self: Watchdog[Any]) -> Statistics:
    """A frozen, consistent copy of the time-in-state statistics: per state, the
    seconds spent there by every request that left it (however short its stay), and
    the requests its deadline fired (or, in report mode, would have fired) on. See
    docs/advice.md.

    Raises:
        StallguardError: if the watchdog was made with ``statistics=False``.
    """
    with self._lock:
        if self._stats is None:
            raise StallguardError(
                f"watchdog {self._spec.name!r} records no statistics (statistics=False)"
            )
        return self._stats.freeze(self._mode)


def advice(self: Watchdog[Any], **kwargs: Any) -> Advice:
    """Suggested deadlines from :meth:`statistics`, flagging tracked requests older
    than a suggestion: :func:`stallguard.advise` with this watchdog's snapshot;
    *kwargs* are :func:`~stallguard.advise`'s."""
    from ._advice import advise  # the advice rule is not needed to watch requests

    return advise(self.statistics(), snapshot=self.snapshot(requests=True), **kwargs)


def remembered(wd: Watchdog[Any]) -> int:
    """How many concluded keys are remembered (tests of the memory bound)."""
    return len(wd._gone)


def footprint(wd: Watchdog[Any]) -> dict[str, int]:
    """Sizes of every internal structure (tests: nothing is left behind)."""
    with wd._lock:
        sizes = {"tracked": len(wd._where), "remembered": len(wd._gone)}
        # a young record (no entry yet) counts where its entries will be
        young = [rec for rec in wd._where.values() if rec.young]
        for slot in wd._live:
            for clock in (slot.timer, slot.stalls):
                if clock is not None:
                    waiting = sum(1 for rec in young if rec.slot is slot)
                    sizes[f"{slot.label}.{clock.reason}"] = len(clock.live()) + waiting
            sizes[f"{slot.label}.parked"] = len(slot.parked)
        life = wd._young.life
        if life is not None:
            sizes["lifetime"] = len(life.live()) + len(young)
        sizes["carried"] = len(wd._carry)
        #: every entry (FIFOs, heaps, young queue), stale ones included
        sizes["entries"] = sum(len(c.q) + len(c.heap) for c in wd._clocks) + len(wd._young.q)
        return sizes


def in_time_order(wd: Watchdog[Any]) -> bool:
    """Whether every FIFO is in time order, stale entries included (tests: "only the
    head can be due" rests on it)."""
    with wd._lock:
        for clock in wd._clocks:
            starts = (entry[0] for entry in clock.q)
            if any(a > b for a, b in itertools.pairwise(starts)):
                return False
        return True


def overdue(wd: Watchdog[Any], now: float) -> list[tuple[Any, str]]:
    """Every (key, reason) with a live FIFO entry due at *now*, wherever it is in its
    FIFO (tests: after a check at *now*, there is none)."""
    with wd._lock:
        out = [
            (rec.key, clock.reason)
            for clock in wd._clocks
            for entry, rec in clock.live()
            if entry[0] + clock.seconds <= now
        ]
        life = wd._young.life
        for rec in wd._where.values():  # young ones: from their attributes
            if rec.young:
                slot = rec.slot
                if slot.seconds is not None and rec.since + slot.seconds <= now:
                    out.append((rec.key, "state"))
                if slot.stall is not None and rec.beat + slot.stall <= now:
                    out.append((rec.key, "stall"))
                if life is not None and rec.lifestart + life.seconds <= now:
                    out.append((rec.key, "lifetime"))
        return out
