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
from heapq import heapify, heappop, heappush
from typing import Any, Final

from ._spec import State, state_label

__all__ = ["DEAD", "LIFETIME", "NEW", "STALL", "STATE", "Clock", "Note", "Rec", "Slot", "Young"]

_INF: Final = float("inf")
#: a record's generation once it is untracked: every FIFO entry for it is stale
DEAD: Final = -1
#: stale FIFO entries tolerated beyond twice the live ones
_SLACK: Final = 1024
#: tombstone values of ``Watchdog._gone``: the key was force-failed (enforce mode) ...
EXPIRED: Final = True
#: ... or it concluded (terminal state, forget(), or reported-then-ended)
CONCLUDED: Final = False


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

    __slots__ = (
        "beat",
        "born",
        "first",
        "gen",
        "key",
        "lifestart",
        "note",
        "since",
        "slot",
        "young",
    )

    def __init__(self, key: Any, slot: Slot, since: float) -> None:
        self.key = key
        self.slot = slot
        self.since = since
        self.gen = self.born = next(_BASES)
        self.beat = since
        self.note: Note | None = None
        #: not admitted yet: no entry on any clock (see Young)
        self.young = True
        #: the start of its lifetime
        self.lifestart = since
        #: its first reading: no start of its is earlier (see Young)
        self.first = since


#: ``(start, key, stamp)``
Entry = tuple[float, Any, int]

#: the kinds of clock, each with its rule for when an entry holds
STATE: Final = "state"
STALL: Final = "stall"
LIFETIME: Final = "lifetime"


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


def _entry(item: tuple[float, int, Any]) -> Entry:
    """A heap item ``(start, stamp, key)`` as an entry ``(start, key, stamp)``."""
    return (item[0], item[2], item[1])


class Clock:
    """One deadline clock: a lazy FIFO of ``(start, key, stamp)`` in time order (the
    entries made by state changes and renewals of admitted records), and a heap of the
    entries made when a record was admitted (:class:`Young`), whose starts are older
    than the FIFO's tail, as ``(start, stamp, key)`` (a stamp is unique to a record's
    generation, so no two items compare their keys; and, as a FIFO entry, such a tuple
    is one the garbage collector stops tracking)."""

    __slots__ = ("heap", "last", "limit", "q", "reason", "seconds", "valid")

    def __init__(self, seconds: float, reason: str, where: dict[Any, Rec]) -> None:
        self.q: deque[Entry] = deque()
        self.heap: list[tuple[float, int, Any]] = []
        self.seconds = seconds
        self.reason = reason
        #: the record an entry still holds for (None: it is stale)
        self.valid = holds(reason, where)
        #: compact when the FIFO or the heap grows past this (amortised O(1) per append)
        self.limit = _SLACK
        #: the latest start given on this clock, to a young record or on the FIFO: an
        #: ``at=`` earlier than it is raised to it, whether or not the record is young
        #: (so a deadline starts where it would if every record were on the FIFO)
        self.last = -_INF

    def push(self, start: float, rec: Rec, gen: int, ordered: bool) -> float:
        """Append *rec*'s entry (stamp *gen*) starting at *start*, raised to the latest
        start on this clock if earlier (the FIFO stays in time order: only its head can
        be due; the caller says with *ordered* that *start* is the watchdog's latest
        reading, which no start on the clock exceeds); returns the start it got.
        Compacts when stale entries pile up."""
        if not ordered and self.last > start:
            start = self.last
        self.last = start
        q = self.q
        q.append((start, rec.key, gen))
        if len(q) > self.limit:
            self.compact()
        return start

    def start(self, start: float, ordered: bool) -> float:
        """The start a young record's entry gets (as push() would give it), without an
        entry."""
        if not ordered and self.last > start:
            start = self.last
        self.last = start
        return start

    def renew(self, now: float, rec: Rec) -> float:
        """A progress window renewed at *now*, the latest reading: a new entry."""
        return self.push(now, rec, rec.gen, True)

    def mark(self, now: float, rec: Rec) -> float:
        """A young record's window renewed at *now*, the latest reading: no entry."""
        self.last = now
        return now

    def admit(self, start: float, rec: Rec, gen: int) -> None:
        """A record's entry made at its admission: onto the FIFO if *start* is not
        earlier than its tail (it stays in time order; records are admitted in the
        order they were first seen, so one that has not changed state since usually
        is), else onto the heap."""
        q = self.q
        if not q or q[-1][0] <= start:
            q.append((start, rec.key, gen))
            if len(q) > self.limit:
                self.compact()
            return
        heap = self.heap
        heappush(heap, (start, gen, rec.key))
        if len(heap) > self.limit:
            self.compact()

    def head(self) -> Entry | None:
        """The earliest live entry (FIFO head or heap top), dropping stale ones on the
        way."""
        q = self.q
        valid = self.valid
        while q and valid(q[0]) is None:
            q.popleft()
        heap = self.heap
        while heap and valid(_entry(heap[0])) is None:
            heappop(heap)
        if not heap:
            return q[0] if q else None
        if not q or heap[0][0] < q[0][0]:
            return _entry(heap[0])
        return q[0]

    def live(self) -> list[tuple[Entry, Rec]]:
        """Every live entry with its record, FIFO first, then the heap (the views)."""
        valid = self.valid
        out = []
        for entry in itertools.chain(self.q, map(_entry, self.heap)):
            rec = valid(entry)
            if rec is not None:
                out.append((entry, rec))
        return out

    def compact(self) -> None:
        valid = self.valid
        self.q = deque([entry for entry in self.q if valid(entry) is not None])
        heap = self.heap = [item for item in self.heap if valid(_entry(item)) is not None]
        heapify(heap)
        self.limit = 2 * max(len(self.q), len(heap)) + _SLACK

    def tail(self) -> float:
        return self.last


