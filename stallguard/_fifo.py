"""The watchdog's records and deadline clocks (lazy FIFOs); see :mod:`stallguard._watchdog`.

A tracked request is one :class:`Rec`. Each deadline clock is a :class:`Clock`: a
``deque`` of ``(start, record, generation)`` in time order, where only the head can be
due; :meth:`Clock.push` is the one way an entry is added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from ._spec import State, state_label

__all__ = ["DEAD", "NEW", "Clock", "Note", "Rec", "Slot"]

_INF = float("inf")
#: a record's generation once it is untracked: every FIFO entry for it is stale
DEAD = -1
#: stale FIFO entries tolerated beyond twice the live ones
_SLACK = 1024
#: tombstone values of ``Watchdog._gone``: the key was force-failed (enforce mode) ...
EXPIRED = True
#: ... or it concluded (terminal state, forget(), or reported-then-ended)
CONCLUDED = False


class Note:
    """Telemetry attached with annotate()."""

    __slots__ = ("attributes", "links", "parent")

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self.parent: Any = None
        self.links: tuple[Any, ...] = ()


class Rec:
    """One tracked request. ``gen`` counts its state entries (:data:`DEAD` once
    untracked): a FIFO entry made in another generation is stale."""

    __slots__ = ("beat", "gen", "key", "note", "since", "slot")

    def __init__(self, key: Any, slot: Slot, since: float) -> None:
        self.key = key
        self.slot = slot
        self.since = since
        self.gen = 0
        self.beat = since
        self.note: Note | None = None


Entry = tuple[float, Rec, int]


def state_entry(entry: Entry) -> bool:
    """A state clock's entry holds while its request is in the state it was made for."""
    return entry[1].gen == entry[2]


def stall_entry(entry: Entry) -> bool:
    """A progress window's entry holds until the state ends or a renewal replaces it."""
    rec = entry[1]
    return rec.gen == entry[2] and rec.beat == entry[0]


def life_entry(entry: Entry) -> bool:
    """A lifetime entry holds while the request is tracked."""
    return entry[1].gen != DEAD


class Clock:
    """A lazy FIFO of ``(start, record, generation)``: one deadline clock."""

    __slots__ = ("limit", "q", "reason", "seconds", "valid")

    def __init__(self, seconds: float, reason: str, valid: Callable[[Entry], bool]) -> None:
        self.q: deque[Entry] = deque()
        self.seconds = seconds
        self.reason = reason
        #: whether an entry still holds (else it is stale)
        self.valid = valid
        #: compact when the FIFO grows past this (amortised O(1) per append)
        self.limit = _SLACK

    def push(self, start: float, rec: Rec, gen: int, ordered: bool) -> float:
        """Append *rec*'s entry starting at *start*, raised to the latest start on this
        clock if earlier (the FIFO stays in time order: only its head can be due; the
        caller says with *ordered* that *start* is the watchdog's latest reading, which
        no start on the clock exceeds); returns the start it got. Compacts when stale
        entries pile up."""
        q = self.q
        if not ordered and q and q[-1][0] > start:
            start = q[-1][0]
        q.append((start, rec, gen))
        if len(q) > self.limit:
            self.compact()
        return start

    def head(self) -> Entry | None:
        """The first live entry, dropping stale ones on the way."""
        q = self.q
        valid = self.valid
        while q:
            entry = q[0]
            if valid(entry):
                return entry
            q.popleft()
        return None

    def compact(self) -> None:
        self.q = deque(filter(self.valid, self.q))
        self.limit = 2 * len(self.q) + _SLACK

    def tail(self) -> float:
        q = self.q
        return q[-1][0] if q else -_INF


class Slot:
    """Per-state bookkeeping."""

    __slots__ = (
        "deadline",
        "hist",
        "label",
        "parked",
        "seconds",
        "stall",
        "stalls",
        "state",
        "terminal",
        "timer",
    )

    def __init__(self, state: State, deadline: Any) -> None:
        self.state = state
        self.label = state_label(state)
        self.terminal = deadline is None
        self.deadline = deadline
        self.seconds: float | None = None if deadline is None else deadline.seconds
        self.stall: float | None = None if deadline is None else deadline.stall
        #: the state deadline's FIFO (None: terminal, or no state deadline)
        self.timer: Clock | None = (
            None if self.seconds is None else Clock(self.seconds, "state", state_entry)
        )
        self.stalls: Clock | None = (
            None if self.stall is None else Clock(self.stall, "stall", stall_entry)
        )
        #: report mode: records whose state deadline was reported -> state start
        self.parked: dict[Rec, float] = {}
        #: the state's time-in-state histogram (None: statistics off, or terminal)
        self.hist: Any = None

    def oldest(self) -> float | None:
        """The earliest entry into this state of a request still in it (state FIFO's
        live head, or a parked record)."""
        head = None if self.timer is None else self.timer.head()
        oldest = None if head is None else head[0]
        if self.parked:
            parked = min(self.parked.values())
            oldest = parked if oldest is None else min(oldest, parked)
        return oldest


def build(spec: Any) -> tuple[dict[State, Slot], tuple[Slot, ...], Clock | None, tuple[Clock, ...]]:
    """A spec's slots (by state), its live slots, its lifetime clock (or None), and
    every clock that can fire, in tie-break order: state deadlines, progress windows,
    lifetime (the most specific reason first)."""
    slots = {state: Slot(state, deadline) for state, deadline in spec.deadlines.items()}
    slots.update((state, Slot(state, None)) for state in spec.terminal)
    live = tuple(s for s in slots.values() if not s.terminal)
    life = None if spec.lifetime is None else Clock(spec.lifetime, "lifetime", life_entry)
    clocks = [s.timer for s in live if s.timer is not None]
    clocks += [s.stalls for s in live if s.stalls is not None]
    if life is not None:
        clocks.append(life)
    return slots, live, life, tuple(c for c in clocks if c is not None)


def exact_due(clocks: tuple[Clock, ...]) -> float:
    """The earliest due time of any live FIFO head (stale heads are dropped)."""
    due = _INF
    for clock in clocks:
        head = clock.head()
        if head is not None:
            at = head[0] + clock.seconds
            if at < due:
                due = at
    return due


def pop_due(
    clocks: tuple[Clock, ...], now: float, found: list[tuple[float, Rec, Clock, float]]
) -> float:
    """Pop every live entry due at *now* off *clocks* into *found* as ``(due, record,
    clock, start)``, dropping stale ones on the way; returns a lower bound on the next
    due time. Each FIFO stops at its first live entry that is not due (a request
    expired later in the same check may make it stale: then the bound is early, never
    late, which is all ``check()`` needs)."""
    add = found.append
    next_due = _INF
    for clock in clocks:
        q = clock.q
        seconds = clock.seconds
        valid = clock.valid
        state_clock = valid is state_entry  # the common case, tested inline
        while q:
            entry = q[0]
            start, rec, mark = entry
            if (rec.gen != mark) if state_clock else not valid(entry):
                q.popleft()  # stale: the request left this state or window
                continue
            due = start + seconds
            if due > now:
                if due < next_due:
                    next_due = due
                break
            q.popleft()
            add((due, rec, clock, start))
    return next_due


#: the slot of a record that is being created: it leaves no state (no time in state, no
#: leave notification) when it enters its first one
NEW = Slot("(new)", None)
