"""The watchdog's records and deadline clocks (lazy FIFOs); see :mod:`stallguard._watchdog`.

A tracked request is one :class:`Rec`. Each deadline clock is a :class:`Clock`: a
``deque`` of ``(start, key, stamp)`` in time order, where only the head can be due;
:meth:`Clock.push` is the one way an entry is added.

An entry names its request by **key**, not by record, and its record by a **stamp**
(a record's generations are numbered from a base no other record of the process
shares: ``rec.gen`` for its state entries, ``rec.born`` for its lifetime entry). So an
entry holds a float, the key and an int: with the usual keys (ints, strings, tuples of
them) CPython's collector stops tracking such a tuple at its first young collection,
and a state change leaves nothing for the full collections to walk. (With records in
the entries, every state change left one tracked tuple alive until its FIFO dropped it,
and the full collections those survivors made due cost more than the rest of the state
change: docs/performance.md, issue 25.) An entry holds while the key's record is the one
its stamp names; a key forgotten and tracked again gets a new record and a new base, so
its old entries stay stale.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from ._spec import State, state_label

__all__ = ["DEAD", "LIFETIME", "NEW", "STALL", "STATE", "Clock", "Note", "Rec", "Slot"]

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


#: generation bases: record *i* of the process numbers its generations from i << 32
_BASES = itertools.count(1 << 32, 1 << 32)


class Rec:
    """One tracked request. ``gen`` stamps its state entries (:data:`DEAD` once
    untracked): a FIFO entry with another stamp is stale. ``born`` stamps its lifetime
    entry. Both are unique to the record in the process (see the module's docstring)."""

    __slots__ = ("beat", "born", "gen", "key", "note", "since", "slot")

    def __init__(self, key: Any, slot: Slot, since: float) -> None:
        self.key = key
        self.slot = slot
        self.since = since
        self.gen = self.born = next(_BASES)
        self.beat = since
        self.note: Note | None = None


#: ``(start, key, stamp)``
Entry = tuple[float, Any, int]

#: the kinds of clock, each with its rule for when an entry holds
STATE = "state"
STALL = "stall"
LIFETIME = "lifetime"


def holds(kind: str, where: dict[Any, Rec]) -> Callable[[Entry], Rec | None]:
    """The record an entry of a *kind* clock still holds for, or None if it is stale:
    a state clock's entry holds while its request is in the state it was made for; a
    progress window's until the state ends or a renewal replaces it; a lifetime
    entry while the request is tracked (by the same record)."""
    get = where.get

    if kind == STATE:

        def state(entry: Entry) -> Rec | None:
            rec = get(entry[1])
            return rec if rec is not None and rec.gen == entry[2] else None

        return state
    if kind == STALL:

        def stall(entry: Entry) -> Rec | None:
            rec = get(entry[1])
            if rec is not None and rec.gen == entry[2] and rec.beat == entry[0]:
                return rec
            return None

        return stall

    def lifetime(entry: Entry) -> Rec | None:
        rec = get(entry[1])
        return rec if rec is not None and rec.born == entry[2] else None

    return lifetime


class Clock:
    """A lazy FIFO of ``(start, key, stamp)``: one deadline clock."""

    __slots__ = ("limit", "q", "reason", "seconds", "valid")

    def __init__(self, seconds: float, reason: str, where: dict[Any, Rec]) -> None:
        self.q: deque[Entry] = deque()
        self.seconds = seconds
        self.reason = reason
        #: the record an entry still holds for (None: it is stale)
        self.valid = holds(reason, where)
        #: compact when the FIFO grows past this (amortised O(1) per append)
        self.limit = _SLACK

    def push(self, start: float, rec: Rec, gen: int, ordered: bool) -> float:
        """Append *rec*'s entry (stamp *gen*) starting at *start*, raised to the latest
        start on this clock if earlier (the FIFO stays in time order: only its head can
        be due; the caller says with *ordered* that *start* is the watchdog's latest
        reading, which no start on the clock exceeds); returns the start it got.
        Compacts when stale entries pile up."""
        q = self.q
        if not ordered and q and q[-1][0] > start:
            start = q[-1][0]
        q.append((start, rec.key, gen))
        if len(q) > self.limit:
            self.compact()
        return start

    def head(self) -> Entry | None:
        """The first live entry, dropping stale ones on the way."""
        q = self.q
        valid = self.valid
        while q:
            entry = q[0]
            if valid(entry) is not None:
                return entry
            q.popleft()
        return None

    def live(self) -> list[tuple[Entry, Rec]]:
        """Every live entry with its record, in FIFO order (the views)."""
        valid = self.valid
        out = []
        for entry in self.q:
            rec = valid(entry)
            if rec is not None:
                out.append((entry, rec))
        return out

    def compact(self) -> None:
        valid = self.valid
        self.q = deque(entry for entry in self.q if valid(entry) is not None)
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

    def __init__(self, state: State, deadline: Any, where: dict[Any, Rec]) -> None:
        self.state = state
        self.label = state_label(state)
        self.terminal = deadline is None
        self.deadline = deadline
        self.seconds: float | None = None if deadline is None else deadline.seconds
        self.stall: float | None = None if deadline is None else deadline.stall
        #: the state deadline's FIFO (None: terminal, or no state deadline)
        self.timer: Clock | None = (
            None if self.seconds is None else Clock(self.seconds, STATE, where)
        )
        self.stalls: Clock | None = None if self.stall is None else Clock(self.stall, STALL, where)
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


def build(
    spec: Any, where: dict[Any, Rec]
) -> tuple[dict[State, Slot], tuple[Slot, ...], Clock | None, tuple[Clock, ...]]:
    """A spec's slots (by state), its live slots, its lifetime clock (or None), and
    every clock that can fire, in tie-break order: state deadlines, progress windows,
    lifetime (the most specific reason first). *where*: the watchdog's records by key,
    through which the clocks' entries find theirs."""
    slots = {state: Slot(state, deadline, where) for state, deadline in spec.deadlines.items()}
    slots.update((state, Slot(state, None, where)) for state in spec.terminal)
    live = tuple(s for s in slots.values() if not s.terminal)
    life = None if spec.lifetime is None else Clock(spec.lifetime, LIFETIME, where)
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
        while q:
            entry = q[0]
            rec = valid(entry)
            if rec is None:
                q.popleft()  # stale: the request left this state or window
                continue
            start = entry[0]
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
NEW = Slot("(new)", None, {})