class Young:
    """Deferred admission: the records not yet on any clock, in the order they were
    made (and of their first readings, ``Rec.first``).

    A new record is *young*: its state changes and renewals write its attributes
    (and lower ``Watchdog._next_due`` to their deadlines), and put no entry on a
    clock. None of its deadlines can fall due before its first reading plus the
    shortest duration of any clock (``least``): every start is at or after that
    reading. So the watchdog admits it (its current entries onto the clocks'
    heaps) only in a check that runs at or
    after its first reading plus half of ``least``, and a request that ends before
    that costs its state changes attribute writes only. ``Watchdog._next_due`` stays
    at or before the head's first reading plus ``least``, so a check comes in time.
    The queue is in the order of first readings: a record whose first reading (an
    ``at=``) is earlier than the queue's tail is admitted at once instead.
    """

    __slots__ = ("least", "life", "q", "stale")

    def __init__(self, least: float, life: Clock | None) -> None:
        self.q: deque[Rec] = deque()
        #: the shortest duration of any clock (inf: no clock)
        self.least = least
        #: the lifetime clock (None: no lifetime)
        self.life = life
        #: entries in q whose record was untracked while young
        self.stale = 0

    def add(self, rec: Rec, now: float, ordered: bool) -> float:
        """A new record first read at *now* (lock held): its lifetime's start, and its
        place at the end of the queue, or admitted at once if *now* (an ``at=``,
        *ordered* False) is earlier than the queue's tail. Returns its lifetime's due
        time (inf: none). (Each of its other deadlines lowers ``_next_due`` as it is
        set, as for any record: a check comes in time for it, and a wake-up only for an
        earlier deadline.)"""
        life = self.life
        due = _INF
        if life is not None:
            start = rec.lifestart = life.start(now, ordered)
            due = start + life.seconds
        q = self.q
        if not ordered and q and now < q[-1].first:
            rec.young = False  # (its entries: made by its state change, lifetime's here)
            if life is not None:
                life.admit(rec.lifestart, rec, rec.born)
        else:
            q.append(rec)
        return due

    def admit(self, now: float) -> float:
        """A check at *now* (lock held): admit the records first read at least half
        ``least`` ago (none of the others can be due). Returns a lower bound on the
        deadlines of those left young: the head's first reading plus ``least``."""
        q = self.q
        life = self.life
        last = now - self.least / 2
        while q and q[0].first <= last:
            rec = self.pop()
            if rec is not None:
                enrol(rec, life)
        return q[0].first + self.least if q else _INF

    def settle(self, due: float) -> float:
        """The exact next due time, given *due*, the clocks' (``next_deadline()``):
        the young records that might be due before it are admitted, and their own
        deadlines taken in (each record is admitted once)."""
        q = self.q
        least = self.least
        life = self.life
        while q and q[0].first + least < due:
            rec = self.pop()
            if rec is not None:
                enrol(rec, life)
                due = min(due, due_of(rec, life))
        return due

    def gone(self) -> None:
        """A young record was untracked (its generation is :data:`DEAD`): it is stale
        in the queue. Once more than half the queue is, it is compacted (amortised
        O(1)), so it holds no more than twice the young records, whether or not checks
        run."""
        self.stale += 1
        if 2 * self.stale > len(self.q):
            self.q = deque([rec for rec in self.q if rec.gen != DEAD])
            self.stale = 0

    def pop(self) -> Rec | None:
        """Take the head off; the record if it is still tracked, else None."""
        rec = self.q.popleft()
        if rec.gen == DEAD:
            self.stale -= 1
            return None
        return rec


def enrol(rec: Rec, life: Clock | None) -> None:
    """Admit a young record: its state deadline, progress window and lifetime entries,
    with the starts they got, onto the heaps of their clocks."""
    rec.young = False
    slot = rec.slot
    gen = rec.gen
    timer = slot.timer
    if timer is not None:
        timer.admit(rec.since, rec, gen)
    stalls = slot.stalls
    if stalls is not None:
        stalls.admit(rec.beat, rec, gen)
    if life is not None:
        life.admit(rec.lifestart, rec, rec.born)


def due_of(rec: Rec, life: Clock | None) -> float:
    """The earliest deadline of a young record (its attributes; no entry)."""
    slot = rec.slot
    due = _INF
    if slot.seconds is not None:
        due = rec.since + slot.seconds
    if slot.stall is not None:
        due = min(due, rec.beat + slot.stall)
    if life is not None:
        due = min(due, rec.lifestart + life.seconds)
    return due


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


def build(
    spec: Any, where: dict[Any, Rec]
) -> tuple[dict[State, Slot], tuple[Slot, ...], Young, tuple[Clock, ...]]:
    """A spec's slots (by state), its live slots, its young records' queue (with the
    lifetime clock, or None), and
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
    least = min((c.seconds for c in clocks if c is not None), default=_INF)
    young = Young(least, life)
    return slots, live, young, tuple(c for c in clocks if c is not None)


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
        heap = clock.heap
        while heap:
            item = heap[0]
            start = item[0]
            rec = valid((start, item[2], item[1]))
            if rec is None:
                heappop(heap)
                continue
            due = start + seconds
            if due > now:
                if due < next_due:
                    next_due = due
                break
            heappop(heap)
            add((due, rec, clock, start))
    return next_due


#: the slot of a record that is being created: it leaves no state (no time in state, no
#: leave notification) when it enters its first one
NEW: Final = Slot("(new)", None, {})
