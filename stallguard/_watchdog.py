"""The watchdog: per-state deadline tracking at hot-loop cost.

Design (docs/watchdog.md, "How it works", says more):

* A tracked request is one record (``Rec``): its key, its state's slot, when it entered
  the state, the last renewal of its progress window, and a generation that counts its
  state entries (from a base unique to the record: ``_fifo``).
* Every deadline clock (each state's deadline, each progress window, the lifetime) is a
  **lazy FIFO**: a ``deque`` of ``(start, key, stamp)`` appended in time order (the
  key, not the record: such a tuple is one CPython's collector stops tracking, see
  ``_fifo``). Every entry on one clock shares one duration, so entries fall due in the
  order they were appended and only the head can be due. Leaving a state does not
  touch the FIFO: it bumps the record's generation, which makes the old entry stale;
  stale entries are dropped when they reach the head (or by a compaction that keeps
  each FIFO within twice its live entries plus a constant). A state change is
  therefore a few attribute writes and one ``deque.append``.
* **Deferred admission** (``_fifo.Young``): a new record is *young* and puts no entry
  on any clock (its state changes are attribute writes only) until a check that runs
  at least half the shortest duration after its first reading, or ``next_deadline()``,
  admits it (entries with the starts it got, onto the FIFOs or a heap beside each).
  None of its deadlines can be due before then; a request that lives milliseconds
  against deadlines of tens of seconds never touches a clock.
* **Time only moves forward.** Every clock reading that is appended is taken under the
  lock, where the order of the FIFOs is decided, validated (a finite number, else
  :class:`~stallguard.ClockError`), and raised to the latest reading the watchdog has
  seen (``_latest``). So each FIFO is in time order by construction (an ``at=`` is raised
  to the latest start given on its clock), and a progress window only ever extends.
* A state without a state deadline has no state FIFO (nothing would ever drain it):
  its requests are found through their records, and a record that left it is freed at
  once.
* ``_next_due`` is a lower bound on the earliest due time of any FIFO head (stale or
  not) and of any young record. It only moves down when a deadline is set, and is
  recomputed after an expiry pass (exactly, but for the young queue's head: its first
  reading plus the shortest duration), so ``check()`` with nothing due is one clock
  read and one comparison.
* No thread, task or timer exists per request; expiries are decided in ``check()``,
  where the owner of the requests can act on them. Hooks and listeners never run while
  the watchdog holds its lock. A ``BaseException`` raised by one of them interrupts the
  delivery; what is left of it is carried (``_carry``) to the next ``check()``.
* Where the rest lives: the records and clocks (``Clock.push``, the one way an entry
  is added) in ``_fifo``; delivery to hooks and listeners, ``add_listener``,
  ``remove_listener`` and ``annotate`` in ``_delivery``; the ``guard`` decorator in
  ``_guard``; ``snapshot``, ``statistics``, ``advice`` and the tests' views in
  ``_views``; ``Expiry`` construction beside the class (``_details.new_expiry``);
  argument checks and observe's rare paths (an unhashable or unknown state) in
  ``_validate``. Public methods that live elsewhere are bound in the class body
  (``annotate = _delivery.annotate``), their docstrings with them. This module keeps
  the tracking and the expiry decision.
* A watchdog keeps at most 29 instance attributes: CPython 3.11 keeps an instance's
  attributes in its class's shared-key table up to that many, and every attribute load
  is slower past it (tests/test_watchdog.py checks the count).
"""

from __future__ import annotations

import logging
import math
import operator
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from . import _adopt, _delivery, _guard, _registry, _views
from ._delivery import Listener, Plan, describe_hook
from ._details import Expiry, Mode, new_expiry
from ._errors import ConfigError
from ._fifo import (
    CONCLUDED,
    DEAD,
    EXPIRED,
    NEW,
    Clock,
    Rec,
    Slot,
    Young,
    exact_due,
    pop_due,
)
from ._fifo import build as build_clocks
from ._options import WatchdogOptions
from ._options import resolve as resolve_options
from ._spec import Spec, State
from ._stats import StatsRecorder
from ._validate import (
    check_at,
    check_time,
    clock_reading,
    expire_hooks,
    tracked,
    unhashable,
    unhashable_lookup,
    unknown_state,
)

__all__ = ["Listener", "Watchdog"]

log = logging.getLogger("stallguard")

K = TypeVar("K", bound=Hashable)

