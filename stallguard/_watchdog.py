"""The watchdog: per-state deadline tracking at hot-loop cost.

Design (see docs/watchdog.md for the why):

* Every state has one fixed deadline, so the requests in a state expire in the order
  they entered it. Each non-terminal state keeps an insertion-ordered FIFO
  (``OrderedDict`` key -> entry time); a state change is a delete in one FIFO and an
  append to another, O(1). Only FIFO heads can be due.
* Progress windows keep a FIFO per state too; a heartbeat moves its key to the tail
  (a renewal never strands an overdue entry behind a renewed head). The lifetime
  deadline keeps one FIFO in order of first observation.
* ``_next_due`` is a lower bound on the earliest due time of any FIFO head. It only
  ever moves down when something is appended and is recomputed exactly after an
  expiry pass, so ``check()`` with nothing due is one clock read and one comparison,
  whatever the number of tracked requests.
* No thread, task or timer exists per request; an expiry is decided in ``check()``,
  where the owner of the request can act on it.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, cast

import attrs

from . import instrumentation as _instrumentation
from ._advice import Advice, advise
from ._details import Expiry, Mode, Snapshot, StateSummary, TrackedRequest
from ._errors import ConfigError, UnknownStateError
from ._spec import Deadline, Spec, State, state_label
from ._stats import Statistics, StatsRecorder

__all__ = ["Watchdog"]

log = logging.getLogger("stallguard")

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
R = TypeVar("R")

_MISSING: Any = object()
_INF = math.inf
_EXPIRED = True  # tombstone value: the key was force-failed (enforce mode)
_CONCLUDED = False  # tombstone value: terminal state, forget(), or reported-then-ended
_by_due = operator.itemgetter(0)

# Building the Expiry is most of an expiry's cost. attrs' frozen __init__ sets each field
# through object.__setattr__ (~1.1 µs for 11 fields on CPython 3.11, ~1.6 µs with keyword
# arguments); _collect sets the slots through their descriptors instead (~0.75 µs), which
# builds the identical object. That is only valid while Expiry has exactly these slotted
# fields and nothing else runs at construction: checked here, at import.
_EXPIRY_FIELDS = (
    "key",
    "spec",
    "state",
    "entered_at",
    "elapsed",
    "deadline",
    "reason",
    "mode",
    "attributes",
    "trace_parent",
    "trace_links",
)
if (
    tuple(f.name for f in attrs.fields(Expiry)) != _EXPIRY_FIELDS
    or any(f.validator is not None or f.converter is not None for f in attrs.fields(Expiry))
    or "__slots__" not in Expiry.__dict__
    or hasattr(Expiry, "__attrs_pre_init__")
    or hasattr(Expiry, "__attrs_post_init__")
):  # pragma: no cover
    raise ImportError(
        "stallguard._watchdog._collect builds Expiry by setting its slots "
        f"{_EXPIRY_FIELDS} directly, but Expiry changed (fields now "
        f"{tuple(f.name for f in attrs.fields(Expiry))}); update _collect"
    )
_new_expiry = Expiry.__new__
(
    _set_key,
    _set_spec,
    _set_state,
    _set_entered_at,
    _set_elapsed,
    _set_deadline,
    _set_reason,
    _set_mode,
    _set_attributes,
    _set_trace_parent,
    _set_trace_links,
) = (getattr(Expiry, name).__set__ for name in _EXPIRY_FIELDS)


class _Slot:
    """Per-state bookkeeping."""

    __slots__ = (
        "deadline",
        "fifo",
        "label",
        "parked",
        "seconds",
        "stall",
        "stall_fifo",
        "state",
        "terminal",
    )

    def __init__(self, state: State, deadline: Deadline | None) -> None:
        self.state = state
        self.label = state_label(state)
        self.terminal = deadline is None
        self.deadline = deadline if deadline is not None else Deadline()
        self.seconds = self.deadline.seconds
        self.stall = self.deadline.stall
        # key -> time the key entered this state (only for non-terminal states)
        self.fifo: OrderedDict[Any, float] | None = None if self.terminal else OrderedDict()
        # key -> last progress (only for states with a progress window)
        self.stall_fifo: OrderedDict[Any, float] | None = (
            OrderedDict() if self.stall is not None else None
        )
        # report mode: key -> entry time, for requests whose state deadline was reported
        self.parked: dict[Any, float] = {}


class _Note:
    __slots__ = ("attributes", "links", "parent")

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self.parent: Any = None
        self.links: tuple[Any, ...] = ()


def _hooks(on_expire: object) -> tuple[Callable[[Expiry[Any]], object], ...]:
    if on_expire is None:
        return ()
    if callable(on_expire):
        return (on_expire,)
    if isinstance(on_expire, Iterable) and not isinstance(on_expire, (str, bytes)):
        hooks = tuple(on_expire)
        for hook in hooks:
            if not callable(hook):
                raise ConfigError(f"on_expire must hold callables, got {hook!r}")
        return hooks
    raise ConfigError(f"on_expire must be a callable or a sequence of callables, got {on_expire!r}")


def _check_at(at: Any, now: float) -> float:
    """*at* as a start time: a number not later than *now*."""
    if at.__class__ is bool or not isinstance(at, (int, float)):
        raise TypeError(f"at must be a time in seconds on the watchdog's clock, got {at!r}")
    if not at <= now:  # also NaN
        raise ValueError(f"at={at!r} is later than the watchdog clock's now ({now!r})")
    return at


def _not_before_tail(fifo: OrderedDict[Any, float], start: float) -> float:
    """*start*, or the FIFO's latest start if that is later (keeps the FIFO ordered)."""
    if fifo:
        tail = fifo[next(reversed(fifo))]
        if tail > start:
            return tail
    return start


class Watchdog(Generic[K]):
    """Tracks live requests through the states of a :class:`~stallguard.Spec` and fails
    the ones that overstay a deadline, exactly once.

    Args:
        spec: the states and their deadlines.
        clock: returns the current time in seconds; must never go backwards. Defaults to
            :func:`time.monotonic`. Tests pass a :class:`stallguard.testing.FakeClock`.
        on_expire: a callable, or a sequence of callables, that enforces an expiry: it is
            called with each :class:`~stallguard.Expiry` in ``"enforce"`` mode (to fail
            the request the way its owner fails requests). It is not called in
            ``"report"`` mode. Instrumentation hooks (logging, OpenTelemetry; see
            :mod:`stallguard.instrumentation`) see every expiry in both modes.
        mode: ``"enforce"`` fails overdue requests; ``"report"`` only reports them (each
            request once per deadline), for a safe rollout.
        unknown_state: ``"raise"`` (default) raises :class:`~stallguard.UnknownStateError`
            when a state the spec does not declare is observed; ``"ignore"`` drops it
            and counts it.
        memory: how many concluded keys (expired, terminal or forgotten) are remembered,
            so that a late ``observe`` for them is dropped instead of re-tracking the
            request. Memory stays bounded: the oldest are forgotten first.

    All methods are thread-safe: state changes may come from transfer threads while one
    thread runs :meth:`check`.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[Expiry[K]], object]
        | Iterable[Callable[[Expiry[K]], object]]
        | None = (),
        mode: Mode = "enforce",
        unknown_state: str = "raise",
        memory: int = 65_536,
    ) -> None:
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be a stallguard.Spec, got {spec!r}")
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        if mode not in ("enforce", "report"):
            raise ConfigError(f"mode must be 'enforce' or 'report', got {mode!r}")
        if unknown_state not in ("raise", "ignore"):
            raise ConfigError(f"unknown_state must be 'raise' or 'ignore', got {unknown_state!r}")
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
            raise ConfigError(f"memory must be a positive int, got {memory!r}")
        self.spec = spec
        self.mode: Mode = mode
        self._clock = clock
        self._enforce_hooks = _hooks(on_expire)
        self._raise_unknown = unknown_state == "raise"
        self._memory = memory

        self._slots: dict[State, _Slot] = {}
        for state, deadline in spec.deadlines.items():
            self._slots[state] = _Slot(state, deadline)
        for state in spec.terminal:
            self._slots[state] = _Slot(state, None)
        live = [s for s in self._slots.values() if not s.terminal]
        self._live: tuple[_Slot, ...] = tuple(live)
        self._timed: tuple[_Slot, ...] = tuple(s for s in live if s.seconds is not None)
        self._stalled: tuple[_Slot, ...] = tuple(s for s in live if s.stall is not None)
        self._lifetime = spec.lifetime
        self._born: OrderedDict[K, float] | None = (
            OrderedDict() if spec.lifetime is not None else None
        )
        # Every deadline clock as (FIFO of key -> start, seconds, reason): the state
        # deadlines, the progress windows, the lifetime. Only FIFO heads can be due.
        clocks: list[tuple[OrderedDict[Any, float], float, Any]] = [
            (s.fifo, s.seconds, "state")
            for s in self._timed  # type: ignore[misc]
        ]
        clocks += [(s.stall_fifo, s.stall, "stall") for s in self._stalled]  # type: ignore[misc]
        if self._born is not None:
            clocks.append((self._born, spec.lifetime, "lifetime"))  # type: ignore[arg-type]
        self._clocks = tuple(clocks)

        self._where: dict[K, _Slot] = {}
        self._notes: dict[K, _Note] = {}
        self._gone: OrderedDict[K, bool] = OrderedDict()
        self._next_due = _INF
        self._lock = threading.Lock()
        self._expired = 0
        self._hook_errors = 0
        self._late = 0
        self._unknown = 0
        #: time-in-state statistics (issue 15); all logic in _stats.py
        self._stats: StatsRecorder | None = StatsRecorder(spec)
        # Optional callbacks for integrations (runners, metrics); None costs nothing.
        #: called (without arguments, possibly from another thread) when an earlier
        #: deadline than any before appears; runners use it to wake up early.
        self.on_earlier_deadline: Callable[[], None] | None = None
        #: called as ``on_leave(state_label, seconds_in_state)`` when a tracked request
        #: leaves a state (state change, terminal, forget, expiry); for histograms.
        self.on_leave: Callable[[str, float], None] | None = None
        _instrumentation._register_watchdog(self)

    # ------------------------------------------------------------------ state changes

    def observe(self, key: K, state: State, *, at: float | None = None) -> None:
        """Record that request *key* is in *state* now (or since *at*).

        The first sight of a key starts tracking it. A different state restarts the
        state clock; observing the same state again does not (Erlang ``gen_statem``'s
        ``state_timeout`` rule). A terminal state untracks the key. An observe for a key
        that has already concluded (expired, terminal, or forgotten, and still within
        ``memory``) is dropped and counted as a late event: it never re-arms the request.

        Args:
            at: when the request entered *state*, on the watchdog's clock; default: now.
                For changes captured (with a clock reading) where they happen and
                applied later, e.g. by the loop that runs :meth:`check`. Never later
                than now. To keep every deadline clock in time order, an *at* earlier
                than the start of the latest request on that clock is raised to it: the
                deadline may start a little later than *at*, never earlier.

        Raises:
            UnknownStateError: if *state* is not declared in the spec and
                ``unknown_state="raise"``.
            ValueError: if *at* is later than the clock's now (or NaN).
            TypeError: if *at* is not a number.
        """
        try:
            slot = self._slots.get(state)
        except TypeError:  # unhashable
            slot = None
        if slot is None:
            self._unknown_state(key, state)
            return
        if self._where.get(key) is slot:  # same state again: nothing to do
            return
        now = self._clock()
        if at is not None:
            now = _check_at(at, now)
        with self._lock:
            current = self._where.get(key)
            if current is slot:
                return
            if current is None:
                if slot.terminal:
                    return
                if key in self._gone:
                    self._late += 1
                    return
                if self._born is not None:
                    born = now if at is None else _not_before_tail(self._born, now)
                    self._born[key] = born
                    self._lower_due(born + self._lifetime)  # type: ignore[operator]
            else:
                if at is not None:  # a state never starts before the one it ends
                    entered = current.fifo.get(key)  # type: ignore[union-attr]
                    if entered is None:
                        entered = current.parked[key]
                    if entered > now:
                        now = entered
                self._leave(key, current, now)
                if slot.terminal:
                    if self._stats is not None:
                        self._stats.ended(key, slot.state)
                    self._untrack(key, _CONCLUDED)
                    return
            self._where[key] = slot
            fifo = slot.fifo
            start = now if at is None else _not_before_tail(fifo, now)  # type: ignore[arg-type]
            fifo[key] = start  # type: ignore[index]
            if slot.seconds is not None:
                due = start + slot.seconds
                if due < self._next_due:
                    self._lower_due(due)
            stall_fifo = slot.stall_fifo
            if stall_fifo is not None:
                if at is not None:
                    start = _not_before_tail(stall_fifo, now)
                stall_fifo[key] = start
                self._lower_due(start + slot.stall)  # type: ignore[operator]

    def heartbeat(self, key: K, *, at: float | None = None) -> bool:
        """Record progress for *key*: renews the progress (``stall``) window of its
        current state. Lifetime and state deadlines are not renewed.

        Args:
            at: when the progress was made, on the watchdog's clock; default: now. As
                for :meth:`observe`: never later than now, and raised to the latest
                renewal's time if earlier (a window never starts before a later one).

        Returns:
            True if *key* is tracked, False if it is not (a late heartbeat is harmless).

        Raises:
            ValueError: if *at* is later than the clock's now (or NaN).
            TypeError: if *at* is not a number.
        """
        now = self._clock()
        if at is not None:
            now = _check_at(at, now)
        with self._lock:
            slot = self._where.get(key)
            if slot is None:
                return False
            stall_fifo = slot.stall_fifo
            if stall_fifo is not None:
                previous = stall_fifo.pop(key, None)
                if at is not None:
                    now = _not_before_tail(stall_fifo, now)
                    if previous is not None and previous > now:
                        now = previous  # never shorten the window already granted
                stall_fifo[key] = now
                self._lower_due(now + slot.stall)  # type: ignore[operator]
            return True

    def forget(self, key: K, *, remember: bool = True) -> bool:
        """Stop tracking *key* (the abort path). Idempotent.

        Args:
            remember: keep the key among the concluded ones, so that a late ``observe``
                does not re-track it. Pass False to allow the key to be reused at once.

        Returns:
            True if *key* was tracked.
        """
        with self._lock:
            slot = self._where.get(key)
            if slot is None:
                if not remember:
                    self._gone.pop(key, None)
                elif key not in self._gone:
                    self._bury(key, _CONCLUDED)
                return False
            self._leave(key, slot, self._clock())
            if self._stats is not None:
                self._stats.ended(key, None)
            self._untrack(key, _CONCLUDED)
            if not remember:
                self._gone.pop(key, None)
            return True

    def annotate(
        self,
        key: K,
        *,
        attributes: Mapping[str, Any] | None = None,
        trace_parent: Any = None,
        trace_links: Iterable[Any] | None = None,
    ) -> bool:
        """Attach telemetry to a tracked request, handed to hooks in its
        :class:`~stallguard.Expiry`: span *attributes*, a parent span context
        (*trace_parent*: an OpenTelemetry ``Context`` or ``SpanContext``) and span
        contexts to link. Attributes merge with earlier ones.

        Returns:
            True if *key* is tracked; annotations on untracked keys are dropped (they
            would otherwise leak).
        """
        with self._lock:
            if key not in self._where:
                return False
            note = self._notes.get(key)
            if note is None:
                note = self._notes[key] = _Note()
            if attributes:
                note.attributes.update(attributes)
            if trace_parent is not None:
                note.parent = trace_parent
            if trace_links is not None:
                note.links = tuple(trace_links)
            return True

    # ------------------------------------------------------------------ deadlines

    def check(self, now: float | None = None) -> list[Expiry[K]]:
        """Expire every request that is overdue at *now* (default: the clock's now).

        In ``"enforce"`` mode each overdue request is untracked, remembered as expired,
        and handed to ``on_expire`` and to the instrumentation hooks, exactly once. In
        ``"report"`` mode it stays tracked and is handed to the instrumentation hooks
        once per deadline. A hook that raises is logged and counted; it never stops the
        check or loses another expiry.

        Cheap when nothing is due: one clock read and one comparison.

        Returns:
            The expiries, earliest deadline first.
        """
        if now is None:
            now = self._clock()
        if now < self._next_due:
            return []
        with self._lock:
            expiries = self._collect(now)
        if expiries:
            self._dispatch(expiries)
        return expiries

    def next_deadline(self) -> float | None:
        """The earliest time (on the watchdog's clock) at which a tracked request
        becomes overdue, or None if no deadline is pending."""
        with self._lock:
            due = self._exact_due()
            self._next_due = due
        return None if due == _INF else due

    def expired(self, key: K) -> bool:
        """True if *key* was force-failed by this watchdog (and is still remembered)."""
        return self._gone.get(key) is _EXPIRED

    def state_of(self, key: K) -> State | None:
        """The state *key* is tracked in, or None if it is not tracked."""
        slot = self._where.get(key)
        return None if slot is None else slot.state

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the watchdog reads (the ``clock`` argument)."""
        return self._clock

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __repr__(self) -> str:
        return (
            f"<stallguard.Watchdog spec={self.spec.name!r} mode={self.mode!r} "
            f"tracked={len(self._where)}>"
        )

    # ------------------------------------------------------------------ poll loops

    def guard(
        self,
        *,
        key: Callable[..., K],
        failed: Any,
        state: Callable[[Any], State] | Mapping[Any, State] | None = None,
        check: bool = True,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorate a ``poll()``-style function or method that returns a state.

        Each call observes the returned state for ``key(*args, **kwargs)`` (for a method,
        the instance comes first); with *check* it then runs :meth:`check` (one
        comparison when nothing is due). Once the key has been force-failed, the wrapper
        returns *failed* instead of whatever the poll returned, every time it is called
        (while the key is remembered). Terminal results untrack the key.

        Args:
            key: maps the call's arguments to the request key.
            failed: what to return for a force-failed request (SGLang: ``KVPoll.Failed``).
            state: maps the returned value to a spec state: a mapping or a callable
                (SGLang's ``KVPoll`` returns plain ints). Default: the value itself.
            check: run the deadline check on every call.

        Example::

            @watchdog.guard(key=lambda self: self.room, failed=KVPoll.Failed,
                            state={0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput",
                                   3: "Transferring", 4: "Success"})
            def poll(self) -> int: ...
        """
        if not callable(key):
            raise ConfigError(f"guard(key=...) must be a callable, got {key!r}")
        if isinstance(state, Mapping):
            mapping = dict(state)
            for value in mapping.values():
                if value not in self._slots:
                    raise ConfigError(
                        f"guard(state=...) maps to {value!r}, which spec "
                        f"{self.spec.name!r} does not declare"
                    )
            to_state: Callable[[Any], State] | None = mapping.__getitem__
        elif state is None or callable(state):
            to_state = state
        else:
            raise ConfigError(f"guard(state=...) must be a mapping or a callable, got {state!r}")
        where = self._where
        slots = self._slots
        spec_name = self.spec.name
        known_values = (
            tuple(f"{v!r} -> {state_label(st)}" for v, st in mapping.items())
            if isinstance(state, Mapping)
            else tuple(s.label for s in slots.values())
        )
        gone = self._gone
        observe = self.observe
        clock = self._clock

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            @functools.wraps(fn)
            def guarded(arg: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
                # A poll is nearly always called with one argument (poll(self)); calling
                # fn and key with it directly, not through (*args, **kwargs), saves
                # ~0.15 µs per call (CPython 3.11).
                if arg is _MISSING or args or kwargs:
                    if arg is not _MISSING:
                        args = (arg, *args)
                    result = fn(*args, **kwargs)
                    k = key(*args, **kwargs)
                else:
                    result = fn(arg)  # type: ignore[call-arg]
                    k = key(arg)
                if to_state is None:
                    s = result
                else:
                    try:
                        s = to_state(result)
                    except KeyError:
                        raise UnknownStateError(spec_name, k, result, known_values) from None
                slot = slots.get(s)
                if slot is None or where.get(k) is not slot:
                    observe(k, s)
                if check:
                    now = clock()
                    if now >= self._next_due:
                        self.check(now)
                if gone.get(k) is _EXPIRED:
                    return failed
                return result

            return cast("Callable[P, R]", guarded)

        return decorate

    # ------------------------------------------------------------------ operators

    def snapshot(self, *, requests: bool = True, now: float | None = None) -> Snapshot[K]:
        """A consistent view: per-state counts and oldest age, and (with *requests*)
        every tracked request with its state and time in state. O(tracked) with
        *requests*, O(states) without."""
        if now is None:
            now = self._clock()
        with self._lock:
            states: dict[str, StateSummary] = {}
            for slot in self._live:
                oldest = self._oldest(slot)
                states[slot.label] = StateSummary(
                    state=slot.state,
                    deadline=slot.deadline,
                    count=len(slot.fifo) + len(slot.parked),  # type: ignore[arg-type]
                    oldest_age=None if oldest is None else now - oldest,
                )
            tracked: list[TrackedRequest[K]] = []
            if requests:
                for slot in self._live:
                    for source in (slot.parked, slot.fifo):
                        for key, entered in source.items():  # type: ignore[union-attr]
                            tracked.append(
                                TrackedRequest(
                                    key=key,
                                    state=slot.state,
                                    entered_at=entered,
                                    age=now - entered,
                                    remaining=None
                                    if slot.seconds is None
                                    else entered + slot.seconds - now,
                                )
                            )
                tracked.sort(key=lambda r: r.entered_at)
            return Snapshot(
                spec=self.spec.name,
                mode=self.mode,
                at=now,
                states=states,
                requests=tuple(tracked),
                tracked=len(self._where),
                expired=self._expired,
                hook_errors=self._hook_errors,
                late_events=self._late,
            )

    def statistics(self) -> Statistics:
        """A frozen, consistent copy of the time-in-state statistics: per state, the
        seconds spent there by every request that left it, and the requests its deadline
        fired (or would have fired) on. See docs/advice.md."""
        with self._lock:
            if self._stats is None:
                raise RuntimeError("this watchdog records no statistics")
            return self._stats.freeze(self.mode)

    def advice(self, **kwargs: Any) -> Advice:
        """Suggested deadlines from :meth:`statistics`, flagging requests tracked now
        that are older than a suggestion: :func:`stallguard.advise` with this watchdog's
        snapshot; *kwargs* are :func:`~stallguard.advise`'s."""
        statistics = self.statistics()
        return advise(statistics, snapshot=self.snapshot(requests=True), **kwargs)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _oldest(slot: _Slot) -> float | None:
        oldest = None
        if slot.fifo:
            oldest = slot.fifo[next(iter(slot.fifo))]
        if slot.parked:
            parked = min(slot.parked.values())
            oldest = parked if oldest is None else min(oldest, parked)
        return oldest

    def _unknown_state(self, key: K, state: object) -> None:
        if self._raise_unknown:
            raise UnknownStateError(
                self.spec.name, key, state, tuple(s.label for s in self._slots.values())
            )
        with self._lock:
            self._unknown += 1

    def _lower_due(self, due: float) -> None:
        if due < self._next_due:
            self._next_due = due
            waker = self.on_earlier_deadline
            if waker is not None:
                waker()

    def _leave(self, key: K, slot: _Slot, now: float) -> None:
        """Remove *key* from *slot*'s FIFOs (lock held)."""
        entered = slot.fifo.pop(key, _MISSING)  # type: ignore[union-attr]
        if entered is _MISSING:
            entered = slot.parked.pop(key)
        if slot.stall_fifo is not None:
            slot.stall_fifo.pop(key, None)
        stats = self._stats
        if stats is not None:
            stats.left(slot.state, now - entered)
        if self.on_leave is not None:
            self._left(slot, now - entered)

    def _left(self, slot: _Slot, seconds: float) -> None:
        """Call the on_leave hook, if set (lock held)."""
        on_leave = self.on_leave
        if on_leave is not None:
            try:
                on_leave(slot.label, seconds)
            except Exception:
                self._hook_errors += 1
                log.exception("stallguard: on_leave hook failed")

    def _untrack(self, key: K, how: bool) -> None:
        """Drop every trace of a tracked *key* but its tombstone (lock held; the key
        has already left its slot)."""
        del self._where[key]
        if self._born is not None:
            self._born.pop(key, None)
        if self._notes:
            self._notes.pop(key, None)
        self._bury(key, how)

    def _bury(self, key: K, how: bool) -> None:
        gone = self._gone
        gone[key] = how
        if len(gone) > self._memory:
            gone.popitem(last=False)

    def _exact_due(self) -> float:
        due = _INF
        for fifo, seconds, _reason in self._clocks:
            if fifo:
                head = fifo[next(iter(fifo))] + seconds
                if head < due:
                    due = head
        return due

    def _collect(self, now: float) -> list[Expiry[K]]:
        """Find and retire everything due at *now* (lock held)."""
        expiries: list[Expiry[K]] = []
        append = expiries.append
        where = self._where
        notes = self._notes
        spec = self.spec.name
        mode = self.mode
        enforce = mode == "enforce"
        born = self._born
        gone = self._gone
        memory = self._memory
        stats = self._stats
        due, left = self._due(now, enforce)
        for _due, key, reason, since, deadline in due:
            slot = where[key]
            note = notes.get(key) if notes else None
            expiry = _new_expiry(Expiry)  # see _EXPIRY_FIELDS
            _set_key(expiry, key)
            _set_spec(expiry, spec)
            _set_state(expiry, slot.state)
            _set_entered_at(expiry, since)
            _set_elapsed(expiry, now - since)
            _set_deadline(expiry, deadline)
            _set_reason(expiry, reason)
            _set_mode(expiry, mode)
            if note is None:
                _set_attributes(expiry, {})
                _set_trace_parent(expiry, None)
                _set_trace_links(expiry, ())
            else:
                _set_attributes(expiry, dict(note.attributes))
                _set_trace_parent(expiry, note.parent)
                _set_trace_links(expiry, note.links)
            append(expiry)
            if stats is not None:
                stats.fired(key, slot.state, enforce)
            if enforce:
                # _leave() and _untrack(), inlined: the calls were ~15% of an expiry
                entered = slot.fifo.pop(key, _MISSING)  # type: ignore[union-attr]
                if entered is _MISSING:
                    entered = slot.parked.pop(key)
                if slot.stall_fifo is not None:
                    slot.stall_fifo.pop(key, None)
                if stats is not None:
                    stats.left(slot.state, now - entered)
                if self.on_leave is not None:
                    self._left(slot, now - entered)
                del where[key]
                if born is not None:
                    born.pop(key, None)
                if notes:
                    notes.pop(key, None)
                gone[key] = _EXPIRED
                if len(gone) > memory:
                    gone.popitem(last=False)
            elif reason == "state":
                slot.parked[key] = slot.fifo.pop(key)  # type: ignore[union-attr]
            elif reason == "stall":
                slot.stall_fifo.pop(key)  # type: ignore[union-attr]
            else:
                self._born.pop(key)  # type: ignore[union-attr]
        self._expired += len(expiries)
        self._next_due = self._exact_due() if left is None else left
        return expiries

    def _due(
        self, now: float, enforce: bool
    ) -> tuple[list[tuple[float, K, Any, float, float]], float | None]:
        """What is due at *now*, as ``(due, key, reason, since, deadline)`` tuples,
        earliest due first (lock held). Enforce: one per key, its earliest deadline (the
        key is then gone). Report: every overdue (key, deadline) pair, each once.

        Also returns the earliest due time left once those are retired, when it comes
        for free (None: ask _exact_due)."""
        if not self._stalled and self._born is None:
            # State deadlines only: a key sits in one FIFO, so it cannot be due twice
            # and there is nothing to merge. Retiring the due keys empties each FIFO up
            # to its first entry that is not due, whose due time is then the FIFO's next.
            due: list[tuple[float, K, Any, float, float]] = []
            add = due.append
            left = _INF
            for slot in self._timed:
                fifo = slot.fifo
                if not fifo:
                    continue
                seconds: float = slot.seconds  # type: ignore[assignment]
                for key, entered in fifo.items():
                    at = entered + seconds
                    if at > now:
                        if at < left:
                            left = at
                        break
                    add((at, key, "state", entered, seconds))
            if len(due) > 1:
                due.sort(key=_by_due)  # stable: FIFO order among equal due times
            return due, left

        # Several clocks: (key or (key, reason)) -> (due, key, reason, since, deadline)
        found: dict[Any, tuple[float, K, Any, float, float]] = {}
        for fifo, seconds, reason in self._clocks:
            for key, since in fifo.items():
                at = since + seconds
                if at > now:
                    break
                slot_key = key if enforce else (key, reason)
                prior = found.get(slot_key)
                if prior is None or at < prior[0]:
                    found[slot_key] = (at, key, reason, since, seconds)
        return sorted(found.values(), key=_by_due), None

    def _dispatch(self, expiries: list[Expiry[K]]) -> None:
        hooks: tuple[Callable[[Expiry[K]], object], ...] = _instrumentation._active_hooks()
        if self.mode == "enforce":
            hooks = self._enforce_hooks + hooks
        for expiry in expiries:
            for hook in hooks:
                try:
                    hook(expiry)
                except Exception:
                    with self._lock:
                        self._hook_errors += 1
                    log.exception(
                        "stallguard: expiry hook %r failed for key %r (spec %s)",
                        hook,
                        expiry.key,
                        expiry.spec,
                    )