_INF = math.inf
#: where ``Watchdog._latest`` starts: below every finite reading, and not -inf (so that
#: ``latest <= reading < inf``, the fast path's test, refuses -inf, NaN and +inf)
_EARLIEST = -sys.float_info.max
_by_due = operator.itemgetter(0)


class Watchdog(Generic[K]):
    """Tracks live requests through the states of a :class:`~stallguard.Spec` and fails
    the ones that overstay a deadline, exactly once.

    Args:
        spec: the states and their deadlines.
        on_expire: a callable, or a sequence of callables, that enforces an expiry: it is
            called with each :class:`~stallguard.Expiry` in ``"enforce"`` mode (to fail
            the request the way its owner fails requests). It is not called in
            ``"report"`` mode. Listeners (:meth:`add_listener`) and instrumentation
            hooks (logging, OpenTelemetry; see :mod:`stallguard.instrumentation`) see
            every expiry in both modes.
        options: a :class:`~stallguard.WatchdogOptions`; the keyword arguments below
            override its fields.
        clock: returns the current time in seconds; must never go backwards. Defaults to
            :func:`time.monotonic`. Tests pass a :class:`stallguard.testing.FakeClock`.
            Every reading is validated: one that is not a finite number raises
            :class:`~stallguard.ClockError`, and one earlier than the latest reading
            counts as the latest (time only moves forward inside the watchdog).
        mode: ``"enforce"`` (default) fails overdue requests; ``"report"`` only reports
            them (each request once per deadline), for a safe rollout.
        unknown_state: ``"raise"`` (default) raises :class:`~stallguard.UnknownStateError`
            when a state the spec does not declare is observed; ``"ignore"`` drops it
            and counts it.
        memory: how many concluded keys (expired, terminal or forgotten) are remembered,
            so that a late ``observe`` for them is dropped instead of re-tracking the
            request (default 65,536). The oldest are forgotten first.
        statistics: record time in state for :meth:`statistics` and :meth:`advice`
            (default False; see :class:`~stallguard.WatchdogOptions`).
        describe: a function of a key returning span attributes (a mapping with string
            keys) for its :class:`~stallguard.Expiry`, called only when the key expires,
            outside the lock, before any hook sees the expiry: what an integration
            would otherwise :meth:`annotate` on every request, paid only for the few
            that expire. Attributes set with :meth:`annotate` win over it. If it raises
            an ``Exception`` (or returns something else than such a mapping), that is
            logged and counted like a failing hook and the expiry goes on without its
            attributes; a ``BaseException`` is handled like one raised by a hook.

    Raises:
        ConfigError: naming the argument and the bad value.

    All methods are thread-safe: state changes may come from transfer threads while one
    thread runs :meth:`check`.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        on_expire: Callable[[Expiry[K]], object]
        | Iterable[Callable[[Expiry[K]], object]]
        | None = (),
        options: WatchdogOptions | None = None,
        clock: Callable[[], float] | None = None,
        mode: Mode | None = None,
        unknown_state: str | None = None,
        memory: int | None = None,
        statistics: bool | None = None,
        describe: Callable[[K], Mapping[str, Any]] | None = None,
    ) -> None:
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be a stallguard.Spec, got {spec!r}")
        self._spec = spec
        self._options = options = resolve_options(
            options,
            clock=clock,
            mode=mode,
            unknown_state=unknown_state,
            memory=memory,
            statistics=statistics,
        )
        self._mode: Mode = options.mode
        self._clock = options.clock
        self._enforce_hooks = expire_hooks(on_expire)
        if describe is not None and not callable(describe):
            raise ConfigError(f"describe must be a callable, got {describe!r}")
        #: runs first for every expiry (see _delivery.describe_hook)
        self._describe_hooks: tuple[Callable[[Expiry[K]], object], ...] = (
            () if describe is None else (describe_hook(describe),)
        )
        self._memory = options.memory
        self._slots: dict[State, Slot]
        self._live: tuple[Slot, ...]
        self._young: Young
        self._clocks: tuple[Clock, ...]
        self._where: dict[K, Rec] = {}
        self._slots, self._live, self._young, self._clocks = build_clocks(spec, self._where)
        self._gone: OrderedDict[K, bool] = OrderedDict()
        self._next_due = _INF
        #: the latest clock reading taken under the lock: a later one is never earlier
        self._latest = _EARLIEST
        self._lock = threading.Lock()
        self._expired = 0
        self._hook_errors = 0
        self._late = 0
        self._unknown = 0
        self._runner_errors = 0
        self._withdrawn = 0
        #: time-in-state statistics (docs/advice.md); None when switched off
        self._stats: StatsRecorder | None = StatsRecorder(spec) if options.statistics else None
        if self._stats is not None:
            for slot in self._live:
                slot.hist = self._stats.hist(slot.state)
        # what an interrupted delivery had not finished, for the next check(): expiries
        # with the rest of their plan (those fully delivered with none: each is still
        # returned), and leave notifications ((label, seconds)) with the rest of theirs
        self._carry: list[tuple[Expiry[K] | tuple[str, float], Plan]] = []
        self._listeners: tuple[Listener, ...] = ()
        #: who sees an expiry (cached until the listeners or instrumentation hooks change)
        self._plan = Plan((), ())
        self._leave_plan = Plan((), ())
        self._leave_listeners: tuple[Callable[[str, float], object], ...] = ()
        self._wake_listeners: tuple[Callable[[], object], ...] = ()
        _registry.register_watchdog(self)

    # ------------------------------------------------------------------ read-only

    @property
    def spec(self) -> Spec:
        """The :class:`~stallguard.Spec` (read-only)."""
        return self._spec

    @property
    def mode(self) -> Mode:
        """``"enforce"`` or ``"report"`` (read-only: make a new watchdog to switch)."""
        return self._mode

    @property
    def options(self) -> WatchdogOptions:
        """The validated :class:`~stallguard.WatchdogOptions` (read-only)."""
        return self._options

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the watchdog reads."""
        return self._clock

    # ------------------------------------------------------------------ listeners

    add_listener = _delivery.add_listener

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The listeners added with :meth:`add_listener` and not removed yet."""
        return self._listeners

    remove_listener = _delivery.remove_listener

    # ------------------------------------------------------------------ state changes

    def observe(self, key: K, state: State, *, at: float | None = None) -> None:
        """Record that request *key* is in *state* now (or since *at*).

        The first sight of a key starts tracking it. A different state restarts the
        state clock; observing the same state again does not (Erlang ``gen_statem``'s
        ``state_timeout`` rule). A terminal state untracks the key and remembers it as
        concluded, **also when it is the first sight of the key**: a stale live state
        arriving after a request finished never re-tracks it. An observe for a key that
        has concluded (expired, terminal, or forgotten, and still within ``memory``) is
        dropped and counted as a late event: it never re-arms the request.

        Args:
            at: when the request entered *state*, on the watchdog's clock; default: now.
                For changes captured (with a clock reading) where they happen and
                applied later, e.g. by the loop that runs :meth:`check`. A finite
                number, never later than now. To keep every deadline clock in time
                order, an *at* earlier than the latest start given on that clock (to
                any request) is raised to it, and a state never starts before the one
                it ends: a deadline may start a little later than *at*, never earlier.

        Raises:
            UnknownStateError: if *state* is not declared in the spec (or is not
                hashable) and ``unknown_state="raise"``.
            ValueError: if *at* is later than the clock's now, NaN or infinite (also
                when *state* is the key's current state, which changes nothing).
            TypeError: if *at* is not a number, or *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        try:
            slot = self._slots.get(state)
            rec = self._where.get(key)
        except TypeError:  # the state or the key is unhashable
            slot, rec = unhashable_lookup(self, key, state)
        if slot is None:
            unknown_state(self, key, state)
            return
        if rec is not None and rec.slot is slot:  # same state again: nothing to do
            if at is not None:
                self._same_state_at(at)
            return
        left: tuple[str, float] | None = None
        with self._lock:
            # Read under the lock, where the FIFOs' order is decided (see _read).
            now = self._clock()
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            if at is not None:
                now = check_at(at, now)
            if rec is None or rec.gen == DEAD:
                # (a record still alive under the lock is still the key's: only untrack
                # removes one, and it marks it dead first)
                rec = self._where.get(key)
            pending = self._next_due  # lowered below if an earlier deadline appears
            if rec is None:
                if slot.terminal or key in self._gone:
                    self._unseen(key, slot)
                    return
                rec = self._where[key] = Rec(key, NEW, now)
                due = self._young.add(rec, now, at is None)  # (its lifetime's due)
                if due < self._next_due:
                    self._next_due = due
                self._change(rec, slot, now, at is None)
            elif rec.slot is not slot:
                left = self._change(rec, slot, now, at is None)
            woke = self._next_due < pending
        if left is not None or woke:
            self._tell(left, woke)

    def _unseen(self, key: K, slot: Slot) -> None:
        """An observe of *key*, untracked, in *slot* (lock held): a terminal first
        sight is remembered as concluded; a key that concluded is a late event."""
        if slot.terminal:
            how = self._gone.get(key)
            if how is None:
                self._bury(key, CONCLUDED)
            elif how is EXPIRED:  # the request was failed: its end comes late
                self._late += 1
        else:
            self._late += 1

    def _change(self, rec: Rec, slot: Slot, now: float, ordered: bool) -> tuple[str, float] | None:
        """*rec* leaves its state (:data:`~stallguard._fifo.NEW` for a new record) for
        *slot* at *now* (lock held): its time in the state is recorded, then a terminal
        *slot* untracks it; a live one is entered: its starts on the state's clock and
        progress window (*ordered*: *now* is the latest reading, no clock has a later
        start), and, admitted, a new generation and their entries, with ``_next_due``
        lowered to their deadlines. Returns the leave notification (None without leave
        listeners). (One function, not two: a call less on the hottest path.)"""
        if not ordered:
            now = max(now, rec.since)  # a state never starts before the one it ends
        old = rec.slot
        if old.parked:
            old.parked.pop(rec, None)
        hist = old.hist
        if hist is not None:  # time in state (statistics=True)
            hist.add(now - rec.since)
        left = (old.label, now - rec.since) if self._leave_listeners else None
        if slot.terminal:
            stats = self._stats
            if stats is not None and stats._reported:  # how a reported one ended
                stats.ended(rec.key, slot.state)
            self._untrack(rec, CONCLUDED)
        else:
            rec.slot = slot
            start = now
            timer = slot.timer
            if rec.young:  # no entry, no new generation: its start only (_fifo.Young)
                if timer is not None:
                    if ordered:  # (no start on the clock is later)
                        timer.last = now
                    else:
                        start = timer.start(now, False)
                    due = start + timer.seconds
                    if due < self._next_due:
                        self._next_due = due
                rec.since = start
                stalls = slot.stalls
                if stalls is not None:
                    beat = rec.beat = stalls.start(now, ordered)
                    due = beat + stalls.seconds
                    if due < self._next_due:
                        self._next_due = due
                return None if old is NEW else left
            gen = rec.gen = rec.gen + 1
            if timer is not None:
                start = timer.push(now, rec, gen, ordered)
                due = start + timer.seconds
                if due < self._next_due:
                    self._next_due = due
            rec.since = start
            stalls = slot.stalls
            if stalls is not None:
                beat = rec.beat = stalls.push(now, rec, gen, ordered)
                due = beat + stalls.seconds
                if due < self._next_due:
                    self._next_due = due
        return None if old is NEW else left

    def _tell(self, left: tuple[str, float] | None, woke: bool) -> None:
        """After a state change, outside the lock: the leave listeners, then (also if
        one of them raised a ``BaseException``) the wake-up listeners."""
        try:
            if left is not None:
                _delivery.notify_leave(self, left)
        finally:
            if woke and self._wake_listeners:
                _delivery.notify_wake(self)

    def heartbeat(self, key: K, *, at: float | None = None) -> bool:
        """Record progress for *key*: renews the progress (``stall``) window of its
        current state. Lifetime and state deadlines are not renewed.

        Args:
            at: when the progress was made, on the watchdog's clock; default: now. As
                for :meth:`observe`: finite, never later than now, and raised to the
                latest renewal's time if earlier (a window never starts before a later
                one).

        Returns:
            True if *key* is tracked, False if it is not (a late heartbeat is harmless).

        Raises:
            ValueError: if *at* is later than the clock's now, NaN or infinite.
            TypeError: if *at* is not a number, or *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        woke = False
        with self._lock:
            now = self._clock()  # under the lock, as in observe()
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            if at is not None:
                now = check_at(at, now)
            try:
                rec = self._where.get(key)
            except TypeError:
                raise unhashable(key) from None
            if rec is None:
                return False
            stalls = rec.slot.stalls
            if stalls is not None:
                if at is not None:
                    now = max(now, stalls.tail())  # the FIFO stays in time order
                if now <= rec.beat:  # a window only ever extends (one entry per start)
                    return True
                rec.beat = (stalls.mark if rec.young else stalls.renew)(now, rec)  # (Young)
                due = now + stalls.seconds
                if due < self._next_due:
                    self._next_due = due
                    woke = True
        if woke and self._wake_listeners:
            _delivery.notify_wake(self)
        return True

    def forget(self, key: K, *, remember: bool = True) -> bool:
        """Stop tracking *key* (the abort path). Idempotent.

        Args:
            remember: keep the key among the concluded ones, so that a late ``observe``
                does not re-track it. Pass False to allow the key to be reused at once.

        Returns:
            True if *key* was tracked.

        Raises:
            TypeError: if *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        left: tuple[str, float] | None = None
        with self._lock:
            rec = tracked(self, key)
            if rec is None:
                if not remember:
                    self._gone.pop(key, None)
                elif key not in self._gone:
                    self._bury(key, CONCLUDED)
                return False
            now = self._clock()  # (read before anything changes: it may be refused)
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            slot = rec.slot
            if slot.parked:
                slot.parked.pop(rec, None)
            seconds = now - rec.since
            if self._leave_listeners:
                left = (slot.label, seconds)
            stats = self._stats
            if stats is not None:
                stats.left(slot.state, seconds)
                stats.ended(key, None)
            # (not remembered: never buried, so no older key's memory is pushed out)
            self._untrack(rec, CONCLUDED if remember else None)
        if left is not None:
            _delivery.notify_leave(self, left)
        return True

    annotate, adopt, record_stays = _delivery.annotate, _adopt.adopt, _adopt.record_stays

    # ------------------------------------------------------------------ deadlines

    def check(self, now: float | None = None) -> list[Expiry[K]]:
        """Expire every request that is overdue at *now* (default: the clock's now).

        In ``"enforce"`` mode each overdue request is untracked, remembered as expired,
        and handed to ``on_expire``, to the listeners and to the instrumentation hooks,
        exactly once. In ``"report"`` mode it stays tracked and is handed to the
        listeners and the instrumentation hooks once per deadline. A hook that raises an
        ``Exception`` is logged and counted; it never stops the check or loses another
        expiry. A ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) raised by
        a hook, a listener or ``describe`` propagates at once, and what it interrupted
        (the expiries with the hooks they had not reached, the leave notifications not
        made) is delivered by the next ``check()``, which also returns every expiry of
        the interrupted one: none is lost.

        Cheap when nothing is due: one clock read and one comparison.

        Returns:
            The expiries, earliest deadline first (any carried over from an interrupted
            check come first).

        Raises:
            ValueError: if *now* is NaN or infinite.
            TypeError: if *now* is not a number.
            ClockError: if the clock returns something that is not a finite time (and
                something may be due: with nothing due, the reading is only compared).
        """
        if now is None:
            now = self._clock()
            try:
                if now < self._next_due:  # NaN is never less: it goes on to be refused
                    return []
            except TypeError:  # not even comparable: refused by _expire
                pass
            return self._expire(now, True)
        now = check_time("now", now)
        if now < self._next_due:
            return []
        return self._expire(now, False)

    def _expire(self, now: Any, reading: bool) -> list[Expiry[K]]:
        """check()'s work once something may be due (kept out of check() so that the
        idle path stays one comparison). *reading*: *now* is the clock's, unchecked."""
        if not _registry.resolved():
            # Build the instrumentation hooks (a factory's import, at a process's first
            # expiry) before the reading this check's expiries are measured from.
            _registry.active_hooks()
            if reading:
                now = self._clock()
        with self._lock:
            if reading:
                if now.__class__ is float and self._latest <= now < _INF:
                    self._latest = now
                else:
                    now = self._read(now)
            carry = self._carry
            if carry:
                self._carry = []
            expiries, left = self._collect(now)
        return _delivery.dispatch(self, expiries, left, carry)

    def next_deadline(self) -> float | None:
        """The earliest time (on the watchdog's clock) at which a tracked request
        becomes overdue, or None if no deadline is pending."""
        with self._lock:
            # (young records that might be due earlier are admitted: exact)
            due = self._young.settle(exact_due(self._clocks))
            self._next_due = -_INF if self._carry else due
        return None if due == _INF else due

    def expired(self, key: K) -> bool:
        """True if *key* was force-failed by this watchdog (and is still remembered)."""
        return self._gone.get(key) is EXPIRED

    def state_of(self, key: K) -> State | None:
        """The state *key* is tracked in, or None if it is not tracked."""
        rec = self._where.get(key)
        return None if rec is None else rec.slot.state

    def __len__(self) -> int:
        """How many requests are tracked (every request in a non-terminal state)."""
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __repr__(self) -> str:
        return (
            f"<stallguard.Watchdog spec={self._spec.name!r} mode={self._mode!r} "
            f"tracked={len(self._where)}>"
        )

    # ------------------------------------------------------------------ poll loops

    guard = _guard.guard

    # ------------------------------------------------------------------ operators

    snapshot = _views.snapshot
    statistics = _views.statistics
    advice = _views.advice

    # ------------------------------------------------------------------ internals

    # (tests)
    _remembered = _views.remembered
    _footprint = _views.footprint
    _in_time_order = _views.in_time_order
    _overdue = _views.overdue

    def _read(self, reading: Any) -> float:
        """The clock's *reading* as the watchdog's now (lock held): a finite number
        (else :class:`~stallguard.ClockError`, before anything changed), and never
        earlier than the latest reading: time only moves forward, so appending it keeps
        every FIFO in time order. (The hot paths inline the common case: a float, not
        earlier than the latest, finite.)"""
        t = clock_reading(self._spec.name, self._clock, reading)
        latest = self._latest
        if t < latest:  # the clock stepped back: time stands still until it catches up
            return latest
        self._latest = t
        return t

    def _same_state_at(self, at: Any) -> None:
        """Refuse a bad *at* in an observe that changes nothing, as any other *at*."""
        if at.__class__ is float and -_INF < at <= self._latest:
            return  # finite, and not later than a reading already seen
        with self._lock:
            now = self._read(self._clock())
        check_at(at, now)

    def _runner_failed(self) -> None:
        """Count a runner loop that an error ended (called by the runner)."""
        with self._lock:
            self._runner_errors += 1

    def _untrack(self, rec: Rec, how: bool | None) -> None:
        """Drop every trace of *rec* but its key's tombstone (*how*; None: none) (lock
        held). Its FIFO entries go stale."""
        rec.gen = DEAD
        rec.note = None
        del self._where[rec.key]
        if rec.young:
            self._young.gone()
        if how is not None:
            self._bury(rec.key, how)

    def _bury(self, key: K, how: bool) -> None:
        gone = self._gone
        gone[key] = how
        if len(gone) > self._memory:
            gone.popitem(last=False)

    def _collect(self, now: float) -> tuple[list[Expiry[K]], list[tuple[str, float]]]:
        """Find and retire everything due at *now* (lock held). Enforce: one expiry per
        request, for its earliest overdue deadline. Report: every overdue (request,
        deadline) pair, each once."""
        found: list[tuple[float, Rec, Clock, float]] = []
        bound = self._young.admit(now)  # (a bound on the young ones' dues)
        next_due = min(pop_due(self._clocks, now, found), bound)
        expiries: list[Expiry[K]] = []
        left: list[tuple[str, float]] = []
        if found:
            if len(found) > 1:
                found.sort(key=_by_due)  # stable: clock order among equal due times
            enforce = self._mode == "enforce"
            listening = bool(self._leave_listeners)
            stats = self._stats
            spec = self._spec.name
            mode = self._mode
            append = expiries.append
            for _due, rec, clock, start in found:
                if rec.gen == DEAD:  # enforce: already expired by an earlier deadline
                    continue
                slot = rec.slot
                note = rec.note
                expiry = new_expiry(
                    rec.key,
                    spec,
                    slot.state,
                    start,
                    now - start,
                    clock.seconds,
                    clock.reason,
                    mode,
                    {} if note is None else dict(note.attributes),
                    None if note is None else note.parent,
                    () if note is None else note.links,
                )
                append(expiry)
                if stats is not None:
                    stats.fired(rec.key, slot.state, enforce, clock.reason)
                if enforce:
                    if slot.parked:
                        slot.parked.pop(rec, None)
                    if stats is not None:
                        stats.left(slot.state, now - rec.since)
                    if listening:
                        left.append((slot.label, now - rec.since))
                    self._untrack(rec, EXPIRED)
                elif clock is slot.timer:
                    slot.parked[rec] = start
        self._expired += len(expiries)
        self._next_due = next_due
        return expiries, left
